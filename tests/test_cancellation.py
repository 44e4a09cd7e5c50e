"""A run stopped from outside still gives its result: through a handle in the library,
as JSON from ``cmbs run --json`` on a signal; the step in flight is traced as killed, on a
deadline too; ``scenario.finished`` is logged and the end is recorded."""

from __future__ import annotations

import json
import signal
import subprocess
from functools import partial
from pathlib import Path

import anyio
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from cmbs_async import Outcome, RunHandle, ScenarioSpec, ScriptedAgent, run_scenario
from cmbs_async.audit import SQLiteAuditStore

from .helpers import CMBS, captured_events, processes_with, step, unique_seconds

pytestmark = pytest.mark.anyio


def _agent(marker: str) -> ScriptedAgent:
    return ScriptedAgent(
        [
            step("check_status", {"command": "echo first"}),
            step("check_status", {"command": f"sleep {marker}"}),
        ]
    )


async def _running(marker: str) -> None:
    with anyio.fail_after(60):
        while not processes_with(marker):  # noqa: ASYNC110 - /proc has no event
            await anyio.sleep(0.05)


async def test_a_handle_cancels_the_run_and_the_run_returns_its_result(tmp_path: Path) -> None:
    marker = unique_seconds()
    store = SQLiteAuditStore(tmp_path / "audit.db", key=Ed25519PrivateKey.generate())
    handle = RunHandle()
    spec = ScenarioSpec(id="cancelled", goal="g", deadline_s=600)
    with captured_events() as events:
        async with anyio.create_task_group() as tg:
            tg.start_soon(
                partial(run_scenario, spec, agent=_agent(marker), audit=store, handle=handle)
            )
            await _running(marker)
            handle.cancel()
            result = await handle.wait()
    assert result.outcome is Outcome.CANCELLED and handle.result is result
    assert [t.observed for t in result.trace] == [
        "exit 0: first",
        "killed: the run ended while it ran",
    ]
    assert processes_with(marker) == []
    finished = [e for e in events if e["event"] == "scenario.finished"]
    assert len(finished) == 1 and finished[0]["outcome"] == "cancelled"
    assert [s["outcome"] for s in store.sessions()] == ["cancelled"]
    store.close()


async def test_an_enclosing_cancellation_propagates_and_the_handle_holds_the_result() -> None:
    marker = unique_seconds()
    handle = RunHandle()
    spec = ScenarioSpec(id="outer", goal="g", deadline_s=600)
    with anyio.CancelScope() as outer:
        async with anyio.create_task_group() as tg:
            tg.start_soon(partial(run_scenario, spec, agent=_agent(marker), handle=handle))
            await _running(marker)
            outer.cancel()
    assert outer.cancelled_caught  # the cancellation went through, as anyio's always does
    assert handle.result is not None and handle.result.outcome is Outcome.CANCELLED
    assert handle.result.trace[-1].observed == "killed: the run ended while it ran"
    assert processes_with(marker) == []


async def test_a_handle_cancelled_before_the_run_starts_stops_it_at_once() -> None:
    handle = RunHandle()
    handle.cancel()
    result = await run_scenario(
        ScenarioSpec(id="early", goal="g"), agent=_agent(unique_seconds()), handle=handle
    )
    assert result.outcome is Outcome.CANCELLED and result.trace == []
    audited = RunHandle()  # the same while the audit trail is still being opened
    audited.cancel()
    store = SQLiteAuditStore(":memory:", key=Ed25519PrivateKey.generate())
    early = await run_scenario(
        ScenarioSpec(id="early", goal="g"), agent=_agent("1"), audit=store, handle=audited
    )
    assert early.outcome is Outcome.CANCELLED and early.steps == 0
    store.close()
    with pytest.raises(RuntimeError, match="one run"):
        await run_scenario(ScenarioSpec(id="again", goal="g"), agent=_agent("1"), handle=handle)


async def test_on_a_deadline_the_killed_step_is_in_the_trace() -> None:
    marker = unique_seconds()
    spec = ScenarioSpec(id="late", goal="g", deadline_s=1.5)
    result = await run_scenario(spec, agent=_agent(marker))
    assert result.outcome is Outcome.DEADLINE_EXCEEDED
    assert result.trace[-1].step == 2
    assert result.trace[-1].observed == "killed: the run ended while it ran"


@pytest.mark.parametrize(("signum", "status"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_cmbs_run_json_prints_the_result_on_a_signal(
    tmp_path: Path, signum: signal.Signals, status: int
) -> None:
    marker = unique_seconds()
    scenario = tmp_path / "s.yaml"
    scenario.write_text("id: signalled\ngoal: g\ndeadline_s: 600\n")
    steps = tmp_path / "steps.jsonl"
    steps.write_text("\n".join(_agent(marker).messages) + "\n")
    process = subprocess.Popen(
        [*CMBS, "run", str(scenario), "--agent", f"script:{steps}", "--json", "--no-audit"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        anyio.run(_running, marker)
        process.send_signal(signum)
        stdout, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == status, stderr
    result = json.loads(stdout)
    assert result["outcome"] == "cancelled" and result["steps"] == 2
    assert result["trace"][1]["observed"] == "killed: the run ended while it ran"
    assert processes_with(marker) == []
