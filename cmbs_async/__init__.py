"""cmbs-async: supervise language-model agents doing IT compliance work.

A permissive, stateful gate (CMBS) that observes execution outcomes and blocks only
epistemically invalid moves, run as three anyio actors under one deadline.

Every error it raises on purpose derives from :class:`CmbsError`; its events go to the
standard logger ``cmbs_async`` and are shown only as the application configures logging.
Each name below is imported on first use, so that importing one part of the package
(``cmbs_async.audit``, say) does not load the rest: the gate, the review layer, httpx.
"""

import typing

from executors import CmbsError, ExecutorError
from executors._lazy import lazy_names as _lazy_names

if typing.TYPE_CHECKING:
    from ._reading import ReadError
    from .agents import (
        Agent,
        AgentMessage,
        AgentProcessError,
        AgentSandbox,
        CallableAgent,
        ModelEndpointError,
        OpenAIAgent,
        ScriptedAgent,
        SpecError,
        StdioAgent,
    )
    from .audit import (
        AuditError,
        AuditStore,
        CheckpointError,
        SigningKeyError,
        SQLiteAuditStore,
        load_or_create_key,
    )
    from .batch import BatchError
    from .config import RunConfig
    from .evaluating import Programs, run_evaluation
    from .evaluators import Evaluation, Evaluator
    from .gate import Decision, Gate, Messages, ObservationOwed, Payload, Rules
    from .handle import RunHandle
    from .itbench import CannotScore, ItbenchError
    from .masks import Masks
    from .profile import (
        ActionSpec,
        PostureSignal,
        Profile,
        ProfileError,
        builtin_profiles,
        load_profile,
    )
    from .protocol import (
        Action,
        ActionKind,
        AgentStep,
        ArtifactPayload,
        Assessment,
        Belief,
        CommandEnv,
        CommandPayload,
        Commitment,
        Containment,
        EvaluationPayload,
        FileChange,
        InputFile,
        Limits,
        MasksView,
        Observation,
        Output,
        PosturePayload,
        Program,
        Response,
        Turn,
        Verdict,
    )
    from .replayer import ReplayReport, replay
    from .result import Outcome, ScenarioResult, TraceEntry
    from .review import (
        CallbackHuman,
        ConfigError,
        ConsoleHuman,
        OpenAIReviewer,
        Review,
        ReviewerError,
        SupervisionConfig,
    )
    from .runtime import run_scenario
    from .scenario import ScenarioError, ScenarioSpec, load_scenario
    from .session import Session, SessionEnded, StepReply
    from .telemetry import Telemetry, TelemetryError

__version__ = "0.1.0"

__all__ = [
    "Action",
    "ActionKind",
    "ActionSpec",
    "Agent",
    "AgentMessage",
    "AgentProcessError",
    "AgentSandbox",
    "AgentStep",
    "ArtifactPayload",
    "Assessment",
    "AuditError",
    "AuditStore",
    "BatchError",
    "Belief",
    "CallableAgent",
    "CallbackHuman",
    "CannotScore",
    "CheckpointError",
    "CmbsError",
    "CommandEnv",
    "CommandPayload",
    "Commitment",
    "ConfigError",
    "ConsoleHuman",
    "Containment",
    "Decision",
    "Evaluation",
    "EvaluationPayload",
    "Evaluator",
    "ExecutorError",
    "FileChange",
    "Gate",
    "InputFile",
    "ItbenchError",
    "Limits",
    "Masks",
    "MasksView",
    "Messages",
    "ModelEndpointError",
    "Observation",
    "OpenAIAgent",
    "OpenAIReviewer",
    "ObservationOwed",
    "Outcome",
    "Output",
    "Payload",
    "PosturePayload",
    "PostureSignal",
    "Profile",
    "ProfileError",
    "Program",
    "Programs",
    "ReadError",
    "ReplayReport",
    "Response",
    "Review",
    "ReviewerError",
    "Rules",
    "RunConfig",
    "RunHandle",
    "SQLiteAuditStore",
    "ScenarioError",
    "ScenarioResult",
    "ScenarioSpec",
    "ScriptedAgent",
    "Session",
    "SessionEnded",
    "SigningKeyError",
    "SpecError",
    "StdioAgent",
    "StepReply",
    "SupervisionConfig",
    "Telemetry",
    "TelemetryError",
    "TraceEntry",
    "Turn",
    "Verdict",
    "__version__",
    "builtin_profiles",
    "load_or_create_key",
    "load_profile",
    "load_scenario",
    "replay",
    "run_evaluation",
    "run_scenario",
]

#: the module each public name lives in
_HOMES: dict[str, tuple[str, ...]] = {
    "agents": (
        "Agent",
        "AgentMessage",
        "AgentProcessError",
        "AgentSandbox",
        "CallableAgent",
        "ModelEndpointError",
        "OpenAIAgent",
        "ScriptedAgent",
        "SpecError",
        "StdioAgent",
    ),
    "audit": (
        "AuditError",
        "AuditStore",
        "CheckpointError",
        "SigningKeyError",
        "SQLiteAuditStore",
        "load_or_create_key",
    ),
    "batch": ("BatchError",),
    "evaluating": ("Programs", "run_evaluation"),
    "evaluators": ("Evaluation", "Evaluator"),
    "gate": (
        "Decision",
        "Gate",
        "Messages",
        "ObservationOwed",
        "Payload",
        "Rules",
    ),
    "itbench": ("CannotScore", "ItbenchError"),
    "masks": ("Masks",),
    "profile": (
        "ActionSpec",
        "PostureSignal",
        "Profile",
        "ProfileError",
        "builtin_profiles",
        "load_profile",
    ),
    "protocol": (
        "Action",
        "ActionKind",
        "AgentStep",
        "ArtifactPayload",
        "Assessment",
        "Belief",
        "CommandEnv",
        "CommandPayload",
        "Commitment",
        "Containment",
        "EvaluationPayload",
        "FileChange",
        "InputFile",
        "Limits",
        "MasksView",
        "Observation",
        "Output",
        "PosturePayload",
        "Program",
        "Response",
        "Turn",
        "Verdict",
    ),
    "_reading": ("ReadError",),
    "replayer": (
        "ReplayReport",
        "replay",
    ),
    "result": (
        "Outcome",
        "ScenarioResult",
        "TraceEntry",
    ),
    "review": (
        "CallbackHuman",
        "ConfigError",
        "ConsoleHuman",
        "OpenAIReviewer",
        "Review",
        "ReviewerError",
        "SupervisionConfig",
    ),
    "config": ("RunConfig",),
    "telemetry": ("Telemetry", "TelemetryError"),
    "handle": ("RunHandle",),
    "runtime": ("run_scenario",),
    "scenario": (
        "ScenarioError",
        "ScenarioSpec",
        "load_scenario",
    ),
    "session": ("Session", "SessionEnded", "StepReply"),
}
_HOME = {name: module for module, names in _HOMES.items() for name in names}


__getattr__, __dir__ = _lazy_names(__name__, _HOME, __all__)
