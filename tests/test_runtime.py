"""run_scenario end to end: three actors, one deadline, every way a run can end."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import anyio
import pytest

from cmbs_async import (
    CallableAgent,
    Outcome,
    ScenarioSpec,
    ScriptedAgent,
    Turn,
    Verdict,
    run_scenario,
)
from cmbs_async.demo import demo_agent, demo_scenario
from cmbs_async.events import Events
from executors import LocalExecutor, NullExecutor
from executors.observation import CommandEnv

from .helpers import captured_events, processes_with, step, unique_seconds

pytestmark = pytest.mark.anyio


def spec(**fields: object) -> ScenarioSpec:
    base: dict[str, object] = {"id": "t", "goal": "check {{ thing }}", "vars": {"thing": "it"}}
    return ScenarioSpec.model_validate(base | fields)


async def test_demo_scenario_earns_termination_with_real_execution() -> None:
    result = await run_scenario(demo_scenario(), agent=demo_agent())
    assert result.outcome is Outcome.TERMINATED and result.earned
    assert result.posture == "non_compliant"
    verdicts = [entry.verdict for entry in result.trace]
    assert verdicts == [
        Verdict.BLOCK,  # posture declared before any evidence
        Verdict.ALLOW,  # the collecting script is written
        Verdict.CONTINUE,  # evidence claimed before it was earned
        Verdict.ALLOW,  # the script runs and fails (a typo): evidence stays attempted
        Verdict.BLOCK,  # termination not earned
        Verdict.ALLOW,  # the script collects the setting
        Verdict.ALLOW,  # the policy is written
        Verdict.ALLOW,  # `echo true` runs: execution, but no evaluator
        Verdict.BLOCK,  # so termination is still not earned
        Verdict.ALLOW,  # cmbs-opa evaluates the policy and prints false: a violation
        Verdict.ALLOW,  # the declaration is now legal
        Verdict.TERMINATE,
    ]
    assert result.trace[3].observed == "exit 2: cannot read sshd_conf"
    assert result.trace[7].observed == "exit 0: true"
    assert result.trace[9].observed == "exit 0: false"
    assert result.verdicts == {"allow": 7, "block": 3, "continue": 1, "terminate": 1}
    assert result.masks.posture_admissible == {"compliant": False, "non_compliant": True}


async def test_agent_sees_goal_responses_and_masks() -> None:
    seen: list[Turn] = []

    async def agent(turn: Turn) -> str | None:
        seen.append(turn)
        if turn.step == 1:
            return step("generate_script", {"path": "a.sh", "content": "echo hi"})
        return None

    result = await run_scenario(spec(), agent=CallableAgent(agent))
    assert result.outcome is Outcome.AGENT_FINISHED
    first, second = seen
    assert first.goal == "check it" and first.response is None
    assert "terminate" in first.actions
    assert second.response is not None
    assert second.response.verdict is Verdict.ALLOW
    assert second.response.masks.evidence == "attempted"
    assert second.response.last_observation is not None
    assert second.response.last_observation.action == "generate_script"


async def test_deadline_kills_a_forking_command_and_ends_the_run() -> None:
    mark = unique_seconds()
    command = f"setsid sh -c 'exec sleep {mark}' & sleep {mark}"
    agent = ScriptedAgent([step("check_status", {"command": command})])
    async with LocalExecutor(kill_grace=0.3) as executor:
        started = anyio.current_time()
        result = await run_scenario(spec(deadline_s=1.0), agent=agent, executor=executor)
        elapsed = anyio.current_time() - started
    assert result.outcome is Outcome.DEADLINE_EXCEEDED
    assert result.reason == "deadline of 1 s exceeded"
    assert result.sandbox == "bwrap"
    # the sleep is days long: ending at all is the kill; a loaded machine may take a while
    # to start the sandbox, so no tight bound on when
    assert elapsed < 30
    assert processes_with(mark) == []


async def test_an_agent_that_hangs_meets_the_deadline() -> None:
    async def hang(turn: Turn) -> None:
        await anyio.sleep_forever()

    with anyio.fail_after(5):
        result = await run_scenario(spec(deadline_s=0.3), agent=CallableAgent(hang))
    assert result.outcome is Outcome.DEADLINE_EXCEEDED
    assert result.steps == 0


async def test_an_agent_that_raises_ends_with_agent_error() -> None:
    async def broken(turn: Turn) -> str:
        if turn.step == 2:
            raise ValueError("model went away")
        return step("check_status", {"command": "true"})

    result = await run_scenario(spec(), agent=CallableAgent(broken), executor=NullExecutor())
    assert result.outcome is Outcome.AGENT_ERROR
    assert result.reason == "agent raised ValueError: model went away"
    assert result.steps == 1


async def test_step_budget_is_enforced() -> None:
    async def forever(turn: Turn) -> str:
        return step("check_status", {"command": "true"})

    result = await run_scenario(
        spec(max_steps=50), agent=CallableAgent(forever), executor=NullExecutor(), max_steps=4
    )
    assert result.outcome is Outcome.STEP_BUDGET_EXHAUSTED
    assert result.steps == 4 and result.reason == "step budget of 4 used up"


async def test_bad_input_gets_its_documented_answer_and_the_run_goes_on(tmp_path: Path) -> None:
    agent = ScriptedAgent(
        [
            "{this is not json",
            step("make_coffee"),
            step("execute_kubectl", {"cmd": "kubectl get po"}),
            step("generate_policy", {"path": "../escape.yaml", "content": "x"}),
        ]
    )
    workdir = tmp_path / "work"
    async with LocalExecutor(workdir_root=str(tmp_path)) as executor:
        result = await run_scenario(spec(workdir=str(workdir)), agent=agent, executor=executor)
    assert result.outcome is Outcome.AGENT_FINISHED
    assert [e.verdict for e in result.trace] == [Verdict.CONTINUE] * 3 + [Verdict.ALLOW]
    assert all(e.message == "Invalid format. Re-emit." for e in result.trace[:3])
    assert "unknown action type" in (result.trace[1].observed or "")
    assert "action.payload.command" in (result.trace[2].observed or "")
    assert (result.trace[3].observed or "").startswith("refused: artifact path '../escape.yaml'")
    assert result.masks.evidence == "none"
    assert not (tmp_path / "escape.yaml").exists()
    assert result.workdir == str(workdir) and workdir.is_dir()


async def test_temporary_workdir_is_removed_unless_kept(tmp_path: Path) -> None:
    made: list[str] = []

    async def look(turn: Turn) -> str | None:
        if turn.step > 1:
            return None
        return step("check_status", {"command": "pwd"})

    class Recording(LocalExecutor):
        async def prepare(
            self, workdir: str | None, files: Mapping[str, str], *, env: CommandEnv | None = None
        ) -> str:
            made.append(await super().prepare(workdir, files, env=env))
            return made[-1]

    async with Recording(workdir_root=str(tmp_path)) as executor:
        await run_scenario(spec(), agent=CallableAgent(look), executor=executor)
        kept = await run_scenario(
            spec(), agent=CallableAgent(look), executor=executor, keep_workdir=True
        )
    assert not await anyio.Path(made[0]).exists()
    assert kept.workdir == made[1] and await anyio.Path(made[1]).is_dir()


async def test_an_executor_that_cannot_start_ends_with_executor_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    async with LocalExecutor(workdir_root=str(tmp_path)) as executor:
        result = await run_scenario(
            spec(workdir=str(blocker / "sub")),
            agent=ScriptedAgent([step("terminate")]),
            executor=executor,
        )
    assert result.outcome is Outcome.EXECUTOR_ERROR
    assert result.reason is not None and "cannot create workdir" in result.reason


async def test_events_are_bound_to_scenario_and_step() -> None:
    with captured_events() as events:
        await run_scenario(demo_scenario(), agent=demo_agent())
    verdicts = [e for e in events if e["event"] == Events.GATE_VERDICT]
    assert [e["step"] for e in verdicts] == list(range(1, 13))
    assert all(e["scenario_id"] == "demo-sshd-x11-forwarding" for e in events)
    observed = [e for e in events if e["event"] == Events.EXEC_OBSERVED]
    assert len(observed) == 6  # two files written, four commands run
    refused = [e for e in events if e["event"] == Events.EVIDENCE_REFUSED]
    assert [(e["step"], e["reason"]) for e in refused] == [
        (8, "opa_raw: not one of the signal's evaluators, run as its argument vector")
    ]
    finished = [e for e in events if e["event"] == Events.SCENARIO_FINISHED]
    assert finished[0]["outcome"] == "terminated"
    # what commands printed or what artifacts contain never goes into events
    assert "X11Forwarding" not in json.dumps(events, default=str)


async def test_many_scenarios_share_one_event_loop() -> None:
    results: list[Outcome] = []

    async def one() -> None:
        result = await run_scenario(demo_scenario(), agent=demo_agent())
        results.append(result.outcome)

    async with anyio.create_task_group() as tg:
        for _ in range(10):
            tg.start_soon(one)
    assert results == [Outcome.TERMINATED] * 10
