"""Human-readable rendering of results for the terminal."""

from __future__ import annotations

from ..result import ScenarioResult

__all__ = ["render_result"]


def render_result(result: ScenarioResult) -> str:
    """A step table (step, action, verdict, message, observed) followed by the outcome."""
    rows = [("step", "action", "verdict", "message", "observed")]
    rows += [
        (str(t.step), t.action or "-", t.verdict.value, t.message, t.observed or "")
        for t in result.trace
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = [
        "  ".join(cell.ljust(width) for cell, width in zip(row[:4], widths, strict=True))
        + "  "
        + row[4]
        for row in rows
    ]
    lines.insert(1, "  ".join("-" * w for w in widths) + "  " + "-" * 8)
    counts = ", ".join(f"{k} {v}" for k, v in result.verdicts.items() if v)
    lines += [
        "",
        f"scenario  {result.scenario_id}",
        f"outcome   {result.outcome.value}" + (" (earned)" if result.earned else ""),
        f"posture   {result.posture or '-'}",
        f"steps     {result.steps} ({counts or 'none'})",
        f"duration  {result.duration_s:.2f} s",
    ]
    if result.reason:
        lines.append(f"reason    {result.reason}")
    if result.workdir:
        lines.append(f"workdir   {result.workdir}")
    return "\n".join(line.rstrip() for line in lines)
