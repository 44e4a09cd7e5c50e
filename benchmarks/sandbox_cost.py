"""What the sandbox costs per command, and per scenario.

Run: ``python benchmarks/sandbox_cost.py [--rounds N] [--commands N] [--pause MS]``. In one
process, interleaved round by round, the local executor running ``true``:

- in the scenario's sandbox (``sandbox="bwrap"``: one bubblewrap per scenario, the command
  as PID 1 of a namespace the launcher made ready, as ``nobody``, in a control group),
- bare (``sandbox="none"``: a process group, as the operator),

each back to back (a command as soon as the last one ended) and paced (``--pause`` ms
between commands, as between an agent's steps, which take seconds in truth). For context:
``subprocess.run(["sh", "-c", "true"])`` with no executor at all, and one ``bwrap`` started
per command (what cmbs did before: the namespaces and mounts made anew each time). Then
what a scenario's sandbox costs once: ``prepare`` (start it, run the canary) and
``cleanup``. Prints medians and the ratios sandbox / bare (target: at most 1.5).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time

import anyio

from executors import LocalExecutor
from executors.sandbox import find_bwrap


async def per_command(executor: LocalExecutor, workdir: str, commands: int, pause: float) -> float:
    """Median seconds per ``true``, ``pause`` seconds apart (not counted)."""
    times = []
    for _ in range(commands):
        if pause:
            await anyio.sleep(pause)
        started = time.perf_counter()
        observation = await executor.run_command(workdir, "true", timeout=30)
        times.append(time.perf_counter() - started)
        assert observation.success, observation
    return statistics.median(times)


def floor(argv: list[str], commands: int) -> float:
    started = time.perf_counter()
    for _ in range(commands):
        subprocess.run(argv, check=True)
    return (time.perf_counter() - started) / commands


def bwrap_per_command(bwrap: str) -> list[str]:
    return [
        bwrap, "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp",
        "--unshare-pid", "--die-with-parent", "--cap-drop", "ALL", "--", "/bin/sh", "-c", "true",
    ]  # fmt: skip


async def scenario_cost(executor: LocalExecutor) -> tuple[float, float]:
    started = time.perf_counter()
    workdir = await executor.prepare(None, {})
    prepared = time.perf_counter()
    await executor.cleanup(workdir)
    return prepared - started, time.perf_counter() - prepared


async def main(rounds: int, commands: int, pause_ms: float) -> None:
    bwrap = find_bwrap()
    assert bwrap is not None, "this benchmark needs bubblewrap"
    pause = pause_ms / 1000
    times: dict[str, list[float]] = {
        key: [] for key in ("bwrap", "none", "bwrap paced", "none paced", "sh", "bwrap each")
    }
    starts: list[tuple[float, float]] = []
    async with LocalExecutor(sandbox="bwrap") as sandboxed, LocalExecutor(sandbox="none") as bare:
        inside, outside = await sandboxed.prepare(None, {}), await bare.prepare(None, {})
        await per_command(sandboxed, inside, 20, 0)  # warm up both
        await per_command(bare, outside, 20, 0)
        for _ in range(rounds):
            times["bwrap"].append(await per_command(sandboxed, inside, commands, 0))
            times["none"].append(await per_command(bare, outside, commands, 0))
            times["bwrap paced"].append(await per_command(sandboxed, inside, commands, pause))
            times["none paced"].append(await per_command(bare, outside, commands, pause))
            times["sh"].append(floor(["/bin/sh", "-c", "true"], commands))
            times["bwrap each"].append(floor(bwrap_per_command(bwrap), commands))
            starts.append(await scenario_cost(sandboxed))
        await sandboxed.cleanup(inside)
        await bare.cleanup(outside)
    ms = {name: statistics.median(values) * 1000 for name, values in times.items()}

    def ratio(a: str, b: str) -> float:
        return statistics.median(x / y for x, y in zip(times[a], times[b], strict=True))

    print(f"{rounds} rounds x {commands} commands of `true`, median ms per command:")
    print(f"  subprocess.run(sh -c true), no executor      {ms['sh']:7.2f}")
    print(f"  a bwrap per command (before), no executor    {ms['bwrap each']:7.2f}")
    print(f"  executor, bare, back to back                 {ms['none']:7.2f}")
    print(f"  executor, sandboxed, back to back            {ms['bwrap']:7.2f}")
    print(f"  executor, bare, {pause_ms:g} ms apart                 {ms['none paced']:7.2f}")
    print(f"  executor, sandboxed, {pause_ms:g} ms apart            {ms['bwrap paced']:7.2f}")
    print(f"  ratio sandboxed / bare, back to back          {ratio('bwrap', 'none'):6.2f}")
    print(f"  ratio sandboxed / bare, {pause_ms:g} ms apart            "
          f"{ratio('bwrap paced', 'none paced'):6.2f}  (target <= 1.5)")  # fmt: skip
    prepare = statistics.median(p for p, _ in starts) * 1000
    cleanup = statistics.median(c for _, c in starts) * 1000
    print(
        f"a scenario's sandbox: prepare (start + canary) {prepare:.1f} ms, cleanup {cleanup:.1f} ms"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--commands", type=int, default=100)
    parser.add_argument("--pause", type=float, default=5.0, help="ms between paced commands")
    options = parser.parse_args()
    anyio.run(main, options.rounds, options.commands, options.pause)
