"""How late after its deadline each run ends, with many sandboxed runs at once.

Run: ``python benchmarks/deadline_spread.py [--sizes 1,200] [--deadline S]
[--backend asyncio|trio]``. For each size, that many scenarios start together on one event
loop, each with a 20 s deadline (time for every sandbox to start and be proven) and one
command that never ends (``sleep``; and one that ignores TERM and calls ``setsid``);
prints how late after its deadline each run returned: median and max (target: every run
within 1 s at 200 in flight).
"""

from __future__ import annotations

import argparse
import json
import statistics

import anyio

from cmbs_async import ScenarioSpec, ScriptedAgent, run_scenario
from executors import LocalExecutor

COMMANDS = {
    "sleep": "sleep 1000",
    "TERM-ignoring setsid": "trap '' TERM; setsid sh -c 'trap \"\" TERM; sleep 1000' & sleep 1000",
}


def step(command: str) -> str:
    return json.dumps(
        {
            "belief": {"affordances": {}, "posture": "unknown", "evidence": "none"},
            "action": {"type": "check_status", "payload": {"command": command}},
        }
    )


async def spread(size: int, deadline: float, command: str) -> list[float]:
    async with LocalExecutor() as executor:
        return await _spread(executor, size, deadline, command)


async def _spread(executor: LocalExecutor, size: int, deadline: float, command: str) -> list[float]:
    late: list[float] = []

    async def one(index: int) -> None:
        spec = ScenarioSpec(id=f"spread-{index}", goal="g", deadline_s=deadline)
        started = anyio.current_time()
        await run_scenario(spec, agent=ScriptedAgent([step(command)]), executor=executor)
        late.append(anyio.current_time() - started - deadline)

    async with anyio.create_task_group() as tg:
        for index in range(size):
            tg.start_soon(one, index)
    return late


async def main(sizes: list[int], deadline: float) -> None:
    print(f"deadline {deadline:g} s; seconds after it that runs ended (one sandbox a scenario)")
    print(f"{'in flight':>10}  {'command':<22} {'median':>7} {'max':>7}")
    for size in sizes:
        for name, command in COMMANDS.items():
            late = await spread(size, deadline, command)
            print(f"{size:>10}  {name:<22} {statistics.median(late):7.3f} {max(late):7.3f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1,200")
    parser.add_argument("--deadline", type=float, default=20.0)
    parser.add_argument("--backend", choices=("asyncio", "trio"), default="asyncio")
    options = parser.parse_args()
    sizes = [int(s) for s in options.sizes.split(",")]
    anyio.run(main, sizes, options.deadline, backend=options.backend)
