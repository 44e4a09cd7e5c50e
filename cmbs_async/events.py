"""Structured events: their names, and the logger they go through.

Events go to the standard logger ``cmbs_async`` (see :mod:`executors.events`, where the
logger class lives so that executors log the same way). The library configures no
logging; whoever runs it does (the CLI does, see :mod:`cmbs_async.cli.logs`). Events carry
``scenario_id`` and ``step``, bound through structlog's contextvars.
"""

from __future__ import annotations

from executors.events import EventLogger

__all__ = ["Events", "logger"]


class Events:
    """Every event name the runtime emits."""

    SCENARIO_STARTED = "scenario.started"
    SCENARIO_FINISHED = "scenario.finished"
    TURN_SENT = "turn.sent"  # supervisor -> agent
    STEP_RECEIVED = "step.received"  # agent -> supervisor
    AGENT_FAILED = "agent.failed"
    AGENT_DONE = "agent.done"
    GATE_VERDICT = "gate.verdict"
    REVIEW_VERDICT = "review.verdict"
    EXEC_REQUESTED = "exec.requested"  # supervisor -> executor
    EXEC_OBSERVED = "exec.observed"  # executor -> supervisor
    EVIDENCE_REFUSED = "evidence.refused"  # a posture signal from no admitted evaluator
    EXECUTOR_FAILED = "executor.failed"
    AUDIT_END_NOT_RECORDED = "audit.end_not_recorded"


logger = EventLogger("cmbs_async")
