"""Scenario specs and their loading from YAML or JSON files."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ._errors import CmbsError, validation_reason
from ._reading import ReadError, read_json, read_yaml
from .profile import builtin_profiles
from .protocol import ENV_NAME, CommandEnv, Limits, Network, PassedName, Posture

__all__ = ["ScenarioError", "ScenarioSpec", "load_scenario"]

_VAR = re.compile(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}")


#: The largest scenario file read (``/dev/zero`` or a file of gigabytes is refused).
SCENARIO_MAX_BYTES = 8 * 1024 * 1024


class ScenarioError(CmbsError, ValueError):
    """A scenario file could not be read or is not valid; the message is one line."""


class ScenarioSpec(BaseModel):
    """One scenario: the goal handed to the agent and the budget it runs under.

    ``files`` are written into the workdir before the agent's first step (the scenario's
    starting state); ``{{ name }}`` in the goal and in the files is replaced by
    ``vars[name]``; in the goal, ``env`` and ``readable`` every placeholder must name a
    var, while in files other ``{{ ... }}`` (Ansible's, Jinja's) are left alone. ``host``
    (``ssh://USER@HOST[:PORT]``) and ``host_key`` (a pinned public key) name a remote
    target for the command line's SSH executor.

    Commands see only an allow-listed environment (``PATH``, ``LANG``, ``LC_*``, ``TERM``,
    ``TZ``) plus ``env`` (values, ``{{ var }}`` filled) and the operator's variables named
    in ``pass_env`` (``KUBECONFIG``, say); ``network`` is ``all`` (``on``), ``none`` or a
    list of the only ``HOST:PORT`` destinations sandboxed commands reach; ``readable``
    lists host paths a sandboxed command may read although hidden or root's: an SSH key
    for the target host, say; ``limits`` bound what the scenario's commands use together
    (processes, memory, the sizes of ``/tmp`` and ``/dev/shm``). A leading ``~/`` in an
    ``env`` value or a ``readable`` path is the operator's home. A relative ``workdir``
    lies under the executor's workdir root; an absolute one must.

    ``expected`` is the posture a correct run ends with (``compliant`` or
    ``non_compliant``), for evaluating agents: ``cmbs batch`` scores runs against it. It is
    not part of any turn an agent is sent.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str = Field(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    goal: str = Field(min_length=1)
    vars: dict[str, str | int | float | bool] = Field(default_factory=dict)
    workdir: str | None = None
    deadline_s: float = Field(default=200.0, gt=0)
    max_steps: int = Field(default=50, ge=1)
    command_timeout_s: float | None = Field(default=None, gt=0)
    profile: str = "ciso"
    files: dict[str, str] = Field(default_factory=dict)
    host: str | None = Field(default=None, pattern=r"^ssh://")
    host_key: str | None = None
    env: dict[Annotated[str, Field(pattern=ENV_NAME)], str] = Field(default_factory=dict)
    pass_env: tuple[PassedName, ...] = ()
    network: Network = "all"
    readable: tuple[str, ...] = ()
    limits: Limits = Field(default_factory=Limits)
    expected: Posture | None = None

    @model_validator(mode="after")
    def _placeholders_filled(self) -> ScenarioSpec:
        """Every ``{{ name }}`` cmbs fills (goal, ``env``, ``readable``) names a var: a
        misspelt one would otherwise reach the agent or a command as written."""
        places = {"goal": [self.goal], "env": self.env.values(), "readable": self.readable}
        for place, texts in places.items():
            for text in texts:
                for match in _VAR.finditer(text):
                    if match.group(1) not in self.vars:
                        known = ", ".join(sorted(self.vars)) or "none"
                        raise ValueError(
                            f"{match.group(0)} in {place} names no var (vars: {known})"
                        )
        return self

    def with_vars(self, values: Mapping[str, str]) -> ScenarioSpec:
        """This scenario with some of its vars set (from ``--var``, say); an unknown name
        is refused, since a misspelt one would leave the default in place silently."""
        for name in values:
            if name not in self.vars:
                known = ", ".join(sorted(self.vars)) or "none"
                raise ScenarioError(f"the scenario has no var {name!r} (vars: {known})")
        return self.model_copy(update={"vars": {**self.vars, **values}})

    def rendered_goal(self) -> str:
        """The goal with its ``{{ var }}`` placeholders filled in."""
        return self._render(self.goal)

    def rendered_files(self) -> dict[str, str]:
        """The starting files, with ``{{ var }}`` filled in the same way."""
        return {path: self._render(content) for path, content in self.files.items()}

    def command_env(self) -> CommandEnv:
        """What the executor gives every command of this scenario besides the allow-list."""
        return CommandEnv(
            values={name: _home(self._render(value)) for name, value in self.env.items()},
            pass_env=self.pass_env,
            network=self.network,
            readable=tuple(os.path.expanduser(self._render(path)) for path in self.readable),
            limits=self.limits,
        )

    def _render(self, text: str) -> str:
        def fill(match: re.Match[str]) -> str:
            name = match.group(1)
            return str(self.vars[name]) if name in self.vars else match.group(0)

        return _VAR.sub(fill, text)


def _home(text: str) -> str:
    """A leading ``~/`` is the operator's home (a command's own ``HOME`` is elsewhere)."""
    return os.path.expanduser(text) if text.startswith("~/") else text


def load_scenario(path: str | Path, *, vars: Mapping[str, str] | None = None) -> ScenarioSpec:
    """Read a scenario file (``.json``, otherwise YAML); errors are one-line ScenarioErrors.

    A profile named by a relative path is looked for beside the scenario file; ``vars``
    set declared vars, as ``--var`` does.
    """
    path = Path(path)
    read = read_json if path.suffix == ".json" else read_yaml
    try:
        data: Any = read(path, what="a scenario file", max_bytes=SCENARIO_MAX_BYTES)
    except ReadError as exc:  # too large, too deep, not the format: one line naming it
        raise ScenarioError(str(exc)) from None
    if not isinstance(data, dict):
        raise ScenarioError(f"{path}: a scenario must be a mapping of fields")
    try:
        spec = ScenarioSpec.model_validate(data)
    except ValidationError as exc:
        raise ScenarioError(
            f"{path}: {validation_reason(exc, fields=ScenarioSpec.model_fields)}"
        ) from exc
    if spec.profile not in builtin_profiles():  # a file: beside the scenario, if relative
        spec = spec.model_copy(update={"profile": str(path.parent / spec.profile)})
    return spec.with_vars(vars) if vars else spec
