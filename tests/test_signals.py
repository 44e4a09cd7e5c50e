"""SIGTERM and SIGHUP stop ``cmbs run`` and ``cmbs batch`` the way Ctrl-C does: the run is
cancelled through its scopes, what it started is killed, its end is recorded, and the
exit status is 128 + the signal. A library caller's cancel scope gets the same. Real
processes, found in /proc by a unique argument."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import anyio
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from cmbs_async import ScenarioSpec, ScriptedAgent, run_scenario
from cmbs_async.audit import SQLiteAuditStore

from .helpers import CMBS, processes_with, step, unique_seconds

#: a command that outlives its shell: a background sleep and a foreground one
BOTH = "sleep {s} & sleep {s}"
#: the same with a background sleep that ignores SIGTERM (only SIGKILL stops it)
STUBBORN = "(trap '' TERM; sleep {s}) & sleep {s}"


def _start(args: list[str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [*CMBS, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _wait_for(process: subprocess.Popen[str], marker: str, count: int) -> list[int]:
    """The pids of ``count`` sleeps once they all run (a loaded machine may take a while)."""
    give_up = time.monotonic() + 60
    while len(found := processes_with(marker)) < count:
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < give_up, f"{len(found)} of {count} sleeps started"
        time.sleep(0.05)
    return found


def _kill(process: subprocess.Popen[str], marker: str) -> None:
    """Whatever happened, leave nothing behind: cmbs, and the sleeps a failing run left."""
    if process.poll() is None:
        process.kill()
        process.communicate()
    for pid in processes_with(marker):
        os.kill(pid, signal.SIGKILL)


def _ignores_term(pid: int) -> bool:
    status = Path(f"/proc/{pid}/status").read_text()
    ignored = next(line for line in status.splitlines() if line.startswith("SigIgn:"))
    return bool(int(ignored.split()[1], 16) & 1 << (signal.SIGTERM - 1))


def _ended_sessions(db: Path) -> list[str | None]:
    """Each recorded session's outcome (None: no end record), once the chain verifies."""
    store = SQLiteAuditStore(db)
    try:
        assert store.verify().intact
        return [session["outcome"] for session in store.sessions()]
    finally:
        store.close()


@pytest.mark.parametrize("sandbox", ["none", "auto"])
@pytest.mark.parametrize(
    ("signum", "status"),
    [(signal.SIGTERM, 143), (signal.SIGHUP, 129), (signal.SIGINT, 130)],
)
def test_a_signal_stops_cmbs_run_like_ctrl_c(
    tmp_path: Path, sandbox: str, signum: signal.Signals, status: int
) -> None:
    _signal_cmbs_run(tmp_path, BOTH, sandbox, signum, status)


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
@pytest.mark.parametrize("sandbox", ["none", "auto"])
def test_sigterm_kills_a_child_that_ignores_it(tmp_path: Path, sandbox: str, backend: str) -> None:
    _signal_cmbs_run(tmp_path, STUBBORN, sandbox, signal.SIGTERM, 143, backend=backend)


def _signal_cmbs_run(
    tmp_path: Path,
    command: str,
    sandbox: str,
    signum: signal.Signals,
    status: int,
    *,
    backend: str = "asyncio",
) -> None:
    marker = unique_seconds()
    scenario = tmp_path / "scenario.yaml"
    scenario.write_text("id: signalled\ngoal: g\ndeadline_s: 600\n")
    steps = tmp_path / "steps.jsonl"
    steps.write_text(step("check_status", {"command": command.format(s=marker)}) + "\n")
    db = tmp_path / "audit.db"
    process = _start(
        ["run", str(scenario), "--agent", f"script:{steps}", "--audit-db", str(db)]
        + ["--sandbox", sandbox, "--backend", backend]
    )
    try:
        pids = _wait_for(process, marker, 2)
        if command is STUBBORN:
            assert any(_ignores_term(pid) for pid in pids)  # the test has teeth
        started = time.monotonic()
        process.send_signal(signum)
        stdout, stderr = process.communicate(timeout=60)
        took = time.monotonic() - started
        left = processes_with(marker)
    finally:
        _kill(process, marker)
    assert process.returncode == status, stderr
    assert stderr.strip().splitlines()[-1] == "cmbs run: interrupted"
    assert "outcome   cancelled" in stdout  # what the run did until the signal, as a table
    assert left == []
    assert _ended_sessions(db) == ["cancelled"]
    assert took < 10  # TERM, a grace of 0.5 s, KILL: not the command's 600 s


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_sigterm_stops_cmbs_batch_and_records_what_it_cancelled(
    tmp_path: Path, backend: str
) -> None:
    marker = unique_seconds()
    folder = tmp_path / "scenarios"
    folder.mkdir()
    for i in range(4):
        (folder / f"s{i}.yaml").write_text(f"id: slow-{i}\ngoal: g\ndeadline_s: 600\n")
    steps = tmp_path / "steps.jsonl"
    steps.write_text(step("check_status", {"command": f"sleep {marker}"}) + "\n")
    out, db = tmp_path / "results.jsonl", tmp_path / "audit.db"
    process = _start(
        ["batch", str(folder), "--agent", f"script:{steps}", "--concurrency", "2"]
        + ["--out", str(out), "--audit-db", str(db), "--backend", backend]
    )
    try:
        _wait_for(process, marker, 2)
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=60)
        left = processes_with(marker)
    finally:
        _kill(process, marker)
    assert process.returncode == 143, stderr
    assert "interrupted: run the same command with --resume to finish" in stderr
    assert left == []
    assert not out.exists()  # a cancelled run has no result: --resume runs it again
    assert _ended_sessions(db) == ["cancelled", "cancelled"]


@pytest.mark.anyio
async def test_a_run_its_caller_cancels_kills_records_and_passes_it_on(tmp_path: Path) -> None:
    marker = unique_seconds()
    store = SQLiteAuditStore(tmp_path / "audit.db", key=Ed25519PrivateKey.generate())
    agent = ScriptedAgent([step("check_status", {"command": BOTH.format(s=marker)})])

    async def cancel_once_running(scope: anyio.CancelScope) -> None:
        with anyio.fail_after(60):
            while len(processes_with(marker)) < 2:  # noqa: ASYNC110 - /proc has no event
                await anyio.sleep(0.05)
        scope.cancel()

    try:
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as tg:
                tg.start_soon(cancel_once_running, scope)
                await run_scenario(ScenarioSpec(id="c", goal="g"), agent=agent, audit=store)
        left = processes_with(marker)
    finally:
        store.close()
        for pid in processes_with(marker):
            os.kill(pid, signal.SIGKILL)
    assert scope.cancelled_caught  # not swallowed into a result
    assert left == []
    assert _ended_sessions(tmp_path / "audit.db") == ["cancelled"]
