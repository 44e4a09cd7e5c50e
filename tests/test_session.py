"""The supervised session: a tool-calling agent's own loop, judged, executed, recorded
and bounded like any run; the belief policy for agents that send no belief."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from cmbs_async import (
    Gate,
    Messages,
    ObservationOwed,
    Outcome,
    RunConfig,
    ScenarioSpec,
    Session,
    SessionEnded,
    Verdict,
    load_profile,
    replay,
)
from cmbs_async.audit import SQLiteAuditStore
from cmbs_async.demo import demo_scenario
from executors import NullExecutor

from .helpers import demo_check, processes_with, step, unique_seconds

pytestmark = pytest.mark.anyio


async def test_an_honest_tool_caller_earns_termination_and_a_premature_claim_is_refused(
    tmp_path: Path,
) -> None:
    store = SQLiteAuditStore(tmp_path / "audit.db", key=Ed25519PrivateKey.generate())
    async with Session(demo_scenario(), config=RunConfig(audit=store)) as session:
        early = await session.step("declare_posture", {"posture": "compliant"})
        assert early.verdict is Verdict.BLOCK
        assert early.message == Messages.POSTURE_WITHOUT_EVIDENCE and early.observation is None
        (collect, script), ran, (policy, rego), (evaluate, command) = demo_check()
        wrote = await session.step(collect, script)
        assert wrote.verdict is Verdict.ALLOW and wrote.observation is not None
        assert wrote.observation.kind == "artifact" and wrote.observation.success
        assert (await session.step(*ran)).verdict is Verdict.ALLOW
        assert (await session.step(policy, rego)).verdict is Verdict.ALLOW
        checked = await session.step(evaluate, command)
        assert checked.observation is not None and checked.observation.stdout.text == "false\n"
        assert checked.masks is not None and checked.masks.evidence == "successful"
        declared = await session.step("declare_posture", {"posture": "non_compliant"})
        assert declared.verdict is Verdict.ALLOW and not declared.ended
        done = await session.step("terminate")
        assert done.verdict is Verdict.TERMINATE and done.ended
        with pytest.raises(SessionEnded, match="terminated"):
            await session.step("check_status", {"command": "true"})
    result = session.result
    assert result is not None and result.outcome is Outcome.TERMINATED
    assert result.posture == "non_compliant" and result.steps == 7
    assert result.session_id is not None and replay(store, result.session_id).identical
    store.close()


async def test_termination_before_a_posture_is_refused() -> None:
    async with Session(demo_scenario(), executor=NullExecutor()) as session:
        reply = await session.step("terminate")
        assert reply.verdict is Verdict.BLOCK and reply.message == Messages.TERMINATION_BLOCKED
    assert session.result is not None and session.result.outcome is Outcome.AGENT_FINISHED


async def test_the_deadline_ends_the_session_and_kills_what_runs() -> None:
    marker = unique_seconds()
    spec = ScenarioSpec(id="slow", goal="g")
    async with Session(spec, config=RunConfig(deadline=1.5)) as session:
        reply = await session.step("check_status", {"command": f"sleep {marker}"})
        assert reply.ended and reply.result is not None
        assert reply.result.outcome is Outcome.DEADLINE_EXCEEDED
        assert reply.result.trace[-1].observed == "killed: the run ended while it ran"
        with pytest.raises(SessionEnded):
            await session.step("terminate")
    assert processes_with(marker) == []


async def test_an_exception_in_the_callers_loop_cancels_the_run() -> None:
    session = Session(ScenarioSpec(id="broken", goal="g", deadline_s=600))
    with pytest.raises(ZeroDivisionError):
        async with session:
            await session.step("check_status", {"command": "true"})
            1 / 0  # noqa: B018 - the caller's own bug
    assert session.result is not None and session.result.outcome is Outcome.CANCELLED
    assert session.result.steps == 1


async def test_parallel_steps_are_taken_in_turn_and_a_cancelled_one_ends_the_session() -> None:
    marker = unique_seconds()
    replies = {}
    async with Session(ScenarioSpec(id="busy", goal="g", deadline_s=600)) as session:

        async def call(word: str) -> None:
            replies[word] = await session.step("check_status", {"command": f"echo {word}"})

        async with anyio.create_task_group() as tg:
            for word in ("one", "two", "three"):
                tg.start_soon(call, word)
        for word, reply in replies.items():
            assert reply.observation is not None
            assert reply.observation.stdout.text == f"{word}\n"
        with anyio.move_on_after(1):
            await session.step("check_status", {"command": f"sleep {marker}"})
        with pytest.raises(SessionEnded, match="cancelled"):
            await session.step("terminate")
    assert session.result is not None and session.result.steps == 4
    assert processes_with(marker) == []


def test_deciding_while_an_observation_is_owed_is_an_error() -> None:
    gate = Gate(load_profile("ciso"))
    assert gate.decide(step("check_status", {"command": "true"})).needs_execution
    with pytest.raises(ObservationOwed, match="pass what running it observed to observe"):
        gate.decide(step("terminate"))
