"""The messages that cross the actors' streams.

Everything here is a frozen pydantic model: the agent's step (belief, action, free text),
the supervisor's response, the observation an executor returns and the turn an agent is
handed. Nothing in this module knows a domain; which action types exist and what their
payloads look like is the profile's business (see :mod:`cmbs_async.profile`).
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from executors.observation import (
    ENV_NAME,
    Check,
    CommandEnv,
    Containment,
    FileChange,
    InputFile,
    Limits,
    Network,
    Observation,
    Output,
    PassedName,
    Program,
)

from ._bounds import ARTIFACT_MAX_CHARS, COMMAND_MAX_CHARS, PATH_MAX_CHARS

__all__ = [
    "ENV_NAME",
    "EVIDENCE_ORDER",
    "Action",
    "ActionKind",
    "AffordanceState",
    "AgentStep",
    "ArtifactPayload",
    "Assessment",
    "Belief",
    "Check",
    "CommandEnv",
    "CommandPayload",
    "Commitment",
    "Containment",
    "EmptyPayload",
    "EvaluationPayload",
    "EvidenceState",
    "FileChange",
    "InputFile",
    "Limits",
    "MasksView",
    "Network",
    "Observation",
    "Output",
    "PAYLOAD_MODELS",
    "PassedName",
    "Posture",
    "PostureClaim",
    "Program",
    "PosturePayload",
    "Response",
    "Scope",
    "Turn",
    "Verdict",
]

AffordanceState = Literal["unknown", "available", "unavailable"]
EvidenceState = Literal["none", "attempted", "successful"]
Posture = Literal["compliant", "non_compliant"]
PostureClaim = Literal["unknown", "compliant", "non_compliant"]

EVIDENCE_ORDER: dict[str, int] = {"none": 0, "attempted": 1, "successful": 2}


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Verdict(StrEnum):
    """What the gate decided about one agent step."""

    ALLOW = "ALLOW"
    BLOCK = "BLOCK"
    CONTINUE = "CONTINUE"
    TERMINATE = "TERMINATE"


class ActionKind(StrEnum):
    """What an action does, independent of its name in a profile."""

    WRITE_ARTIFACT = "write_artifact"
    RUN_COMMAND = "run_command"
    RUN_EVALUATION = "run_evaluation"
    DECLARE_POSTURE = "declare_posture"
    TERMINATE = "terminate"


class ArtifactPayload(_Model):
    """Payload of an action that writes a file into the scenario's workdir (its content
    at most :data:`~cmbs_async._bounds.ARTIFACT_MAX_CHARS` characters)."""

    content: str = Field(max_length=ARTIFACT_MAX_CHARS)
    path: str = Field(min_length=1, max_length=PATH_MAX_CHARS)


class CommandPayload(_Model):
    """Payload of an action that runs a shell command in the scenario's workdir (at most
    :data:`~cmbs_async._bounds.COMMAND_MAX_CHARS` characters)."""

    command: str = Field(min_length=1, max_length=COMMAND_MAX_CHARS)


class EvaluationPayload(BaseModel):
    """Payload of an action that runs its profile's evaluator: the values of the
    evaluator's placeholders (``{"policy": "policy.rego", "input": "data.json"}``)."""

    model_config = ConfigDict(extra="allow", frozen=True)


class PosturePayload(_Model):
    """Payload of a posture declaration."""

    posture: Posture


class EmptyPayload(_Model):
    """Payload of an action that takes none (terminate)."""


PAYLOAD_MODELS: dict[ActionKind, type[BaseModel]] = {
    ActionKind.WRITE_ARTIFACT: ArtifactPayload,
    ActionKind.RUN_COMMAND: CommandPayload,
    ActionKind.RUN_EVALUATION: EvaluationPayload,
    ActionKind.DECLARE_POSTURE: PosturePayload,
    ActionKind.TERMINATE: EmptyPayload,
}


class Belief(_Model):
    """The only belief object an agent may emit (seed 001, section 2).

    Missing affordances count as ``unknown``; ``unknown`` is always consistent.
    """

    affordances: dict[str, AffordanceState] = Field(default_factory=dict)
    posture: PostureClaim = "unknown"
    evidence: EvidenceState = "none"


class Action(_Model):
    """A proposed action: its type names an entry of the profile's vocabulary."""

    type: str = Field(min_length=1)
    payload: dict[str, Any] = Field(default_factory=dict)


class Scope(_Model):
    """What the agent says is inside and outside the bounds of its step."""

    in_bounds: str = ""
    out_bounds: str = ""


class Commitment(_Model):
    """Pre-checkpoint: how the agent reads the goal for this step (seed 002)."""

    interpretation: str
    scope: Scope = Field(default_factory=Scope)
    assumptions: tuple[str, ...] = ()


class Assessment(_Model):
    """Post-checkpoint: the agent's assessment of its previous executed step (seed 002)."""

    commitment_met: bool
    scope_changed: bool = False
    confidence: float = Field(ge=0.0, le=1.0)
    concerns: tuple[str, ...] = ()


class AgentStep(_Model):
    """One agent message: belief, proposed action and optional free text.

    ``commitment`` and ``assessment`` are optional checkpoints for the review layer;
    agents that send neither work unchanged.
    """

    belief: Belief
    action: Action
    free_text: str | None = None
    commitment: Commitment | None = None
    assessment: Assessment | None = None


class MasksView(_Model):
    """A read-only snapshot of the supervisor's belief masks A-E."""

    affordances: dict[str, AffordanceState]
    evidence: EvidenceState
    posture_admissible: dict[str, bool]
    posture_history: tuple[PostureClaim, ...]
    posture_stable: bool
    termination_allowed: bool


class Response(_Model):
    """The supervisor's answer to one agent step: neutral and procedural.

    ``correction`` carries a review's guidance (REORIENT, or a human's modification);
    the gate itself never writes one.
    """

    step: int
    verdict: Verdict
    message: str
    detail: str | None = None
    masks: MasksView
    last_observation: Observation | None = None
    correction: str | None = None


class Turn(_Model):
    """What an agent is handed before each step it takes."""

    scenario_id: str
    goal: str
    vars: dict[str, str | int | float | bool] = Field(default_factory=dict)
    actions: tuple[str, ...] = ()
    step: int
    response: Response | None = None
