"""What a finished scenario run reports."""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict

from .protocol import Containment, MasksView, Posture, Verdict

__all__ = ["Outcome", "ScenarioResult", "TraceEntry"]


class Outcome(StrEnum):
    """How a run ended. Only ``terminated`` is an earned termination."""

    TERMINATED = "terminated"
    DEADLINE_EXCEEDED = "deadline_exceeded"
    STEP_BUDGET_EXHAUSTED = "step_budget_exhausted"
    AGENT_FINISHED = "agent_finished"
    AGENT_ERROR = "agent_error"
    EXECUTOR_ERROR = "executor_error"
    PAUSED_NO_HUMAN = "paused_no_human"
    ABORTED_BY_HUMAN = "aborted_by_human"
    AUDIT_ERROR = "audit_error"
    CANCELLED = "cancelled"


class TraceEntry(BaseModel):
    """One line of the run's trace: what the agent proposed, what the gate said, and for
    a command that ran, its output as captured (capped head and tail).

    ``masks`` are the belief masks after the step; ``refused`` why the evidence rule kept
    the step's output from moving a posture (a signal matched it), if it did;
    ``stopped_by`` which mask a ``BLOCK`` or ``CONTINUE`` came from, in words
    (``"evidence: none, not successful"``), when the gate's message says."""

    model_config = ConfigDict(frozen=True)

    step: int
    action: str | None
    verdict: Verdict
    message: str
    observed: str | None = None
    stdout: str | None = None
    stderr: str | None = None
    masks: MasksView | None = None
    refused: str | None = None
    stopped_by: str | None = None


class ScenarioResult(BaseModel):
    """The outcome of one scenario run, as the CLI's ``--json`` prints it."""

    model_config = ConfigDict(frozen=True)

    scenario_id: str
    outcome: Outcome
    posture: Posture | None
    steps: int
    verdicts: dict[str, int]
    duration_s: float
    trace: list[TraceEntry]
    reason: str | None = None
    masks: MasksView
    workdir: str | None = None
    session_id: str | None = None
    sandbox: str | None = None
    containment: Containment | None = None
    cleanup_error: str | None = None
    #: the last bytes (64 KiB at most) an agent program wrote on its stderr, when it failed
    agent_stderr: str | None = None

    @property
    def earned(self) -> bool:
        return self.outcome is Outcome.TERMINATED

    def summary(self, *, output: bool = True) -> dict[str, Any]:
        """The stable JSON contract of ``cmbs run --json``; ``output=False`` leaves the
        commands' captured output, the masks after each step and the agent program's
        stderr out (a batch's results file keeps none)."""
        return {
            "scenario_id": self.scenario_id,
            "outcome": self.outcome.value,
            "posture": self.posture,
            "steps": self.steps,
            "verdicts": self.verdicts,
            "duration_s": round(self.duration_s, 4),
            "reason": self.reason,
            "workdir": self.workdir,
            "session_id": self.session_id,
            "sandbox": self.sandbox,
            "containment": self.containment.model_dump(mode="json") if self.containment else None,
            "cleanup_error": self.cleanup_error,
            "trace": [_step(t, output=output) for t in self.trace],
        } | ({"agent_stderr": self.agent_stderr} if output else {})


def _step(entry: TraceEntry, *, output: bool) -> dict[str, Any]:
    """A trace line as ``cmbs run --json`` shows it; ``output`` adds what the command
    printed and the masks after the step."""
    step: dict[str, Any] = {
        "step": entry.step,
        "action": entry.action,
        "verdict": entry.verdict.value,
        "message": entry.message,
        "observed": entry.observed,
        "stopped_by": entry.stopped_by,
        "refused": entry.refused,
    }
    if output:
        step["stdout"], step["stderr"] = entry.stdout, entry.stderr
        step["masks"] = entry.masks.model_dump(mode="json") if entry.masks else None
    return step
