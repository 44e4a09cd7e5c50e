"""Human-readable rendering of results for the terminal."""

from __future__ import annotations

from .._text import escape_controls, table
from ..result import ScenarioResult

__all__ = ["render_result"]


def render_result(result: ScenarioResult) -> str:
    """A step table (step, action, verdict, message, observed) followed by the outcome.

    Every string the agent or a command supplied is shown with its control characters
    escaped, so it cannot add lines to the table or steer the terminal.
    """
    rows = [("step", "action", "verdict", "message", "observed")]
    rows += [
        (str(t.step), t.action or "-", t.verdict.value, t.message, t.observed or "")
        for t in result.trace
    ]
    lines = table(rows, rule=True)
    counts = ", ".join(f"{k} {v}" for k, v in result.verdicts.items() if v)
    lines += [
        "",
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
    return "\n".join(line.rstrip() for line in lines)
