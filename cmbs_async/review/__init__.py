"""The review layer (seeds 002 and 003): reconcile, supervise, reorient, pause."""

from .config import ConfigError, SupervisionConfig, load_config
from .human import CallbackHuman, ConsoleHuman, HumanChannel, HumanDecision, HumanRequest
from .layer import REORIENTED, Review, ReviewAction, ReviewLayer, ReviewState, SupervisionRecord
from .reconcile import CONFIDENCE_THRESHOLD, MAX_ASSUMPTIONS, Flag, Severity, reconcile
from .reviewer import (
    OpenAIReviewer,
    Reviewer,
    ReviewerError,
    ReviewRequest,
    ReviewVerdict,
    Verdict3,
    build_prompt,
    parse_verdict,
)

__all__ = [
    "CONFIDENCE_THRESHOLD",
    "MAX_ASSUMPTIONS",
    "REORIENTED",
    "CallbackHuman",
    "ConfigError",
    "ConsoleHuman",
    "Flag",
    "HumanChannel",
    "HumanDecision",
    "HumanRequest",
    "OpenAIReviewer",
    "Review",
    "ReviewAction",
    "ReviewLayer",
    "ReviewRequest",
    "ReviewState",
    "ReviewVerdict",
    "Reviewer",
    "ReviewerError",
    "Severity",
    "SupervisionConfig",
    "SupervisionRecord",
    "Verdict3",
    "build_prompt",
    "load_config",
    "parse_verdict",
    "reconcile",
]
