"""cmbs-async: supervise language-model agents doing IT compliance work.

A permissive, stateful gate (CMBS) that observes execution outcomes and blocks only
epistemically invalid moves, run as three anyio actors under one deadline.
"""

from .agents import (
    Agent,
    AgentMessage,
    AgentProcessError,
    CallableAgent,
    ModelEndpointError,
    OpenAIAgent,
    ScriptedAgent,
    StdioAgent,
)
from .audit import AuditStore, SQLiteAuditStore, load_or_create_key, replay
from .gate import Decision, Gate, Messages, Payload, Rules
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
    CommandPayload,
    Commitment,
    MasksView,
    Observation,
    Output,
    PosturePayload,
    Response,
    Turn,
    Verdict,
)
from .result import Outcome, ScenarioResult, TraceEntry
from .review import CallbackHuman, ConsoleHuman, OpenAIReviewer, Review, SupervisionConfig
from .runtime import run_scenario
from .scenario import ScenarioError, ScenarioSpec, load_scenario

__version__ = "0.1.0"

__all__ = [
    "Action",
    "ActionKind",
    "ActionSpec",
    "Agent",
    "AgentMessage",
    "AgentProcessError",
    "AgentStep",
    "ArtifactPayload",
    "Assessment",
    "AuditStore",
    "Belief",
    "CallableAgent",
    "CallbackHuman",
    "CommandPayload",
    "Commitment",
    "ConsoleHuman",
    "Decision",
    "Gate",
    "Masks",
    "MasksView",
    "Messages",
    "ModelEndpointError",
    "Observation",
    "OpenAIAgent",
    "OpenAIReviewer",
    "Outcome",
    "Output",
    "Payload",
    "PostureSignal",
    "PosturePayload",
    "Profile",
    "ProfileError",
    "Response",
    "Review",
    "Rules",
    "SQLiteAuditStore",
    "ScenarioError",
    "ScenarioResult",
    "ScenarioSpec",
    "ScriptedAgent",
    "StdioAgent",
    "SupervisionConfig",
    "TraceEntry",
    "Turn",
    "Verdict",
    "__version__",
    "builtin_profiles",
    "load_or_create_key",
    "load_profile",
    "load_scenario",
    "replay",
    "run_scenario",
]
