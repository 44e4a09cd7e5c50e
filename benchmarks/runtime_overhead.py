"""Overhead of the actor runtime over a plain loop, and the gate's decision cost.

Run: ``python benchmarks/runtime_overhead.py [--rounds N]``. In one process, side by side
and interleaved round by round, on asyncio and trio:

(a) steps per second of ``run_scenario`` (three actors, memory streams, one cancel scope,
    logging not configured: events below WARNING are dropped) versus a plain loop calling the same
    agent, gate and executor directly; with a no-op executor, with the local executor
    running ``true`` bare and in its bubblewrap sandbox, and with an executor that only
    sleeps 1 ms (no process: it shows what waiting alone does to the steps around it).
    Ratio = runtime / plain (1.0 means no overhead), the median of the per-round ratios.
(b) the floor under (a): the four stream hops of a step with no work at all;
(c) the gate's decision cost per step (median and p99), over a mix of steps;
(d) the cost of one event through the runtime's per-run logger: dropped (logging not
    configured, the default) and delivered (a handler at INFO that keeps nothing).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from collections.abc import Callable

import anyio
from bare_hops import hop_cost

from cmbs_async import CallableAgent, Gate, ScenarioSpec, Turn, load_profile, run_scenario
from cmbs_async.events import Events, logger
from cmbs_async.protocol import CommandEnv, Observation
from executors import LocalExecutor, NullExecutor

STEP = json.dumps(
    {
        "belief": {"affordances": {}, "posture": "unknown", "evidence": "none"},
        "action": {"type": "check_status", "payload": {"command": "true"}},
    }
)
PROFILE = load_profile("ciso")


async def _agent(turn: Turn) -> str:
    return STEP


class SleepExecutor(NullExecutor):
    """Every command takes 1 ms of waiting and no CPU."""

    async def run_command(
        self,
        workdir: str,
        command: str,
        *,
        timeout: float | None,  # noqa: ASYNC109 - the executor protocol's signature
        env: CommandEnv | None = None,
    ) -> Observation:
        await anyio.sleep(0.001)
        return await super().run_command(workdir, command, timeout=timeout, env=env)


async def plain_loop(executor: object, steps: int) -> float:
    """The same agent, gate and executor, called directly: no actors, no streams."""
    agent = CallableAgent(_agent)
    gate = Gate(PROFILE)
    workdir = await executor.prepare(None, {})  # type: ignore[attr-defined]
    start = time.perf_counter()
    turn = Turn(scenario_id="b", goal="g", step=1)
    for _ in range(steps):
        decision = gate.decide(await agent.next_step(turn))  # type: ignore[arg-type]
        if decision.needs_execution:
            gate.observe(await executor.run_command(workdir, "true", timeout=None))  # type: ignore[attr-defined]
        turn = Turn.model_construct(
            scenario_id="b",
            goal="g",
            vars={},
            actions=(),
            step=gate.step_count + 1,
            response=gate.response(decision),
        )
    elapsed = time.perf_counter() - start
    await executor.cleanup(workdir)  # type: ignore[attr-defined]
    return steps / elapsed


async def actor_runtime(executor: object, steps: int) -> float:
    spec = ScenarioSpec(id="b", goal="g", max_steps=steps, deadline_s=3600)
    start = time.perf_counter()
    result = await run_scenario(spec, agent=CallableAgent(_agent), executor=executor)  # type: ignore[arg-type]
    elapsed = time.perf_counter() - start
    assert result.steps == steps, result.outcome
    return steps / elapsed


def gate_cost(samples: int) -> tuple[float, float]:
    """Median and p99 of one ``Gate.decide`` in microseconds, over a mix of steps."""
    mix = [
        STEP,
        STEP.replace("check_status", "declare_posture").replace(
            '"command": "true"', '"posture": "compliant"'
        ),
        STEP.replace("check_status", "terminate").replace('{"command": "true"}', "{}"),
        "{not json",
    ]
    gate = Gate(PROFILE)
    costs = []
    for i in range(samples):
        raw = mix[i % len(mix)]
        t0 = time.perf_counter_ns()
        gate.decide(raw)
        costs.append(time.perf_counter_ns() - t0)
        if i % 1000 == 999:
            gate = Gate(PROFILE)  # keep the posture history short, as in a real run
    costs.sort()
    return statistics.median(costs) / 1000, costs[int(len(costs) * 0.99)] / 1000


def event_cost(samples: int, *, deliver: bool = False) -> float:
    """Nanoseconds per ``gate.verdict`` event through a logger bound as a run binds it."""
    stdlib = logging.getLogger("cmbs_async")
    handler = logging.NullHandler()
    if deliver:
        stdlib.addHandler(handler)
        stdlib.setLevel(logging.INFO)
    try:
        log = logger.bind()
        start = time.perf_counter_ns()
        for _ in range(samples):
            log.info(
                Events.GATE_VERDICT,
                action="check_status",
                verdict="ALLOW",
                reason="Action allowed.",
                detail=None,
            )
        return (time.perf_counter_ns() - start) / samples
    finally:
        stdlib.removeHandler(handler)
        stdlib.setLevel(logging.NOTSET)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--null-steps", type=int, default=3000)
    parser.add_argument("--true-steps", type=int, default=200)
    args = parser.parse_args()

    cases: list[tuple[str, Callable[[], object], int]] = [
        ("no-op executor", NullExecutor, args.null_steps),
        ("local `true`", lambda: LocalExecutor(sandbox="none"), args.true_steps),
        ("bwrap `true`", lambda: LocalExecutor(sandbox="bwrap"), args.true_steps),
        ("sleep 1 ms", SleepExecutor, args.true_steps),
    ]
    print(
        f"{'backend':8} {'executor':15} {'plain steps/s':>14} {'runtime steps/s':>16} {'ratio':>6}"
    )
    for backend in ("asyncio", "trio"):
        for label, make, steps in cases:
            plain, actors = [], []
            for _ in range(args.rounds):  # interleaved, so drift hits both alike
                plain.append(anyio.run(plain_loop, make(), steps, backend=backend))
                actors.append(anyio.run(actor_runtime, make(), steps, backend=backend))
            p, a = statistics.median(plain), statistics.median(actors)
            ratio = statistics.median(y / x for x, y in zip(plain, actors, strict=True))
            print(f"{backend:8} {label:15} {p:14.0f} {a:16.0f} {ratio:6.3f}")
    floor = {
        backend: statistics.median(
            anyio.run(hop_cost, 100, 1, 100, backend=backend) for _ in range(args.rounds)
        )
        for backend in ("asyncio", "trio")
    }
    print(
        "\nfour bare stream hops per step, no work (benchmarks/bare_hops.py): "
        + ", ".join(f"{backend} {us:.1f} us" for backend, us in floor.items())
    )
    median, p99 = gate_cost(40_000)
    print(f"gate decision cost per step: median {median:.1f} us, p99 {p99:.1f} us")
    dropped, delivered = event_cost(200_000), event_cost(20_000, deliver=True)
    print(f"one event: {dropped:.0f} ns dropped, {delivered / 1000:.1f} us delivered to a handler")


if __name__ == "__main__":
    main()
