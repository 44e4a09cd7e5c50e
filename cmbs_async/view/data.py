"""What the viewer shows, read from audit databases and batch results files, read-only.

The runs list reads two fields of two records per session with SQLite's JSON functions
(never a whole profile), so that it stays fast on 10,000 sessions; a run's page reads its
records, judges them again (:func:`~cmbs_async.replayer.replay`) for the masks after each
step, and verifies the database against the operator's key.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from .._reading import ReadError, read_text
from ..audit import AuditError, SQLiteAuditStore
from ..audit.log import key_id
from ..audit.store import AuditRecord, RecordKind
from ..profile import Profile
from ..replayer import ReplayedStep, replay

__all__ = ["Library", "RunRow", "RunView", "StepView", "Verification", "file_state"]

#: the sessions begun and the runs ended since a record (records only ever grow)
_BEGUN = """
SELECT rowid, session_id, json_extract(body, '$.ts'), json_extract(body, '$.data.scenario.id'),
       json_extract(body, '$.data.scenario.expected')
FROM records WHERE kind = 'session' AND rowid > ? ORDER BY rowid
"""
_ENDED = """
SELECT rowid, session_id, json_extract(body, '$.data.outcome'),
       json_extract(body, '$.data.posture'), json_extract(body, '$.data.steps'),
       json_extract(body, '$.data.duration_s'), json_extract(body, '$.data.reason')
FROM records WHERE kind = 'end' AND rowid > ? ORDER BY rowid
"""


@dataclass(frozen=True, slots=True)
class RunRow:
    """One run in the list."""

    source: int  # which database
    session_id: str
    started: float | None
    scenario: str
    expected: str | None
    outcome: str | None
    posture: str | None
    steps: int | None
    duration_s: float | None
    reason: str | None

    @property
    def correct(self) -> bool | None:
        """Ended terminated with the expected posture, where one was expected."""
        if self.expected is None:
            return None
        return self.outcome == "terminated" and self.posture == self.expected


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


@dataclass
class _Source:
    """One database, and what was read of it: only what was added since is read again."""

    path: Path
    rows: dict[str, RunRow] = field(default_factory=dict)
    stamp: tuple[float, int] | None = None
    seen: int = 0  # the last record read


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
        self.trusted_key = trusted_key
        self._lock = threading.Lock()
        #: verifications already made, by session and the database's state then
        self._verified: dict[tuple[str, tuple[float, int] | None], Verification] = {}

    # -- the runs list -------------------------------------------------------------------
    def runs(self) -> list[RunRow]:
        """Every run of every database, newest first."""
        with self._lock:
            found: list[RunRow] = []
            for number, source in enumerate(self._sources):
                stamp = file_state(source.path)
                if stamp != source.stamp:
                    _read_new(number, source)
                    source.stamp = stamp
                found += source.rows.values()
        return sorted(found, key=lambda row: row.started or 0.0, reverse=True)

    def state(self) -> str:
        """What changes when any file shown does (a page reloads when it does)."""
        return repr([file_state(path) for path in [*self.databases, *self.results]])

    def find(self, session_id: str) -> RunRow | None:
        return next((row for row in self.runs() if row.session_id == session_id), None)

    # -- one run -------------------------------------------------------------------------
    def run(self, session_id: str, *, profile: Profile | None = None) -> RunView | None:
        """A run's steps with the masks after each, and whether its records hold."""
        row = self.find(session_id)
        if row is None:
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
        steps, containment = _steps(records, replayed)
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
    def batches(self) -> list[dict[str, Any]]:
        """Each results file: outcome counts, earned, accuracy, pass@1, errors by reason."""
        return [_batch(path) for path in self.results]


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
    for _, session, started, scenario, expected in begun:
        source.rows[str(session)] = RunRow(
            number,
            str(session),
            float(started) if isinstance(started, int | float) else None,
            str(scenario or "?"),
            expected if isinstance(expected, str) else None,
            None,
            None,
            None,
            None,
            None,
        )
    for _, session, outcome, posture, steps, duration, reason in ended:
        row = source.rows.get(str(session))
        if row is None:
            continue
        source.rows[row.session_id] = replace(
            row,
            outcome=outcome if isinstance(outcome, str) else None,
            posture=posture if isinstance(posture, str) else None,
            steps=steps if isinstance(steps, int) else None,
            duration_s=float(duration) if isinstance(duration, int | float) else None,
            reason=reason if isinstance(reason, str) else None,
        )
    source.seen = max([source.seen, *(r[0] for r in begun), *(r[0] for r in ended)])


def _steps(
    records: list[AuditRecord], replayed: tuple[ReplayedStep, ...]
) -> tuple[list[StepView], dict[str, Any] | None]:
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
        if again.step in steps:
            steps[again.step].masks = again.masks.model_dump(mode="json")
    return [steps[number] for number in sorted(steps)], containment


def _batch(path: Path) -> dict[str, Any]:
    """A results file (one JSON object per run) summed up."""
    try:
        text = read_text(path, what="a results file", max_bytes=1 << 30)
    except ReadError as exc:
        return {"path": str(path), "error": str(exc)}
    lines = []
    for line in text.splitlines():
        try:
            found = json.loads(line)
        except (ValueError, RecursionError):
            continue
        if isinstance(found, dict):
            lines.append(found)
    outcomes = Counter(str(line.get("outcome")) for line in lines)
    expected = [line for line in lines if line.get("expected")]
    right = [
        line
        for line in expected
        if line.get("outcome") == "terminated" and line.get("posture") == line.get("expected")
    ]
    scored = [line for line in lines if line.get("itbench_pass") is not None]
    errors = Counter(
        f"{line.get('outcome')}: {line.get('reason')}"
        for line in lines
        if str(line.get("outcome", "")).endswith("_error")
    )
    return {
        "path": str(path),
        "runs": len(lines),
        "outcomes": dict(outcomes.most_common()),
        "earned": outcomes.get("terminated", 0),
        "accuracy": (len(right) / len(expected)) if expected else None,
        "pass_at_1": (sum(bool(line["itbench_pass"]) for line in scored) / len(scored))
        if scored
        else None,
        "errors": dict(errors.most_common()),
    }
