"""``RunConfig``: how a run is supervised, written once and shared by every way to run.

:func:`~cmbs_async.run_scenario`, :class:`~cmbs_async.Session` and the batch runner take
the same frozen configuration, so a batch of a thousand scenarios and a single run in a
library are configured alike, and a configuration can be kept, compared and reused.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .audit.store import AuditStore
from .gate import Rules
from .profile import Profile, load_profile
from .result import TraceEntry
from .review.layer import Review
from .scenario import ScenarioSpec

if TYPE_CHECKING:  # the telemetry module imports OpenTelemetry only when it is used
    from .telemetry import Telemetry

__all__ = ["RunConfig"]


@dataclass(frozen=True, slots=True, kw_only=True)
class RunConfig:
    """How a run is supervised; every field has a default, so ``RunConfig()`` is a plain
    run under the scenario's own profile, deadline and step budget.

    ``profile``, ``deadline`` (seconds) and ``max_steps`` replace the scenario's when set.
    ``keep_workdir`` keeps a temporary workdir (the scenario names none) after the run.
    ``review`` turns the review layer on; ``audit`` records every step, review, decision
    and observation, each durable before it takes effect; ``rules`` replaces the gate's
    rules (:class:`cmbs_async.gate.Rules`), for baselines and experiments; ``telemetry``
    exports a trace of the run (OpenTelemetry). ``on_step`` is told each line of the trace
    as it is made (to show the run as it goes): it runs in the supervisor, so it must be
    quick and must not raise.
    """

    profile: Profile | None = None
    deadline: float | None = None
    max_steps: int | None = None
    keep_workdir: bool = False
    review: Review | None = None
    audit: AuditStore | None = None
    rules: Rules | None = None
    telemetry: Telemetry | None = None
    on_step: Callable[[TraceEntry], None] | None = None

    def __post_init__(self) -> None:
        if self.deadline is not None and not self.deadline > 0:
            raise ValueError(f"deadline must be a positive number of seconds, not {self.deadline}")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"max_steps must be at least 1, not {self.max_steps}")

    def replace(self, **changes: Any) -> RunConfig:
        """This configuration with ``changes`` (field names as keywords)."""
        return dataclasses.replace(self, **changes)

    def profile_for(self, spec: ScenarioSpec) -> Profile:
        """The profile a run of ``spec`` is judged under: this one's, or the scenario's."""
        return self.profile or load_profile(spec.profile)

    def deadline_for(self, spec: ScenarioSpec) -> float:
        """The run's budget in seconds: this one's, or the scenario's."""
        return self.deadline if self.deadline is not None else spec.deadline_s

    def max_steps_for(self, spec: ScenarioSpec) -> int:
        """The run's step budget: this one's, or the scenario's."""
        return self.max_steps or spec.max_steps
