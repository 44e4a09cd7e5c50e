"""The results file: one JSON line per finished run, written as runs finish, readable
back for ``--resume`` even after the batch was killed mid-write."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, TextIO

from .._reading import ReadError, read_bytes
from ..result import ScenarioResult
from .jobs import BatchError, Job

__all__ = ["RESULTS_MAX_BYTES", "ResultLog", "error_record", "result_record"]

#: The largest results file read back for ``--resume``.
RESULTS_MAX_BYTES = 1 << 30


def result_record(
    job: Job, result: ScenarioResult, started: float, finished: float
) -> dict[str, Any]:
    """The fields of ``cmbs run --json`` plus the batch's own."""
    return {
        "key": job.key,
        "scenario_file": job.scenario_file,
        "agent": job.agent,
        "repeat": job.repeat,
        **result.summary(output=False),
        "started_at": round(started, 6),
        "finished_at": round(finished, 6),
    }


def error_record(job: Job, reason: str, started: float, finished: float) -> dict[str, Any]:
    """A run the runner itself could not complete: recorded, never silently lost."""
    return {
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


class ResultLog:
    """Appends result lines durably; knows which keys already have a result."""

    def __init__(self, path: str | Path, *, resume: bool) -> None:
        self.path = Path(path)
        self.previous: list[dict[str, Any]] = []
        if self.path.exists() and not resume:
            raise BatchError(f"{self.path} exists: pass --resume to continue it, or another --out")
        if self.path.exists():
            self.previous = self._read_back()
        self.done = {record["key"] for record in self.previous}
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
        """Every result in the file: from before (when resuming) and from this run."""
        return self.previous + self.written

    def close(self) -> None:
        if self._handle is not None:
            self._handle.close()
