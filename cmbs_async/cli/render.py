"""Human-readable rendering of results for the terminal."""

from __future__ import annotations

from .._text import escape_controls, table
from ..result import Outcome, ScenarioResult, TraceEntry

__all__ = ["render_outcome", "render_result", "render_step"]

#: the most of a step's observation a live line shows
_OBSERVED_SHOWN = 60
#: the most lines of a failed agent program's stderr shown under its outcome
_STDERR_LINES = 20


def render_result(result: ScenarioResult) -> str:
    """A step table (step, action, verdict, message, observed) followed by the outcome;
    the outcome alone for a run that ended before its first step.

    Every string the agent or a command supplied is shown with its control characters
    escaped, so it cannot add lines to the table or steer the terminal.
    """
    rows = [("step", "action", "verdict", "message", "observed")]
    rows += [
        (str(t.step), t.action or "-", t.verdict.value, t.message, t.observed or "")
        for t in result.trace
    ]
    lines = [*table(rows, rule=True), ""] if result.trace else []
    return "\n".join(line.rstrip() for line in [*lines, render_outcome(result)])


def render_step(entry: TraceEntry) -> str:
    """One line for a step as it happens: its number, action, verdict and message, the
    start of what it observed, which mask stopped it (``BLOCK``, ``CONTINUE``) and why
    the evidence rule refused its output (if it did); every string escaped."""
    observed = entry.observed or ""
    if len(observed) > _OBSERVED_SHOWN:
        observed = observed[: _OBSERVED_SHOWN - 3] + "..."
    parts = [
        f"{entry.step:>4}  {entry.action or '-':<15}  {entry.verdict.value:<9}  {entry.message}",
        observed,
    ]
    if entry.stopped_by:
        parts.append(f"[mask: {entry.stopped_by}]")
    if entry.refused:
        parts.append(f"[evidence refused: {entry.refused}]")
    return "  ".join(escape_controls(part) for part in parts if part)


def render_outcome(result: ScenarioResult) -> str:
    """How the run ended, below its steps: scenario, outcome, posture, counts, duration,
    the reason and the workdir, and a failed agent program's last stderr lines."""
    counts = ", ".join(f"{k} {v}" for k, v in result.verdicts.items() if v)
    lines = [
        f"scenario  {escape_controls(result.scenario_id)}",
        f"outcome   {result.outcome.value}" + (" (earned)" if result.earned else ""),
        f"posture   {result.posture or '-'}",
        f"steps     {result.steps} ({counts or 'none'})",
        f"duration  {result.duration_s:.2f} s",
    ]
    if result.reason:
        lines.append(f"reason    {escape_controls(result.reason)}")
    if result.workdir:
        lines.append(f"workdir   {escape_controls(result.workdir)}")
    if result.outcome is Outcome.AGENT_ERROR and result.agent_stderr:
        said = result.agent_stderr.rstrip("\n").split("\n")
        cut = (
            f", the last {_STDERR_LINES} of {len(said)} lines" if len(said) > _STDERR_LINES else ""
        )
        lines.append(f"agent stderr{cut}:")
        lines += [f"  | {escape_controls(line)}" for line in said[-_STDERR_LINES:]]
    return "\n".join(line.rstrip() for line in lines)
