"""What each containment of the SSH executor costs, on the host you name.

Run: ``python benchmarks/ssh_containment.py ssh://USER@HOST[:PORT] --identity KEY
--known-hosts FILE [--commands N] [--concurrency C] [--rounds R] [--scenarios S]``, logged
in as a user whose shell is /bin/sh (``pidns`` needs root; ``bwrap`` bubblewrap, as root
or with unprivileged user namespaces; ``session-kill`` is no sandbox). For each
containment the login may use:

(1) a scenario's sandbox: ``prepare`` (a launcher started over SSH, the sandbox built,
    its canary run) and ``cleanup``, median of S, milliseconds;
(2) commands per second, raw asyncssh ``conn.run()`` against the executor in one
    workdir, sequentially and C in flight, interleaved in rounds; and 1 KiB artifact
    writes per second, SFTP against the executor's launcher;
(3) the time-out's overrun: a command that ignores TERM, ``timeout=1``, how much later
    than 1 s the executor returned (the kill grace is 0.5 s), median of 5.
"""

from __future__ import annotations

import argparse
import statistics
import time

import anyio
from ssh_throughput import (
    add_target_options,
    connect,
    executor_runner,
    interleaved,
    raw_runner,
    target_of,
    writers,
)

from executors import ExecutorError
from executors.ssh import CONTAINMENTS, SSHExecutor, SSHTarget


async def sandbox_ms(executor: SSHExecutor, scenarios: int) -> tuple[float, float]:
    """Median milliseconds of a prepare and of a cleanup."""
    prepared, cleaned = [], []
    for _ in range(scenarios):
        start = time.perf_counter()
        workdir = await executor.prepare(None, {})
        prepared.append(time.perf_counter() - start)
        start = time.perf_counter()
        await executor.cleanup(workdir)
        cleaned.append(time.perf_counter() - start)
    return statistics.median(prepared) * 1000, statistics.median(cleaned) * 1000


async def overrun_ms(executor: SSHExecutor, workdir: str) -> float:
    """Median milliseconds past a 1 s time-out before a TERM-ignoring command is reported."""
    late = []
    for _ in range(5):
        start = time.perf_counter()
        observation = await executor.run_command(workdir, "trap '' TERM; sleep 60", timeout=1)
        assert observation.timed_out
        late.append(time.perf_counter() - start - 1)
    return statistics.median(late) * 1000


async def main(target: SSHTarget, n: int, concurrency: int, rounds: int, scenarios: int) -> None:
    conn = await connect(target)
    sftp = await conn.start_sftp_client()
    names, executors, workdirs = [], [], []
    for name in CONTAINMENTS:
        executor = SSHExecutor(target, containments=(name,))
        try:
            workdirs.append(await executor.prepare(None, {"sftp/.keep": ""}))
        except ExecutorError as exc:  # this login may not use it
            print(f"    {name}: not available here ({exc})")
            await executor.aclose()
            continue
        names.append(name)
        executors.append(executor)

    print(f"(1) a scenario's sandbox on {target.label}, median of {scenarios}, ms:")
    print(f"    {'':14}{'prepare':>10}{'cleanup':>10}")
    for name, executor in zip(names, executors, strict=True):
        prepared, cleaned = await sandbox_ms(executor, scenarios)
        print(f"    {name:14}{prepared:10.1f}{cleaned:10.1f}")

    commands = [raw_runner(conn)] + [
        executor_runner(e, w) for e, w in zip(executors, workdirs, strict=True)
    ]
    writes = [writers(sftp, executors[0], workdirs[0])[0]] + [
        writers(sftp, e, w)[1] for e, w in zip(executors, workdirs, strict=True)
    ]
    await interleaved(20, concurrency, 2, commands + writes)  # warm up
    print(f"(2) {n} calls per row, per second:")
    header = "".join(f"{name:>14}" for name in ("raw run", *names))
    print(f"    commands      {header}")
    for label, c in (("sequential", 1), (f"{concurrency} in flight", concurrency)):
        rates = await interleaved(n, c, rounds, commands)
        ratios = "  ".join(f"{r / rates[0]:.2f}" for r in rates[1:])
        print(f"    {label:13} " + "".join(f"{rate:14.1f}" for rate in rates) + f"   ({ratios})")
    header = "".join(f"{name:>14}" for name in ("SFTP", *names))
    print(f"    1 KiB writes  {header}")
    for label, c in (("sequential", 1), (f"{concurrency} in flight", concurrency)):
        rates = await interleaved(n, c, rounds, writes)
        ratios = "  ".join(f"{r / rates[0]:.2f}" for r in rates[1:])
        print(f"    {label:13} " + "".join(f"{rate:14.1f}" for rate in rates) + f"   ({ratios})")

    print("(3) a TERM-ignoring command, timeout 1 s, kill grace 0.5 s: ms past the time-out")
    for name, executor, workdir in zip(names, executors, workdirs, strict=True):
        print(f"    {name:14}{await overrun_ms(executor, workdir):10.1f}")

    for executor, workdir in zip(executors, workdirs, strict=True):
        await executor.cleanup(workdir)
        await executor.aclose()
    sftp.exit()
    conn.close()
    await conn.wait_closed()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--commands", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--scenarios", type=int, default=20)
    add_target_options(parser)
    args = parser.parse_args()
    anyio.run(main, target_of(args), args.commands, args.concurrency, args.rounds, args.scenarios)
