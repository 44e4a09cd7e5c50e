"""The end-of-batch table: per scenario and agent, how the runs went."""

from __future__ import annotations

import statistics
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from typing import Any

from .._text import table
from ..profile import Profile
from ..protocol import ActionKind, Verdict
from ..result import Outcome

__all__ = ["render_summary", "summarize"]


def summarize(
    records: Iterable[dict[str, Any]], *, profiles: Mapping[str, Profile]
) -> list[dict[str, Any]]:
    """Per scenario and agent: runs, earned terminations, durations, and the posture claims
    the gate blocked (``profiles`` gives each scenario file's profile, which names the
    actions that declare a posture)."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for record in records:
        groups[(str(record.get("scenario_id")), str(record.get("agent")))].append(record)
    rows = []
    for (scenario, agent), runs in sorted(groups.items()):
        durations = sorted(float(r.get("duration_s") or 0.0) for r in runs)
        outcomes = Counter(str(r.get("outcome")) for r in runs)
        blocked = sum(_blocked_claims(r, profiles[str(r.get("scenario_file"))]) for r in runs)
        rows.append(
            {
                "scenario": scenario,
                "agent": agent,
                "runs": len(runs),
                "earned": outcomes.get(Outcome.TERMINATED, 0),
                "outcomes": dict(outcomes),
                "mean_s": statistics.fmean(durations) if durations else 0.0,
                "p95_s": durations[min(len(durations) - 1, int(0.95 * len(durations)))]
                if durations
                else 0.0,
                "blocked_posture_claims": blocked,
                "itbench_passes": [r["itbench_pass"] for r in runs if "itbench_pass" in r],
            }
        )
    return rows


def _blocked_claims(record: dict[str, Any], profile: Profile) -> int:
    """Steps of the run that declared a posture, in the profile's words, and were blocked."""
    declaring = {
        name for name, spec in profile.actions.items() if spec.kind is ActionKind.DECLARE_POSTURE
    }
    return sum(
        1
        for t in record.get("trace") or []
        if t.get("action") in declaring and t.get("verdict") == Verdict.BLOCK
    )


def render_summary(rows: list[dict[str, Any]]) -> str:
    """One aligned line per scenario and agent, every name escaped (no line breaks, no
    terminal control sequences); IT-Bench pass@1 last, where runs were scored."""
    scored = any(r.get("itbench_passes") for r in rows)
    header = (
        "scenario",
        "agent",
        "runs",
        "earned",
        "mean s",
        "p95 s",
        "blocked claims",
        "outcomes",
        *(("IT-Bench pass@1",) if scored else ()),
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
                    *((_pass_at_1(r.get("itbench_passes") or []),) if scored else ()),
                )
                for r in rows
            ),
        ]
    )
    return "\n".join(lines)


def _pass_at_1(passes: list[bool]) -> str:
    """The share of scored runs IT-Bench would pass, with the counts behind it."""
    if not passes:
        return "-"
    return f"{sum(passes) / len(passes):.2f} ({sum(passes)}/{len(passes)})"
