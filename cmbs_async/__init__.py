"""cmbs-async: supervise language-model agents doing IT compliance work.

A permissive, stateful gate (CMBS) that observes execution outcomes and blocks only
epistemically invalid moves, run as three anyio actors under one deadline.

Every error it raises on purpose derives from :class:`CmbsError`; its events go to the
standard logger ``cmbs_async`` and are shown only as the application configures logging.
"""

from executors import ExecutorError

from ._errors import CmbsError
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
from .audit import (
    AuditError,
    AuditStore,
    SigningKeyError,
    SQLiteAuditStore,
    load_or_create_key,
    replay,
)
from .batch import BatchError
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
    "AuditError",
    "AuditStore",
    "BatchError",
    "Belief",
    "CallableAgent",
    "CallbackHuman",
    "CmbsError",
    "CommandPayload",
    "Commitment",
    "ConfigError",
    "ConsoleHuman",
    "Decision",
    "ExecutorError",
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
    "ReviewerError",
    "Rules",
    "SQLiteAuditStore",
    "ScenarioError",
    "ScenarioResult",
    "ScenarioSpec",
    "ScriptedAgent",
    "SigningKeyError",
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
