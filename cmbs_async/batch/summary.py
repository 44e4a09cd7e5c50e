"""The end of a batch: per scenario and agent, how the runs went; per agent, its accuracy
against the scenarios' expected postures and a confusion table; the failures by reason."""

from __future__ import annotations

import statistics
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from typing import Any

from .._text import escape_controls, table
from ..profile import Profile
from ..protocol import ActionKind, Verdict
from ..result import Outcome

__all__ = ["by_agent", "failures", "render_evaluation", "render_summary", "summarize"]

#: The postures a scenario may expect, and the columns of a confusion table (None: the run
#: ended without one, as every run that did not earn its termination does).
POSTURES = ("compliant", "non_compliant")
#: The longest reason shown in the failures (the results file keeps it whole).
REASON_CHARS = 160


def summarize(
    records: Iterable[dict[str, Any]], *, profiles: Mapping[str, Profile]
) -> list[dict[str, Any]]:
    """Per scenario and agent: runs, earned terminations, durations, and the posture claims
    the gate blocked (``profiles`` gives each scenario file's profile, which names the
    actions that declare a posture). A scenario is its id and its file: two files with one
    id are two rows, each ``scenario`` shown with its file."""
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = defaultdict(list)
    for record in records:
        named = (str(record.get("scenario_id")), str(record.get("scenario_file")))
        groups[(*named, str(record.get("agent")))].append(record)
    files: dict[str, set[str]] = defaultdict(set)
    for scenario_id, file, _ in groups:
        files[scenario_id].add(file)
    rows = []
    for (scenario, file, agent), runs in sorted(groups.items()):
        durations = sorted(float(r.get("duration_s") or 0.0) for r in runs)
        outcomes = Counter(str(r.get("outcome")) for r in runs)
        blocked = sum(_blocked_claims(r, profiles[str(r.get("scenario_file"))]) for r in runs)
        rows.append(
            {
                "scenario": scenario if len(files[scenario]) == 1 else f"{scenario} ({file})",
                "scenario_file": file,
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
                "judged": sum(r.get("expected") is not None for r in runs),
                "correct": sum(_correct(r) for r in runs),
            }
        )
    return rows


def _correct(record: dict[str, Any]) -> bool:
    """Ended terminated with the posture its scenario expects."""
    expected = record.get("expected")
    return (
        expected is not None
        and record.get("outcome") == Outcome.TERMINATED
        and record.get("posture") == expected
    )


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
    judged = any(r.get("judged") for r in rows)
    header = (
        "scenario",
        "agent",
        "runs",
        "earned",
        *(("accuracy",) if judged else ()),
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
                    *((_share(r.get("correct", 0), r.get("judged", 0)),) if judged else ()),
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


def _share(part: int, whole: int) -> str:
    return f"{part / whole:.2f} ({part}/{whole})" if whole else "-"


def by_agent(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per agent: runs, earned, accuracy (``correct`` of ``judged``: the runs whose
    scenario expects a posture, and those that ended terminated with it), the confusion
    counts (expected posture, posture at the end or None) and the IT-Bench passes."""
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for record in records:
        groups[str(record.get("agent"))].append(record)
    rows = []
    for agent, runs in sorted(groups.items()):
        confusion: Counter[tuple[str, str | None]] = Counter(
            (
                str(r["expected"]),
                r.get("posture") if r.get("outcome") == Outcome.TERMINATED else None,
            )
            for r in runs
            if r.get("expected") is not None
        )
        rows.append(
            {
                "agent": agent,
                "runs": len(runs),
                "earned": sum(r.get("outcome") == Outcome.TERMINATED for r in runs),
                "judged": sum(confusion.values()),
                "correct": sum(_correct(r) for r in runs),
                "confusion": confusion,
                "itbench_passes": [r["itbench_pass"] for r in runs if "itbench_pass" in r],
            }
        )
    return rows


def failures(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The runs that did not earn their termination, and those that earned it with a
    posture other than the expected one, grouped by outcome and reason, the largest group
    first: each with its count and the scenario ids."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for record in records:
        outcome = str(record.get("outcome"))
        if outcome != Outcome.TERMINATED:
            reason = str(record.get("reason") or _last_word(record))
        elif record.get("expected") is not None and not _correct(record):
            reason = f"posture {record.get('posture')}, expected {record.get('expected')}"
        else:
            continue
        groups[(outcome, reason)].append(record)
    ordered = sorted(groups.items(), key=lambda item: (-len(item[1]), item[0]))
    return [
        {
            "outcome": outcome,
            "reason": reason,
            "runs": len(runs),
            "scenarios": sorted({str(r.get("scenario_id")) for r in runs}),
            "agents": sorted({str(r.get("agent")) for r in runs}),
        }
        for (outcome, reason), runs in ordered
    ]


def _last_word(record: dict[str, Any]) -> str:
    """For a run that ended with no reason of its own (the agent stopped, its budget ran
    out): what the gate said to its last step."""
    trace = record.get("trace") or []
    if not trace or not isinstance(trace[-1], dict):
        return "no reason recorded"
    last = trace[-1]
    return f"last step {last.get('action')}: {last.get('verdict')}, {last.get('message')}"


def render_evaluation(records: list[dict[str, Any]]) -> str:
    """Below the table: per agent, earned, accuracy and IT-Bench pass@1 with a confusion
    table (where scenarios expect a posture, or more than one agent ran), then the failures
    grouped by reason. Every name and reason is escaped; empty when there is nothing to
    say."""
    agents = by_agent(records)
    judged = any(a["judged"] for a in agents)
    scored = any(a["itbench_passes"] for a in agents)
    parts: list[str] = []
    if judged or len(agents) > 1:
        header = ("agent", "runs", "earned", "accuracy", *(("IT-Bench pass@1",) if scored else ()))
        rows = [
            (
                a["agent"],
                str(a["runs"]),
                _share(a["earned"], a["runs"]),
                _share(a["correct"], a["judged"]),
                *((_pass_at_1(a["itbench_passes"]),) if scored else ()),
            )
            for a in agents
        ]
        lines = table([header, *rows])
        parts.append("\n".join(lines))
    for a in agents:
        if not a["judged"]:
            continue
        confusion = a["confusion"]
        title = (
            f"confusion, {escape_controls(a['agent'])} "
            "(rows: expected posture; columns: posture at the end)"
        )
        cells = [
            ("expected", *POSTURES, "no posture"),
            *(
                (want, *(str(confusion.get((want, got), 0)) for got in (*POSTURES, None)))
                for want in POSTURES
            ),
        ]
        parts.append("\n".join([title, *table(cells)]))
    failed = failures(records)
    if failed:
        count = sum(f["runs"] for f in failed)
        lines = [f"failures by reason ({count} run{'s' if count != 1 else ''})"]
        for f in failed:
            reason = escape_controls(f["reason"])
            if len(reason) > REASON_CHARS:
                reason = reason[: REASON_CHARS - 3] + "..."
            runs = f"{f['runs']} run{'s' if f['runs'] != 1 else ''}"
            lines.append(f"  {escape_controls(f['outcome'])} ({runs}): {reason}")
            lines.append(f"      scenarios: {escape_controls(', '.join(f['scenarios']))}")
            if len(agents) > 1:
                lines.append(f"      agents: {escape_controls(', '.join(f['agents']))}")
        parts.append("\n".join(lines))
    return "\n\n".join(parts)
