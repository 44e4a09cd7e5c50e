"""What knowing the workdir file by file costs per step.

Run: ``python benchmarks/snapshot_cost.py [--files N] [--rounds N] [--steps N]``. After
every action the executor takes a snapshot of the workdir (every file's inode, size and
times; a hash only of what changed) so that the gate can judge an evaluation's input by
content, whatever its name. In one process, interleaved round by round, on a workdir of
``--files`` files (1,000 by default) in subdirectories of 100:

- a snapshot of the unchanged workdir (``take`` with the last one: ``stat`` per file),
- a snapshot after a command rewrote one file (one hash more),
- the executor's whole step: a sandboxed ``true`` (its snapshot included), in that
  workdir and in an empty one,
- ``opa eval`` as IT-Bench runs it (``cmbs-opa``), in that workdir: a real evaluation.

Prints medians and the ratios to a step.
"""

from __future__ import annotations

import argparse
import statistics
import time

import anyio

from executors import LocalExecutor
from executors.snapshot import take

POLICY = 'package check\n\ndefault result := false\n\nresult if input.x == "no"\n'
EVALUATE = "cmbs-opa eval -d policy.rego -i in.json --format raw data.check.result"


def files(count: int) -> dict[str, str]:
    made = {f"d{i // 100}/f{i}.txt": f"file {i}\n" * 20 for i in range(count)}
    return made | {"policy.rego": POLICY, "in.json": '{"x": "no"}\n'}


async def step_time(executor: LocalExecutor, workdir: str, command: str) -> float:
    started = time.perf_counter()
    observed = await executor.run_command(workdir, command, timeout=60)
    assert observed.success, observed
    return time.perf_counter() - started


async def main(count: int, rounds: int, steps: int) -> None:
    timed: dict[str, list[float]] = {
        "snapshot, nothing changed": [],
        "snapshot, one file rewritten": [],
        "step: true, 1,000 files": [],
        "step: true, empty workdir": [],
        "step: opa eval, 1,000 files": [],
    }
    async with LocalExecutor(sandbox="bwrap") as executor:
        full = await executor.prepare(None, files(count))
        empty = await executor.prepare(None, {})
        tree = take(full)
        assert len(tree) >= count
        for _ in range(rounds):
            for _ in range(steps):
                started = time.perf_counter()
                tree = take(full, tree)
                timed["snapshot, nothing changed"].append(time.perf_counter() - started)
                await anyio.Path(full, "d0", "f0.txt").write_text(f"changed {time.time()}\n")
                started = time.perf_counter()
                tree = take(full, tree)
                timed["snapshot, one file rewritten"].append(time.perf_counter() - started)
                timed["step: true, 1,000 files"].append(await step_time(executor, full, "true"))
                timed["step: true, empty workdir"].append(await step_time(executor, empty, "true"))
            timed["step: opa eval, 1,000 files"].append(await step_time(executor, full, EVALUATE))
        await executor.cleanup(full)
        await executor.cleanup(empty)
    median = {name: statistics.median(times) * 1000 for name, times in timed.items()}
    print(f"workdir of {count} files; medians over {rounds} rounds of {steps} steps")
    for name, ms in median.items():
        print(f"  {name:32} {ms:8.2f} ms")
    unchanged = median["snapshot, nothing changed"]
    print(f"snapshot / sandboxed true step:   {unchanged / median['step: true, 1,000 files']:.2f}")
    print(
        f"snapshot / opa eval step:         {unchanged / median['step: opa eval, 1,000 files']:.2f}"
    )
    extra = median["step: true, 1,000 files"] / median["step: true, empty workdir"]
    print(f"true step, 1,000 files / empty:   {extra:.2f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    anyio.run(main, args.files, args.rounds, args.steps)
