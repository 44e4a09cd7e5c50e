"""The results file: one JSON line per finished run, written as runs finish, readable
back for ``--resume`` even after the batch was killed mid-write."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, TextIO

from .._reading import ReadError, read_bytes
from ..result import Outcome, ScenarioResult
from .jobs import BatchError, Job

__all__ = [
    "ERROR_OUTCOMES",
    "RESULTS_MAX_BYTES",
    "ResultLog",
    "error_record",
    "is_error",
    "judged",
    "result_record",
]

#: The largest results file read back for ``--resume``.
RESULTS_MAX_BYTES = 1 << 30

#: Outcomes that say the run could not be carried out (the agent's program or endpoint,
#: the executor, the audit trail, the runner), not how the agent did: ``--retry-errors``
#: runs them again and ``--maxfail`` counts them.
ERROR_OUTCOMES: frozenset[str] = frozenset(
    {
        Outcome.AGENT_ERROR.value,
        Outcome.EXECUTOR_ERROR.value,
        Outcome.AUDIT_ERROR.value,
        "runner_error",
    }
)


def is_error(record: dict[str, Any]) -> bool:
    """Whether a result line is a run that ended in an error outcome."""
    return record.get("outcome") in ERROR_OUTCOMES


def judged(record: dict[str, Any], expected: str | None) -> dict[str, Any]:
    """``record`` with ``expected`` (the scenario's expected posture, or None) and
    ``correct``: whether the run earned its termination with that posture (None where
    nothing is expected)."""
    correct = None
    if expected is not None:
        correct = record.get("outcome") == Outcome.TERMINATED and record.get("posture") == expected
    return record | {"expected": expected, "correct": correct}


def result_record(
    job: Job, result: ScenarioResult, started: float, finished: float
) -> dict[str, Any]:
    """The fields of ``cmbs run --json`` plus the batch's own."""
    record = {
        "key": job.key,
        "scenario_file": job.scenario_file,
        "agent": job.agent,
        "repeat": job.repeat,
        **result.summary(output=False),
        "started_at": round(started, 6),
        "finished_at": round(finished, 6),
    }
    return judged(record, job.spec.expected)


def error_record(job: Job, reason: str, started: float, finished: float) -> dict[str, Any]:
    """A run the runner itself could not complete: recorded, never silently lost."""
    record = {
        "key": job.key,
        "scenario_file": job.scenario_file,
        "agent": job.agent,
        "repeat": job.repeat,
        "scenario_id": job.spec.id,
        "outcome": "runner_error",
        "posture": None,
        "steps": 0,
        "verdicts": {},
        "duration_s": round(finished - started, 4),
        "reason": reason,
        "trace": [],
        "started_at": round(started, 6),
        "finished_at": round(finished, 6),
    }
    return judged(record, job.spec.expected)


class ResultLog:
    """Appends result lines durably; knows which keys already have a result.

    With ``retry_errors``, a key whose last result is an error outcome (see
    :data:`ERROR_OUTCOMES`) counts as not done (``retrying`` lists those results); its new
    result is appended, and the later line of a key is the one that counts.
    """

    def __init__(self, path: str | Path, *, resume: bool, retry_errors: bool = False) -> None:
        self.path = Path(path)
        self.previous: list[dict[str, Any]] = []
        if self.path.exists() and not resume:
            raise BatchError(f"{self.path} exists: pass --resume to continue it, or another --out")
        if self.path.exists():
            self.previous = self._read_back()
        latest = {record["key"]: record for record in self.previous}
        self.retrying = [r for r in latest.values() if retry_errors and is_error(r)]
        self.done = set(latest) - {record["key"] for record in self.retrying}
        self.written: list[dict[str, Any]] = []
        self._handle: TextIO | None = None  # opened at the first result: a failed start
        # leaves no file behind (which a retry would then refuse)

    def _read_back(self) -> list[dict[str, Any]]:
        if not self.path.is_file():  # /dev/zero, a FIFO: no results file, and never ending
            raise BatchError(f"{self.path} is not a results file (not a regular file)")
        try:
            data = read_bytes(self.path, what="a results file", max_bytes=RESULTS_MAX_BYTES)
        except ReadError as exc:
            raise BatchError(str(exc)) from None
        complete = data[: data.rfind(b"\n") + 1]
        if len(complete) != len(data):  # a line cut off by a kill: drop it, keep the rest
            with open(self.path, "r+b") as handle:
                handle.truncate(len(complete))
        records = []
        try:
            text = complete.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise BatchError(f"{self.path} is not a results file (not UTF-8)") from exc
        for number, line in enumerate(text.splitlines(), 1):
            try:
                record = json.loads(line)
            except (ValueError, RecursionError):
                raise BatchError(f"{self.path}:{number} is not a result line") from None
            if isinstance(record, dict) and "key" in record:
                records.append(record)
        return records

    def append(self, record: dict[str, Any]) -> None:
        if self._handle is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._handle = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - close()
        self._handle.write(json.dumps(record) + "\n")
        self._handle.flush()
        os.fsync(self._handle.fileno())
        self.done.add(record["key"])
        self.written.append(record)

    @property
    def records(self) -> list[dict[str, Any]]:
        """The result of every run in the file, from before (when resuming) and from this
        run: the last line of each key, where a run was retried."""
        latest = {record["key"]: record for record in self.previous + self.written}
        return list(latest.values())

    def close(self) -> None:
        if self._handle is not None:
            self._handle.close()
