"""A locked or slow audit database cannot stretch a run past its deadline: a record not
durable in time ends the run ``audit_error``, the end record gets a short grace, the write
left in its worker thread lands whole or not at all, and ``duration_s`` is the wall time.

The lock is real: another process holds ``BEGIN EXCLUSIVE`` on the same SQLite file.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator, MutableMapping
from pathlib import Path
from typing import Any

import anyio
import pytest

from cmbs_async import CallableAgent, Outcome, ScenarioSpec, Turn, run_scenario
from cmbs_async.audit import SQLiteAuditStore, default_data_dir, load_or_create_key
from cmbs_async.events import Events
from executors import LocalExecutor

from .helpers import CMBS, captured_events, step

#: Runs SQL it reads on stdin, one statement a line, and says "ok" after each.
_LOCKER = """
import sqlite3, sys
db = sqlite3.connect(sys.argv[1], isolation_level=None)
for line in sys.stdin:
    db.execute(line)
    print("ok", flush=True)
"""
#: What the end record may take past the deadline, and scheduling on a busy machine
#: (every bound stays under SQLite's 10 s busy timeout, which is what they tell apart).
_GRACE, _SLACK = 1.0, 2.5


class Locker:
    """Another process that takes and releases the database's write lock on demand."""

    def __init__(self, db: Path) -> None:
        self._process = subprocess.Popen(
            [sys.executable, "-c", _LOCKER, str(db)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def _run(self, sql: str) -> None:
        assert self._process.stdin is not None and self._process.stdout is not None
        self._process.stdin.write(sql + "\n")
        self._process.stdin.flush()
        assert self._process.stdout.readline() == "ok\n"

    def lock(self) -> None:
        self._run("BEGIN EXCLUSIVE")

    def release(self) -> None:
        self._run("COMMIT")

    def close(self) -> None:
        self._process.kill()
        self._process.communicate()


@pytest.fixture
def db(tmp_path: Path) -> Path:
    path = tmp_path / "audit.db"
    SQLiteAuditStore(path).close()  # the schema exists before anyone locks the file
    return path


@pytest.fixture
def locker(db: Path) -> Iterator[Locker]:
    locker = Locker(db)
    try:
        yield locker
    finally:
        locker.close()


def _store(db: Path) -> SQLiteAuditStore:
    # A busy timeout far past the deadline: only the run's own bound can end the wait.
    # Signed with the operator's default key, the one `cmbs audit verify` trusts alone.
    key = load_or_create_key(default_data_dir() / "signing_key")
    return SQLiteAuditStore(db, key=key, busy_timeout=60)


def _kinds(db: Path) -> list[tuple[str, int | None]]:
    store = SQLiteAuditStore(db)
    try:
        return [(record.kind, record.step) for record in store.records()]
    finally:
        store.close()


async def _verify(db: Path) -> str:
    """``cmbs audit verify``, as a user runs it; its report line, once it says intact."""
    done = await anyio.run_process([*CMBS, "audit", "verify", str(db)], check=False)
    assert done.returncode == 0, done.stdout
    return done.stdout.decode()


def _end_warnings(events: list[MutableMapping[str, Any]]) -> list[MutableMapping[str, Any]]:
    return [e for e in events if e["event"] == Events.AUDIT_END_NOT_RECORDED]


@pytest.mark.anyio
async def test_a_locked_audit_db_cannot_stretch_a_2_s_deadline(db: Path, locker: Locker) -> None:
    store = _store(db)
    locker.lock()

    async def agent(turn: Turn) -> str:
        return step("check_status", {"command": "echo hi"})

    with captured_events() as events:
        started = time.monotonic()
        result = await run_scenario(
            ScenarioSpec(id="locked", goal="g"), agent=CallableAgent(agent), deadline=2, audit=store
        )
        took = time.monotonic() - started
    assert took < 2 + _GRACE + _SLACK  # it was 10 s (SQLite's busy timeout), then an error
    assert abs(result.duration_s - took) < 0.5
    assert result.outcome is Outcome.AUDIT_ERROR and result.steps == 0
    assert result.reason == "an audit record was not durable within the deadline of 2 s"
    assert [e["log_level"] for e in _end_warnings(events)] == ["warning"]

    locker.release()
    await anyio.to_thread.run_sync(store.close)  # the abandoned write is done by now
    # it opened the session once the lock was gone, whole: nothing was written after it
    assert _kinds(db) == [("session", None)]
    assert "1 session(s), 1 record(s), intact" in await _verify(db)


@pytest.mark.anyio
async def test_a_lock_taken_mid_run_stops_the_step_it_catches(
    db: Path, locker: Locker, tmp_path: Path
) -> None:
    store = _store(db)
    workdir = tmp_path / "work"

    async def agent(turn: Turn) -> str:
        if turn.step == 2:  # the first step is recorded and done: now lock the database
            await anyio.to_thread.run_sync(locker.lock)
        return step("check_status", {"command": f"touch ran-{turn.step}"})

    spec = ScenarioSpec(id="locked-later", goal="g", workdir=str(workdir))
    async with LocalExecutor(workdir_root=str(tmp_path)) as executor:
        with captured_events() as events:
            started = time.monotonic()
            result = await run_scenario(
                spec, agent=CallableAgent(agent), deadline=3, audit=store, executor=executor
            )
            took = time.monotonic() - started
    assert took < 3 + _GRACE + _SLACK
    assert abs(result.duration_s - took) < 0.5
    assert result.outcome is Outcome.AUDIT_ERROR and result.steps == 1
    assert (workdir / "ran-1").exists() and not (workdir / "ran-2").exists()
    assert len(_end_warnings(events)) == 1

    locker.release()
    await anyio.to_thread.run_sync(store.close)
    # The second step's record landed once the lock was gone; its decision was never made.
    assert _kinds(db) == [
        ("session", None),
        ("step", 1),
        ("decision", 1),
        ("observation", 1),
        ("step", 2),
    ]
    assert "1 session(s), 5 record(s), intact" in await _verify(db)


def test_cmbs_run_on_a_locked_audit_db_ends_on_time(
    db: Path, locker: Locker, tmp_path: Path
) -> None:
    scenario = tmp_path / "scenario.yaml"
    scenario.write_text("id: locked-cli\ngoal: g\ndeadline_s: 2\n")
    steps = tmp_path / "steps.jsonl"
    steps.write_text(step("check_status", {"command": "echo hi"}) + "\n")
    locker.lock()
    started = time.monotonic()
    done = subprocess.run(
        [*CMBS, "run", str(scenario), "--agent", f"script:{steps}", "--audit-db", str(db)]
        + ["--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    took = time.monotonic() - started
    # the whole process, interpreter start-up included: not the busy timeout's 10 s
    assert took < 2 + _GRACE + _SLACK + 2
    assert done.returncode == 3, done.stderr
    result = json.loads(done.stdout)
    assert result["outcome"] == "audit_error" and result["duration_s"] < took
    assert Events.AUDIT_END_NOT_RECORDED in done.stderr
    locker.release()
    verified = subprocess.run(
        [*CMBS, "audit", "verify", str(db)], capture_output=True, text=True, timeout=60
    )
    assert verified.returncode == 0 and "intact" in verified.stdout
