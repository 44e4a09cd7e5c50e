"""The end-of-batch table: per scenario and agent, how the runs went."""

from __future__ import annotations

import statistics
from collections import Counter, defaultdict
from collections.abc import Iterable
from typing import Any

from .._text import table

__all__ = ["render_summary", "summarize"]


def summarize(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    groups: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for record in records:
        groups[(str(record.get("scenario_id")), str(record.get("agent")))].append(record)
    rows = []
    for (scenario, agent), runs in sorted(groups.items()):
        durations = sorted(float(r.get("duration_s") or 0.0) for r in runs)
        outcomes = Counter(str(r.get("outcome")) for r in runs)
        blocked = sum(
            1
            for r in runs
            for t in r.get("trace") or []
            if t.get("action") == "declare_posture" and t.get("verdict") == "BLOCK"
        )
        rows.append(
            {
                "scenario": scenario,
                "agent": agent,
                "runs": len(runs),
                "earned": outcomes.get("terminated", 0),
                "outcomes": dict(outcomes),
                "mean_s": statistics.fmean(durations) if durations else 0.0,
                "p95_s": durations[min(len(durations) - 1, int(0.95 * len(durations)))]
                if durations
                else 0.0,
                "blocked_posture_claims": blocked,
            }
        )
    return rows


def render_summary(rows: list[dict[str, Any]]) -> str:
    """One aligned line per scenario and agent, every name escaped (no line breaks, no
    terminal control sequences)."""
    header = (
        "scenario",
        "agent",
        "runs",
        "earned",
        "mean s",
        "p95 s",
        "blocked claims",
        "outcomes",
    )
    lines = table(
        [
            header,
            *(
                (
                    r["scenario"],
                    r["agent"],
                    str(r["runs"]),
                    str(r["earned"]),
                    f"{r['mean_s']:.2f}",
                    f"{r['p95_s']:.2f}",
                    str(r["blocked_posture_claims"]),
                    ", ".join(f"{k} {v}" for k, v in sorted(r["outcomes"].items())),
                )
                for r in rows
            ),
        ]
    )
    return "\n".join(lines)
