"""What the bubblewrap sandbox costs per command.

Run: ``python benchmarks/sandbox_cost.py [--rounds N] [--commands N]``. In one process,
interleaved round by round: the local executor running ``true`` in the sandbox
(``sandbox="bwrap"``: a new PID namespace, read-only host, private /tmp) and without it
(``sandbox="none"``: a process group), plus ``subprocess.run(["sh", "-c", "true"])`` as the
floor. Prints the median time per command of each, the sandbox's added milliseconds and
the ratio sandbox / bare executor (target: at most 10 ms added).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import time

import anyio

from executors import LocalExecutor


async def per_command(executor: LocalExecutor, workdir: str, commands: int) -> float:
    started = time.perf_counter()
    for _ in range(commands):
        observation = await executor.run_command(workdir, "true", timeout=30)
        assert observation.success, observation
    return (time.perf_counter() - started) / commands


def floor(commands: int) -> float:
    started = time.perf_counter()
    for _ in range(commands):
        subprocess.run(["/bin/sh", "-c", "true"], check=True)
    return (time.perf_counter() - started) / commands


async def main(rounds: int, commands: int) -> None:
    sandboxed, bare = LocalExecutor(sandbox="bwrap"), LocalExecutor(sandbox="none")
    times: dict[str, list[float]] = {"bwrap": [], "none": [], "subprocess": []}
    with tempfile.TemporaryDirectory() as workdir:
        await per_command(sandboxed, workdir, 10)  # warm up both
        await per_command(bare, workdir, 10)
        for _ in range(rounds):
            times["bwrap"].append(await per_command(sandboxed, workdir, commands))
            times["none"].append(await per_command(bare, workdir, commands))
            times["subprocess"].append(floor(commands))
    median = {name: statistics.median(values) * 1000 for name, values in times.items()}
    ratios = [b / n for b, n in zip(times["bwrap"], times["none"], strict=True)]
    print(f"{rounds} rounds x {commands} commands of `true`, median ms per command:")
    print(f"  subprocess.run, no executor   {median['subprocess']:7.2f}")
    print(f"  executor, sandbox none        {median['none']:7.2f}")
    print(f"  executor, sandbox bwrap       {median['bwrap']:7.2f}")
    print(
        f"  added by the sandbox          {median['bwrap'] - median['none']:7.2f} ms (target <= 10)"
    )
    print(f"  ratio bwrap / none            {statistics.median(ratios):7.2f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--commands", type=int, default=100)
    options = parser.parse_args()
    anyio.run(main, options.rounds, options.commands)
