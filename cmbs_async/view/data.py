"""What the viewer shows, read from audit databases and batch results files, read-only.

The runs list reads a few fields of two records per session with SQLite's JSON functions
(never a whole profile), and only the records added since the last read, so that it stays
fast on 10,000 sessions; a results file adds its agent spec, IT-Bench score and batch to
the runs it recorded (and lists those it did not). A run's page reads its records, judges
them again (:func:`~cmbs_async.replayer.replay`) for the masks after each step, and
verifies the database against the operator's key. Each results line's signature is
checked against that key too (once per line); a batch is summed up over the lines that
verify, by :mod:`cmbs_async.batch`'s own functions, so its numbers are those ``cmbs batch
--resume`` would keep; the others are shown apart, by why.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from .._reading import ReadError, read_bytes
from ..audit import AuditError, SQLiteAuditStore
from ..audit.log import key_id
from ..audit.signing import load_public_key
from ..audit.store import AuditRecord, RecordKind
from ..batch import by_agent, failures
from ..batch.results import RESULTS_MAX_BYTES, untrusted_line
from ..batch.summary import POSTURES
from ..profile import Profile
from ..replayer import ReplayedStep, replay

__all__ = [
    "LINE_CHECKS",
    "BatchView",
    "Library",
    "RunRow",
    "RunView",
    "StepView",
    "Verification",
    "file_state",
]

#: the sessions begun and the runs ended since a record (records only ever grow)
_BEGUN = """
SELECT rowid, session_id, json_extract(body, '$.ts'), json_extract(body, '$.data.scenario.id'),
       json_extract(body, '$.data.scenario.expected'), json_extract(body, '$.data.agent'),
       json_extract(body, '$.data.profile.name')
FROM records WHERE kind = 'session' AND rowid > ? ORDER BY rowid
"""
_ENDED = """
SELECT rowid, session_id, json_extract(body, '$.data.outcome'),
       json_extract(body, '$.data.posture'), json_extract(body, '$.data.steps'),
       json_extract(body, '$.data.duration_s'), json_extract(body, '$.data.reason')
FROM records WHERE kind = 'end' AND rowid > ? ORDER BY rowid
"""


#: what a results line's check found, in words: ``verified`` with the operator's key, or
#: why not (as :func:`~cmbs_async.batch.results.untrusted_line` says), or not checked
LINE_CHECKS = {
    "verified": "verified",
    "broken": "not verified (changed after signing)",
    "other key": "not verified (signed by another key)",
    "unsigned": "not verified (unsigned)",
    "unchecked": "not checked (no key given)",
}
#: the lines that do not count, in the order the batch page lists them: a heading and why
_APART = {
    "broken": (
        "Changed after signing",
        "signed with the operator's key, then edited: what they say now is not what was signed",
    ),
    "other key": ("Signed by another key", "signed, but not with the operator's key"),
    "unsigned": ("Unsigned", "written by an older cmbs, or by hand"),
}
#: the most lines of each kind the batch page lists
APART_SHOWN = 50


@dataclass(frozen=True, slots=True)
class RunRow:
    """One run in the list: from an audit database (``source``, its index), a results
    file (``batch``, its label), or both."""

    source: int | None  # which database; None: only a results file has it
    session_id: str  # "" where the run was not recorded (batch --no-audit)
    started: float | None
    scenario: str
    expected: str | None
    outcome: str | None
    posture: str | None
    steps: int | None
    duration_s: float | None
    reason: str | None
    agent: str | None = None
    itbench_pass: bool | None = None
    batch: str | None = None
    profile: str | None = None
    #: what checking its results line found (a key of :data:`LINE_CHECKS`); None: no line
    line: str | None = None
    #: what the list's text search looks in, lower-cased (made once: it is searched often)
    text: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        words = (self.scenario, self.session_id, self.agent, self.batch, self.reason)
        object.__setattr__(self, "text", " ".join(w for w in words if w).lower())

    @property
    def correct(self) -> bool | None:
        """Ended terminated with the expected posture, where one was expected."""
        if self.expected is None:
            return None
        return self.outcome == "terminated" and self.posture == self.expected

    @property
    def line_said(self) -> str | None:
        """Its results line's check, in words: ``verified``, ``not verified (unsigned)``..."""
        return LINE_CHECKS[self.line] if self.line else None


@dataclass(slots=True)
class StepView:
    """One step of a run: what the agent sent, what the gate said, what ran."""

    step: int
    said: str = ""
    action: str | None = None
    payload: Any = None
    verdict: str | None = None
    message: str | None = None
    detail: str | None = None
    observation: dict[str, Any] | None = None
    evidence: dict[str, Any] | None = None
    review: dict[str, Any] | None = None
    masks: dict[str, Any] | None = None
    #: which mask kept a ``BLOCK`` or ``CONTINUE`` from going through, in the words of the
    #: run's trace (:attr:`~cmbs_async.result.TraceEntry.stopped_by`), as judged again
    stopped_by: str | None = None
    #: why the evidence rule kept what the step ran from moving a posture (a signal matched
    #: its output), as the trace's :attr:`~cmbs_async.result.TraceEntry.refused` says it
    refused: str | None = None
    #: where the gate judging the step again said otherwise: ("judged again", its verdict,
    #: its message) beside the recorded verdict, or ("recorded", ...) beside another
    #: profile's
    other: tuple[str, str, str] | None = None


@dataclass(frozen=True, slots=True)
class Verification:
    """Whether a session's records hold, against the operator's key."""

    verified: bool
    reasons: tuple[str, ...]
    key: str | None  # the trusted key's id


@dataclass(slots=True)
class RunView:
    """One run's page."""

    row: RunRow
    steps: list[StepView]
    containment: dict[str, Any] | None
    verification: Verification
    #: where judging the records again gave another verdict than the one recorded
    differences: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class BatchView:
    """A results file summed up as ``cmbs batch`` sums it up, over the lines that verify
    with the operator's key (every line when no key is known: ``key`` is None); each run
    counts from its last line that does, as after ``--retry-errors``. The lines that do
    not verify are in ``apart``, by why, never in the numbers.

    A file's lines and its runs are counted apart: a run retried or resumed has a line
    per try (``lines`` > ``all_runs``)."""

    path: str
    label: str
    error: str | None = None
    key: str | None = None  # the id of the key the lines were checked against
    lines: int = 0  # every line holding a result, one per run's try
    verified: int = 0  # of them, those that verify (all of them when no key is known)
    #: of them, those that do not verify, by why in words ("changed after signing", ...)
    unverified: dict[str, int] = field(default_factory=dict)
    unsigned: int = 0  # of the lines, when no key is known, those unsigned
    all_runs: int = 0  # the runs the lines are of, counted or not
    #: each run's last line that does not verify, by why (``broken``, ``other key``,
    #: ``unsigned``; a run that also has one that does is marked ``again``): each
    #: ``check``, ``heading``, ``why``, ``runs``, ``signers`` (the other keys' ids),
    #: ``shown`` (up to :data:`APART_SHOWN` lines, as :func:`_apart_line` tells them)
    apart: tuple[dict[str, Any], ...] = ()
    #: the runs with no line that verifies: not counted; their outcomes, as written
    apart_runs: int = 0
    apart_outcomes: dict[str, int] = field(default_factory=dict)
    runs: int = 0  # the runs counted: those with a line that verifies
    outcomes: dict[str, int] = field(default_factory=dict)
    earned: int = 0
    judged: int = 0  # runs whose scenario expects a posture
    correct: int = 0  # and that ended terminated with it
    passes: tuple[bool, ...] = ()  # the IT-Bench scores, where runs were scored
    #: per agent: :func:`cmbs_async.batch.by_agent`'s rows, with ``matrix``: the confusion
    #: table as rows of (expected posture, counts by posture at the end)
    agents: tuple[dict[str, Any], ...] = ()
    #: :func:`cmbs_async.batch.failures`: the runs that did not earn their termination
    #: or earned it with the wrong posture, by outcome and reason
    failures: tuple[dict[str, Any], ...] = ()


@dataclass
class _Source:
    """One database, and what was read of it: only what was added since is read again."""

    path: Path
    rows: dict[str, RunRow] = field(default_factory=dict)
    stamp: tuple[float, int] | None = None
    seen: int = 0  # the last record read


@dataclass(frozen=True, slots=True)
class _Line:
    """A results line, what checking it found (a key of :data:`LINE_CHECKS`), and whether
    it counts: it verifies, or no key is known."""

    record: dict[str, Any]
    check: str
    counts: bool


@dataclass
class _Results:
    """One results file, read again whole when it changes (a batch appends to it); a line
    already checked is not checked again."""

    path: Path
    label: str
    #: the last line of each run that counts and of each that does not, in file order
    lines: list[_Line] = field(default_factory=list)
    #: every line holding a result (a run retried or resumed has one per try), by what
    #: checking it found; and the runs they are lines of
    checks: Counter[str] = field(default_factory=Counter)
    runs: int = 0
    error: str | None = None
    stamp: tuple[float, int] | None = None
    batch: BatchView | None = None
    checked: dict[bytes, tuple[str, bool]] = field(default_factory=dict)  # by the line read


@dataclass(frozen=True)
class _Listing:
    """The runs of every file as of ``stamps``, newest first, and what the list's filters
    offer: read again only when a file changed."""

    stamps: tuple[tuple[float, int] | None, ...]
    rows: list[RunRow]
    by_session: dict[str, RunRow]
    choices: dict[str, list[str]]


class Library:
    """The audit databases and results files a viewer shows, read on demand (and again
    when a file changes: a batch in progress shows up as it runs)."""

    def __init__(
        self,
        databases: Sequence[Path],
        results: Sequence[Path] = (),
        *,
        trusted_key: str | None = None,
    ) -> None:
        self.databases = list(databases)
        self._sources = [_Source(path) for path in self.databases]
        self.results = list(results)
        names = Counter(path.name for path in self.results)
        self._results = [
            _Results(path, path.name if names[path.name] == 1 else str(path))
            for path in self.results
        ]
        self.trusted_key = trusted_key
        self._check = _line_check(trusted_key)
        self._lock = threading.Lock()
        self._listing: _Listing | None = None
        #: verifications already made, by session and the database's state then
        self._verified: dict[tuple[str, tuple[float, int] | None], Verification] = {}

    # -- the runs list -------------------------------------------------------------------
    def runs(self) -> list[RunRow]:
        """Every run of every database and results file, newest first (the same list
        until a file changes: do not change it)."""
        return self._current().rows

    def choices(self) -> dict[str, list[str]]:
        """The values the list's select filters offer: ``agent``, ``batch``, ``outcome``."""
        return self._current().choices

    def _current(self) -> _Listing:
        with self._lock:
            stamps = []
            for number, source in enumerate(self._sources):
                stamp = file_state(source.path)
                if stamp != source.stamp:
                    _read_new(number, source)
                    source.stamp = stamp
                stamps.append(stamp)
            for results in self._results:
                stamps.append(_refresh(results, self._check))
            if self._listing is None or self._listing.stamps != tuple(stamps):
                self._listing = self._merged(tuple(stamps))
            return self._listing

    def _merged(self, stamps: tuple[tuple[float, int] | None, ...]) -> _Listing:
        """The databases' runs with what the results files say of them, and the runs only
        a results file has."""
        batched: dict[str, tuple[_Line, str]] = {}
        unrecorded: list[RunRow] = []
        recorded = {session for source in self._sources for session in source.rows}
        for results in self._results:
            for line in results.lines:
                session = _text(line.record.get("session_id"))
                if session and session in recorded:
                    known = batched.get(session)  # a line that counts over one that does not
                    if known is None or line.counts or not known[0].counts:
                        batched[session] = (line, results.label)
                else:
                    unrecorded.append(_result_row(line, results.label))
        found: list[RunRow] = []
        by_session: dict[str, RunRow] = {}
        for source in self._sources:  # a session in two databases (a copy) is listed twice
            for row in source.rows.values():
                if row.session_id in batched:
                    row = _with_result(row, *batched[row.session_id])
                found.append(row)
                by_session.setdefault(row.session_id, row)
        rows = sorted(
            [*found, *unrecorded],
            key=lambda row: row.started or 0.0,
            reverse=True,
        )
        choices = {
            "agent": sorted({row.agent for row in rows if row.agent}),
            "batch": [results.label for results in self._results],
            "outcome": sorted({row.outcome for row in rows if row.outcome}),
        }
        return _Listing(stamps, rows, by_session, choices)

    def state(self) -> str:
        """What changes when any file shown does (a page reloads when it does)."""
        return repr([file_state(path) for path in [*self.databases, *self.results]])

    def find(self, session_id: str) -> RunRow | None:
        """The recorded run ``session_id`` (one an audit database holds)."""
        row = self._current().by_session.get(session_id)
        return row if row is not None and row.source is not None else None

    # -- one run -------------------------------------------------------------------------
    def run(self, session_id: str, *, profile: Profile | None = None) -> RunView | None:
        """A run's steps with the masks after each, and whether its records hold."""
        row = self.find(session_id)
        if row is None or row.source is None:
            return None
        store = SQLiteAuditStore(self._sources[row.source].path, read_only=True)
        try:
            records = list(store.records(session_id))
            try:
                report = replay(store, session_id, profile=profile)
                replayed, differences = report.steps, report.mismatches
            except AuditError as exc:
                replayed, differences = (), (f"cannot be judged again: {exc}",)
            verification = self._verify(store, session_id)
        finally:
            store.close()
        steps, containment = _steps(records, replayed, rejudged=profile is not None)
        return RunView(row, steps, containment, verification, differences)

    def _verify(self, store: SQLiteAuditStore, session_id: str) -> Verification:
        """The session's records checked against the trusted key (once per state of its
        database: a signature check is the page's largest cost)."""
        marker = (session_id, file_state(store.path))
        known = self._verified.get(marker)
        if known is None:
            known = self._verified[marker] = self._verified_now(store, session_id)
        return known

    def _verified_now(self, store: SQLiteAuditStore, session_id: str) -> Verification:
        key = self.trusted_key
        problems = store.integrity_problems(session_id, trusted_key=key)
        if key is None:
            problems.append("not checked against a key: give the viewer --public-key FILE")
        return Verification(
            not problems, tuple(dict.fromkeys(problems)), key_id(key) if key else None
        )

    # -- batches ---------------------------------------------------------------------------
    def batches(self) -> list[BatchView]:
        """Each results file: outcome counts, earned, accuracy, pass@1, failures by reason,
        per agent and in all, as ``cmbs batch`` reports them."""
        with self._lock:
            found = []
            for results in self._results:
                _refresh(results, self._check)
                if results.batch is None:
                    results.batch = _batch(results, self.trusted_key)
                found.append(results.batch)
            return found


def file_state(path: Path) -> tuple[float, int] | None:
    """What changes when a database does (its WAL included)."""
    stamps = []
    for candidate in (path, path.with_name(path.name + "-wal")):
        try:
            info = candidate.stat()
        except OSError:
            continue
        stamps.append((info.st_mtime, info.st_size))
    if not stamps:
        return None
    return (max(s[0] for s in stamps), sum(s[1] for s in stamps))


def _read_new(number: int, source: _Source) -> None:
    """Add the runs begun and ended since ``source`` was last read."""
    path = source.path
    try:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    except sqlite3.Error as exc:
        raise AuditError(f"cannot read audit database {path}: {exc}") from None
    try:
        begun = db.execute(_BEGUN, (source.seen,)).fetchall()
        ended = db.execute(_ENDED, (source.seen,)).fetchall()
    except sqlite3.Error as exc:
        raise AuditError(f"cannot read audit database {path}: {exc}") from None
    finally:
        db.close()
    endings: dict[str, dict[str, Any]] = {
        str(session): {
            "outcome": _text(outcome),
            "posture": _text(posture),
            "steps": _count(steps),
            "duration_s": _number(duration),
            "reason": _text(reason),
        }
        for _, session, outcome, posture, steps, duration, reason in ended
    }
    for _, session, started, scenario, expected, agent, profile in begun:
        source.rows[str(session)] = RunRow(
            number,
            str(session),
            _number(started),
            str(scenario or "?"),
            _text(expected),
            **endings.pop(str(session), _UNFINISHED),
            agent=_text(agent),
            profile=_text(profile),
        )
    for session, ending in endings.items():  # runs begun before the last read
        row = source.rows.get(session)
        if row is not None:
            source.rows[session] = replace(row, **ending)
    source.seen = max([source.seen, *(r[0] for r in begun), *(r[0] for r in ended)])


#: a run with no end record yet
_UNFINISHED: dict[str, Any] = dict.fromkeys(("outcome", "posture", "steps", "duration_s", "reason"))


def _text(value: object) -> str | None:
    return value if isinstance(value, str) and value else None


def _number(value: object) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _count(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


#: what checking a results line finds (a key of :data:`LINE_CHECKS`), and whether it counts
_Check = Callable[[dict[str, Any]], tuple[str, bool]]


def _line_check(trusted_key: str | None) -> _Check:
    """Checking a results line with ``trusted_key``: it counts when it verifies. Without a
    key, only whether it is signed is known, and every line counts (the page says so)."""
    if trusted_key is None:
        return lambda record: (
            "unchecked" if isinstance(record.get("signature"), str) else "unsigned",
            True,
        )
    public = load_public_key(trusted_key)

    def check(record: dict[str, Any]) -> tuple[str, bool]:
        why = untrusted_line(record, trusted_key, public)
        return (why, False) if why else ("verified", True)

    return check


def _refresh(results: _Results, check: _Check) -> tuple[float, int] | None:
    """Read ``results`` again if it changed since; its state."""
    stamp = file_state(results.path)
    if stamp != results.stamp or results.stamp is None:
        results.checks, results.runs = Counter(), 0
        results.lines, results.error = _result_lines(results, check)
        results.stamp, results.batch = stamp, None
    return stamp


def _result_lines(results: _Results, check: _Check) -> tuple[list[_Line], str | None]:
    """The complete lines of a results file (a line being written is left for the next
    read), checked: the last of each run that counts and of each that does not, where a
    run was retried or run again; or why the file cannot be read. Every line's check is
    counted in ``results.checks``, and the runs in ``results.runs``."""
    try:
        data = read_bytes(results.path, what="a results file", max_bytes=RESULTS_MAX_BYTES)
    except ReadError as exc:
        return [], str(exc)
    known, results.checked = results.checked, {}
    latest: dict[tuple[object, bool], tuple[int, _Line]] = {}
    runs: set[object] = set()
    for number, text in enumerate(data[: data.rfind(b"\n") + 1].splitlines()):
        try:
            found = json.loads(text)
        except (ValueError, RecursionError):
            continue
        if not isinstance(found, dict):
            continue
        said = known.get(text) or check(found)
        results.checked[text] = said
        line = _Line(found, *said)
        key = found.get("key")
        run = key if isinstance(key, str) else number
        latest[(run, line.counts)] = (number, line)
        results.checks[line.check] += 1
        runs.add(run)
    results.runs = len(runs)
    return [line for _, line in sorted(latest.values(), key=lambda kept: kept[0])], None


def _with_result(row: RunRow, line: _Line, label: str) -> RunRow:
    """A recorded run with what its batch's results line adds."""
    record = line.record
    passed = record.get("itbench_pass")
    return replace(
        row,
        agent=_text(record.get("agent")) or row.agent,  # as the batch was given it
        expected=row.expected or _text(record.get("expected")),
        itbench_pass=passed if isinstance(passed, bool) else None,
        batch=label,
        line=line.check,
    )


def _result_row(line: _Line, label: str) -> RunRow:
    """A run as a results line tells it."""
    record = line.record
    passed = record.get("itbench_pass")
    return RunRow(
        None,
        _text(record.get("session_id")) or "",
        _number(record.get("started_at")),
        _text(record.get("scenario_id")) or "?",
        _text(record.get("expected")),
        _text(record.get("outcome")),
        _text(record.get("posture")),
        _count(record.get("steps")),
        _number(record.get("duration_s")),
        _text(record.get("reason")),
        agent=_text(record.get("agent")),
        itbench_pass=passed if isinstance(passed, bool) else None,
        batch=label,
        line=line.check,
    )


def _steps(
    records: list[AuditRecord], replayed: tuple[ReplayedStep, ...], *, rejudged: bool = False
) -> tuple[list[StepView], dict[str, Any] | None]:
    """The steps as recorded, with the masks after each as the gate judges them again and
    its verdict where it differs; ``rejudged`` (under another profile): that gate's
    verdicts first, the recorded one beside where it differs."""
    steps: dict[int, StepView] = {}
    containment = None
    for record in records:
        if record.kind is RecordKind.SESSION:
            found = record.data.get("containment")
            containment = found if isinstance(found, dict) else None
        if record.step is None:
            continue
        view = steps.setdefault(record.step, StepView(record.step))
        data = record.data
        if record.kind is RecordKind.STEP:
            view.said = str(data.get("raw", data.get("raw_b64", "")))
            try:
                parsed = json.loads(view.said)
                action = parsed.get("action", {}) if isinstance(parsed, dict) else {}
                view.action = str(action.get("type")) if isinstance(action, dict) else None
                view.payload = action.get("payload") if isinstance(action, dict) else None
            except (ValueError, AttributeError, RecursionError):
                pass
        elif record.kind is RecordKind.DECISION:
            view.action = view.action or data.get("action")
            view.verdict, view.message = data.get("verdict"), data.get("message")
            view.detail = data.get("detail")
        elif record.kind is RecordKind.OBSERVATION:
            view.observation = data
        elif record.kind is RecordKind.EVIDENCE:
            view.evidence = data
        elif record.kind is RecordKind.SUPERVISION:
            view.review = data
    for again in replayed:
        if again.step not in steps:
            continue
        view = steps[again.step]
        view.masks = again.masks.model_dump(mode="json")
        if (again.verdict.value, again.message) == (view.verdict, view.message):
            view.stopped_by, view.refused = again.stopped_by, again.refused
            continue
        if rejudged:  # this gate's verdict, and why it stopped the step
            view.other = ("recorded", str(view.verdict), str(view.message))
            view.verdict, view.message, view.detail = again.verdict.value, again.message, None
            view.stopped_by, view.refused = again.stopped_by, again.refused
        else:  # why the recorded verdict was given is not known: the gate says otherwise
            view.other = ("judged again", again.verdict.value, again.message)
    return [steps[number] for number in sorted(steps)], containment


def _batch(results: _Results, trusted_key: str | None) -> BatchView:
    """A results file summed up by :mod:`cmbs_async.batch`'s own functions, over the lines
    that count; the others by why."""
    if results.error is not None:
        return BatchView(str(results.path), results.label, error=results.error)
    records = [line.record for line in results.lines if line.counts]
    agents = by_agent(records)
    for row in agents:
        confusion = row["confusion"]
        row["matrix"] = [
            (want, [confusion.get((want, got), 0) for got in (*POSTURES, None)])
            for want in POSTURES
        ]
    outcomes = Counter(str(record.get("outcome")) for record in records)
    apart = [line for line in results.lines if not line.counts]
    counted = {record.get("key") for record in records if isinstance(record.get("key"), str)}
    uncounted = [line for line in apart if line.record.get("key") not in counted]
    checks, lines = results.checks, sum(results.checks.values())
    keyless = trusted_key is None
    return BatchView(
        str(results.path),
        results.label,
        key=None if trusted_key is None else key_id(trusted_key),
        lines=lines,
        verified=lines if keyless else checks["verified"],
        unverified={}
        if keyless
        else {h.lower(): checks[c] for c, (h, _) in _APART.items() if checks[c]},
        unsigned=checks["unsigned"] if keyless else 0,
        all_runs=results.runs,
        apart=tuple(_apart(apart, counted)),
        apart_runs=len(uncounted),
        apart_outcomes=dict(Counter(str(line.record.get("outcome")) for line in uncounted)),
        runs=len(records),
        outcomes=dict(outcomes.most_common()),
        earned=sum(row["earned"] for row in agents),
        judged=sum(row["judged"] for row in agents),
        correct=sum(row["correct"] for row in agents),
        passes=tuple(bool(p) for row in agents for p in row["itbench_passes"]),
        agents=tuple(agents),
        failures=tuple(failures(records)),
    )


def _apart(lines: list[_Line], counted: set[object]) -> list[dict[str, Any]]:
    """The lines that do not count, by why (in :data:`_APART`'s order); ``counted``: the
    keys of the runs that have a line that counts."""
    found = []
    for check, (heading, why) in _APART.items():
        these = [line.record for line in lines if line.check == check]
        if not these:
            continue
        signers = {r.get("signed_by") for r in these} if check == "other key" else set()
        found.append(
            {
                "check": check,
                "heading": heading,
                "why": why,
                "runs": len(these),
                "signers": sorted(key_id(s) if isinstance(s, str) else "?" for s in signers),
                "shown": [_apart_line(r, r.get("key") in counted) for r in these[:APART_SHOWN]],
            }
        )
    return found


def _apart_line(record: dict[str, Any], again: bool) -> dict[str, Any]:
    """A line that does not count, as the batch page lists it (as written); ``again``: its
    run has a line that counts (it was run again)."""
    steps = _count(record.get("steps"))
    return {
        "scenario": _text(record.get("scenario_id")) or "?",
        "agent": _text(record.get("agent")) or "?",
        "outcome": _text(record.get("outcome")) or "?",
        "posture": _text(record.get("posture")),
        "steps": steps,
        "session": _text(record.get("session_id")),
        "reason": _text(record.get("reason")),
        "again": again,
    }
