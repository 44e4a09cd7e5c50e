"""Profiles: the only place where a domain is described, as data.

A profile names the affordances (capabilities), the action vocabulary (each action's
kind and the affordance it needs) and the observation signals that move the masks
(which evidence level a success earns, and output patterns that eliminate a posture).
The gate reads a profile; it never contains domain knowledge of its own.
"""

from __future__ import annotations

import re
from functools import cache
from importlib import resources
from pathlib import Path, PurePosixPath
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ._errors import CmbsError, validation_reason
from ._reading import ReadError, read_json, read_yaml
from .evaluators import Evaluator
from .protocol import PAYLOAD_MODELS, ActionKind, AgentStep, EvidenceState, Observation

__all__ = [
    "ActionSpec",
    "PostureSignal",
    "Profile",
    "ProfileError",
    "builtin_profiles",
    "load_profile",
]


class ProfileError(CmbsError, ValueError):
    """A profile could not be found or is not valid; the message is one line."""


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ActionSpec(_Model):
    """One entry of the action vocabulary.

    ``requires`` names the affordance the action needs; ``requires_for`` overrides it by
    the suffix of the file an artifact action writes (``{".rego": "opa_eval"}``: a Rego
    policy needs no Kubernetes; ``null``: nothing). An action of kind ``run_evaluation``
    names the ``evaluator`` it runs; its payload holds the evaluator's placeholders.
    """

    kind: ActionKind
    evaluator: str | None = None
    requires: str | None = None
    requires_for: dict[str, str | None] = Field(default_factory=dict)
    evidence_on_success: EvidenceState | None = None
    posture_signals: tuple[str, ...] = ()
    description: str = ""

    def required(self, path: str | None = None) -> str | None:
        """The affordance the action needs, writing ``path`` if it writes one."""
        if path is not None and self.requires_for:
            suffix = PurePosixPath(path).suffix
            if suffix in self.requires_for:
                return self.requires_for[suffix]
        return self.requires


class PostureSignal(_Model):
    """Output patterns of a successful command that eliminate a posture.

    A line matching ``violation`` makes ``compliant`` inadmissible. Otherwise a line
    matching ``no_violation`` makes ``non_compliant`` inadmissible. No match: nothing
    changes (absence of evidence eliminates nothing).

    ``evaluators`` names the profile's evaluators whose output may carry the signal: then
    only such an evaluation, run as its argument vector over no input the agent wrote,
    moves a posture (see :mod:`cmbs_async.evaluators`). Empty: any command's output may.
    """

    stream: Literal["stdout", "stderr", "both"] = "stdout"
    violation: tuple[re.Pattern[str], ...] = ()
    no_violation: tuple[re.Pattern[str], ...] = ()
    evaluators: tuple[str, ...] = ()

    @field_validator("violation", "no_violation", mode="before")
    @classmethod
    def _compile(cls, value: Any) -> Any:
        if not isinstance(value, list | tuple):
            return value
        try:
            return tuple(re.compile(p, re.MULTILINE) if isinstance(p, str) else p for p in value)
        except re.error as exc:
            raise ValueError(f"invalid pattern: {exc}") from exc

    def eliminates(self, observation: Observation) -> Literal["compliant", "non_compliant"] | None:
        """The posture this observation's output rules out, if any."""
        if self.stream == "stdout":
            text = observation.stdout.text
        elif self.stream == "stderr":
            text = observation.stderr.text
        else:
            text = observation.stdout.text + "\n" + observation.stderr.text
        if any(p.search(text) for p in self.violation):
            return "compliant"
        if any(p.search(text) for p in self.no_violation):
            return "non_compliant"
        return None


class Profile(_Model):
    """A domain described as data: affordances, actions and observation signals."""

    name: str = Field(min_length=1)
    description: str = ""
    affordances: tuple[str, ...]
    stability_window: int = Field(default=2, ge=1)
    actions: dict[str, ActionSpec]
    signals: dict[str, PostureSignal] = Field(default_factory=dict)
    #: the commands whose output may carry a posture, as argument templates
    evaluators: dict[str, Evaluator] = Field(default_factory=dict)
    #: the programs that provide each affordance: one observed missing (exit 127) closes
    #: the affordance only once every program that provides it was observed missing
    providers: dict[str, tuple[str, ...]] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _check_references(self) -> Profile:
        kinds = {spec.kind for spec in self.actions.values()}
        for needed in (ActionKind.DECLARE_POSTURE, ActionKind.TERMINATE):
            if needed not in kinds:
                raise ValueError(f"the vocabulary has no action of kind {needed.value}")
        for name, spec in self.actions.items():
            for wanted in (spec.requires, *spec.requires_for.values()):
                if wanted is not None and wanted not in self.affordances:
                    raise ValueError(f"action {name} requires unknown affordance {wanted}")
            for signal in spec.posture_signals:
                if signal not in self.signals:
                    raise ValueError(f"action {name} names unknown signal {signal}")
            if (spec.kind is ActionKind.RUN_EVALUATION) != (spec.evaluator is not None):
                raise ValueError(f"action {name}: an evaluator for run_evaluation actions only")
            if spec.evaluator is not None and spec.evaluator not in self.evaluators:
                raise ValueError(f"action {name} names unknown evaluator {spec.evaluator}")
        for signal_name, posture_signal in self.signals.items():
            for evaluator in posture_signal.evaluators:
                if evaluator not in self.evaluators:
                    raise ValueError(f"signal {signal_name} names unknown evaluator {evaluator}")
        for affordance in self.providers:
            if affordance not in self.affordances:
                raise ValueError(f"providers name unknown affordance {affordance}")
        return self

    def step_json_schema(self) -> dict[str, Any]:
        """The JSON Schema of an agent step under this profile's vocabulary."""
        schema = AgentStep.model_json_schema()
        belief = schema["$defs"]["Belief"]
        state = belief["properties"]["affordances"]["additionalProperties"]
        belief["properties"]["affordances"] = {
            "type": "object",
            "properties": {name: state for name in self.affordances},
            "additionalProperties": False,
        }
        variants = []
        for name, spec in sorted(self.actions.items()):
            payload = PAYLOAD_MODELS[spec.kind].model_json_schema()
            payload.pop("title", None)
            if spec.evaluator is not None:
                payload |= self.evaluators[spec.evaluator].payload_schema()
            variants.append(
                {
                    "type": "object",
                    "title": name,
                    "description": spec.description,
                    "properties": {"type": {"const": name}, "payload": payload},
                    "required": ["type", "payload"] if payload.get("required") else ["type"],
                    "additionalProperties": False,
                }
            )
        schema["$defs"]["Action"] = {"oneOf": variants}
        schema["title"] = f"AgentStep ({self.name} profile)"
        return schema


def builtin_profiles() -> list[str]:
    """Names of the profiles shipped with the package."""
    return list(_builtin_names())


@cache
def _builtin_names() -> tuple[str, ...]:
    folder = resources.files("cmbs_async") / "profiles"
    return tuple(
        sorted(p.name.removesuffix(".yaml") for p in folder.iterdir() if p.name.endswith(".yaml"))
    )


@cache
def _load_builtin(name: str) -> Profile:
    text = (resources.files("cmbs_async") / "profiles" / f"{name}.yaml").read_text("utf-8")
    return _parse(yaml.safe_load(text), f"built-in profile {name}")


def load_profile(name_or_path: str | Path) -> Profile:
    """A built-in profile by name, or a profile from a YAML or JSON file; a profile of the
    caller's own (a change to it changes no other run's)."""
    if isinstance(name_or_path, str) and name_or_path in _builtin_names():
        return _load_builtin(name_or_path).model_copy(deep=True)
    path = Path(name_or_path)
    try:
        found = path.is_file()
    except OSError:  # a name no file can have (too long, say)
        found = False
    if not found:
        known = ", ".join(builtin_profiles())
        said = str(name_or_path)
        shown = repr(said if len(said) <= 80 else said[:80] + "...")
        raise ProfileError(f"no profile {shown} (built-in: {known}; or a file path)")
    read = read_json if path.suffix == ".json" else read_yaml
    try:  # capped in size and nesting, as a scenario file is (8 MiB, 64 levels)
        data = read(path, what="a profile file")
    except ReadError as exc:
        raise ProfileError(str(exc)) from None
    return _parse(data, str(path))


def _parse(data: Any, origin: str) -> Profile:
    try:
        return Profile.model_validate(data)
    except ValidationError as exc:
        raise ProfileError(
            f"{origin}: {validation_reason(exc, fields=Profile.model_fields)}"
        ) from exc
