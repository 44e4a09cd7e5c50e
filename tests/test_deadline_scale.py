"""The deadline holds at scale: 200 sandboxed scenarios at once, each ending on time."""

from __future__ import annotations

import anyio
import pytest

from cmbs_async import Outcome, ScenarioSpec, ScriptedAgent, run_scenario
from executors import LocalExecutor

from .helpers import processes_with, step, unique_seconds

pytestmark = pytest.mark.anyio

RUNS = 200
#: Long enough for all 200 sandboxes to start (each proven by its canary, within the run's
#: deadline: 4-8 s on 2 busy cores), so that the deadline falls on 200 running commands.
DEADLINE = 20.0
TEARDOWN = 2.5


@pytest.mark.parametrize(
    "command",
    ["sleep {m}", "trap '' TERM; setsid sh -c 'trap \"\" TERM; sleep {m}' & sleep {m}"],
    ids=["sleep", "TERM-ignoring setsid"],
)
async def test_200_runs_at_once_each_end_within_seconds_of_their_deadline(
    command: str,
) -> None:
    mark = unique_seconds()
    late: list[float] = []
    outcomes: list[tuple[Outcome, str | None]] = []
    steps: list[int] = []

    async def one(index: int) -> None:
        agent = ScriptedAgent([step("check_status", {"command": command.format(m=mark)})])
        spec = ScenarioSpec(id=f"scale-{index}", goal="g", deadline_s=DEADLINE)
        started = anyio.current_time()
        result = await run_scenario(spec, agent=agent, executor=executor)
        late.append(anyio.current_time() - started - DEADLINE)
        outcomes.append((result.outcome, result.reason))
        steps.append(result.steps)

    async with LocalExecutor() as executor:
        async with anyio.create_task_group() as tg:
            for index in range(RUNS):
                tg.start_soon(one, index)
    odd = [
        (outcome, reason)
        for outcome, reason in outcomes
        if outcome is not Outcome.DEADLINE_EXCEEDED
    ]
    assert odd == [], f"{len(odd)} of {RUNS} runs did not end at their deadline"
    assert steps == [1] * RUNS, "some sandboxes took longer than the deadline to start"
    # Once the deadline fires a command gets ``kill_grace`` to end on TERM; the kernel then
    # tears down 200 PID namespaces one after another (1.5-1.7 s measured on 2 cores for
    # TERM-ignoring ones). Before containment these runs ended 8-20 s late.
    budget = executor.kill_grace + TEARDOWN
    assert max(late) < budget, f"latest run ended {max(late):.2f} s after its deadline"
    assert processes_with(mark) == []
