"""Structured events: their names, and the logger they go through.

The library never configures logging; whoever runs it does (the CLI does, see
:mod:`cmbs_async.cli.logs`). Events are bound to ``scenario_id`` and ``step`` through
structlog's contextvars, so any processor chain can pick them up.
"""

from __future__ import annotations

from typing import Any

import structlog

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
    EXECUTOR_FAILED = "executor.failed"
    AUDIT_END_NOT_RECORDED = "audit.end_not_recorded"


logger: Any = structlog.get_logger("cmbs_async")
