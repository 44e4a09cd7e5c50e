"""Many scenarios in one process: scaling, memory per scenario, and cancellation speed.

Run: ``python benchmarks/batch_scale.py``. Scripted agents, the no-op executor, logging
not configured (events below WARNING dropped). Prints:

(a) aggregate steps per second with 1, 100, 1,000 and 10,000 scenarios in flight (2,000
    scenarios, or 10,000, under a capacity limit), and the ratio to as many scenarios run
    one after another in a loop, each pair measured back to back, median of the rounds;
    with ``cmbs batch``'s GC thresholds, and once with the interpreter's defaults; and
    the same ratio at 1,000 in flight for the bare stream hops with no work at all;
(b) peak memory per concurrent scenario: resident memory while 10,000 scenarios are all
    alive at once (each agent waits until the last one has started), over the baseline;
(c) the time from a deadline firing to every task of 1,000 hanging scenarios being gone.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import anyio
from bare_hops import hop_cost

from cmbs_async import CallableAgent, Outcome, ScenarioSpec, ScriptedAgent, Turn, run_scenario
from cmbs_async.batch import tune_gc_for_batches
from executors import NullExecutor

STEPS = 10
STEP = json.dumps(
    {
        "belief": {"posture": "unknown", "evidence": "none"},
        "action": {"type": "check_status", "payload": {"command": "true"}},
    }
)
SPEC = ScenarioSpec(id="bench", goal="g", deadline_s=600, max_steps=STEPS)


def rss_bytes() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


async def concurrent(total: int, in_flight: int) -> float:
    """Steps per second for ``total`` scenarios, ``in_flight`` of them at a time."""
    executor = NullExecutor()
    outcomes: list[Outcome] = []
    limiter = anyio.CapacityLimiter(in_flight)

    async def one() -> None:
        async with limiter:
            result = await run_scenario(
                SPEC, agent=ScriptedAgent([STEP] * STEPS), executor=executor
            )
        outcomes.append(result.outcome)

    start = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for _ in range(total):
            tg.start_soon(one)
    elapsed = time.perf_counter() - start
    assert outcomes == [Outcome.STEP_BUDGET_EXHAUSTED] * total
    return total * STEPS / elapsed


async def in_a_loop(n: int) -> float:
    executor = NullExecutor()
    start = time.perf_counter()
    for _ in range(n):
        await run_scenario(SPEC, agent=ScriptedAgent([STEP] * STEPS), executor=executor)
    return n * STEPS / (time.perf_counter() - start)


async def memory_per_scenario(n: int) -> tuple[float, float]:
    """Bytes per scenario while ``n`` are alive at once, and the slowest run's seconds."""
    executor = NullExecutor()
    all_started = anyio.Event()
    started = 0
    peak = 0
    slowest = 0.0

    async def agent(turn: Turn) -> str | None:
        nonlocal started, peak
        if turn.step == 1:
            started += 1
            if started == n:
                peak = rss_bytes()
                all_started.set()
            await all_started.wait()
        return STEP if turn.step <= STEPS else None

    async def one() -> None:
        nonlocal slowest
        result = await run_scenario(
            SPEC.model_copy(update={"deadline_s": 120}),
            agent=CallableAgent(agent),
            executor=executor,
        )
        assert result.outcome is Outcome.STEP_BUDGET_EXHAUSTED, result.outcome
        slowest = max(slowest, result.duration_s)

    base = rss_bytes()
    async with anyio.create_task_group() as tg:
        for _ in range(n):
            tg.start_soon(one)
    return (peak - base) / n, slowest


async def cancellation(n: int, deadline: float) -> tuple[float, float]:
    """Seconds from the deadline to every scenario's return; and the mean outcome lag."""

    async def hang(turn: Turn) -> str:
        await anyio.sleep_forever()
        raise AssertionError

    executor = NullExecutor()
    spec = SPEC.model_copy(update={"deadline_s": deadline})
    outcomes: list[Outcome] = []

    async def one() -> None:
        result = await run_scenario(spec, agent=CallableAgent(hang), executor=executor)
        outcomes.append(result.outcome)

    start = anyio.current_time()
    async with anyio.create_task_group() as tg:
        for _ in range(n):
            tg.start_soon(one)
    gone = anyio.current_time() - (start + deadline)
    assert outcomes == [Outcome.DEADLINE_EXCEEDED] * n
    return gone, deadline


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=("asyncio", "trio"), default="asyncio")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    run = lambda fn, *a: anyio.run(fn, *a, backend=args.backend)  # noqa: E731
    print(f"backend {args.backend}, {STEPS} steps a scenario, no-op executor")
    default_loop, default_1000 = run(in_a_loop, 2000), run(concurrent, 2000, 1000)
    tune_gc_for_batches()  # what `cmbs batch` does
    per_kib, slowest = run(memory_per_scenario, 10_000)
    print(
        f"(b) 10,000 scenarios alive at once: {per_kib / 1024:.1f} KiB each over the baseline; "
        f"all completed, slowest {slowest:.2f} s (deadline 120 s)"
    )
    print(f"(a) median of {args.rounds} rounds, each pairing a loop with each concurrency:")
    print(f"    {'in flight':>10} {'loop steps/s':>13} {'steps/s':>10} {'ratio':>6}")
    rows: dict[int, list[tuple[float, float]]] = {n: [] for n in (1, 100, 1000, 10_000)}
    for _ in range(args.rounds):  # interleaved: the machine's drift hits loop and batch alike
        for n in rows:
            total = max(n, 2000)
            rows[n].append((run(in_a_loop, total), run(concurrent, total, n)))
    for n, pairs in rows.items():
        loop = statistics.median(p[0] for p in pairs)
        rate = statistics.median(p[1] for p in pairs)
        ratio = statistics.median(p[1] / p[0] for p in pairs)
        print(f"    {n:>10,} {loop:>13,.0f} {rate:>10,.0f} {ratio:6.2f}")
    print(
        f"    with the interpreter's default GC thresholds: 1,000 in flight "
        f"{default_1000:,.0f} steps/s, ratio {default_1000 / default_loop:.2f}"
    )
    bare = [run(hop_cost, 2000, 1) / run(hop_cost, 2000, 1000) for _ in range(args.rounds)]
    print(
        f"    the bare stream hops alone (no work, benchmarks/bare_hops.py): 1,000 in flight "
        f"ratio {statistics.median(bare):.2f}"
    )
    gone, deadline = run(cancellation, 1000, 1.0)
    print(
        f"(c) 1,000 hanging scenarios, deadline {deadline:g} s: every task gone "
        f"{gone * 1000:.0f} ms after the deadline fired"
    )


if __name__ == "__main__":
    main()
