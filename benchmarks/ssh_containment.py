"""What containing remote commands and writing artifacts race-free costs over SSH.

Run: ``python benchmarks/ssh_containment.py ssh://USER@HOST[:PORT] --identity KEY
--known-hosts FILE [--commands N] [--concurrency C]`` as root. Two measures:

(1) the wrapper alone, on this machine without SSH: ``sh -c WRAPPER`` per containment
    against the bare ``sh -c 'cd DIR; eval CMD'`` the executor ran before, milliseconds
    per ``echo hi`` (``pidns`` needs root);
(2) through the sshd given, logged in as a user whose shell is /bin/sh (a heavy login rc
    file would hide what is measured; unless the user is root, ``pidns`` is not allowed):
    commands per second for raw asyncssh ``conn.run()`` and the executor under each
    containment the user may use, sequentially and C in flight, interleaved in rounds;
    and artifact writes per second, the executor's helper against a plain SFTP write
    (what the executor did before, which a racing process could redirect).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable

import anyio
import asyncssh
from ssh_throughput import add_target_options, connect, target_of, timed

from executors import ExecutorError
from executors.ssh import CONTAINMENTS, SSHExecutor, SSHTarget, _remote_command

COMMAND = "echo hi"


def wrapper_ms(script: str, n: int) -> float:
    """Median wall time of ``sh -c script``, its stdin an open pipe as over SSH."""
    times = []
    for _ in range(n):
        start = time.perf_counter()
        with subprocess.Popen(
            ["sh", "-c", script],
            stdin=subprocess.PIPE,  # held open: its end is a dropped channel to the wrapper
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        ) as shell:
            assert shell.stdout is not None
            output = shell.stdout.read()
            status = shell.wait()
        times.append(time.perf_counter() - start)
        assert output == b"hi\n" and status == 0, (output, status)
    return statistics.median(times) * 1000


def measure_wrappers(n: int) -> None:
    with tempfile.TemporaryDirectory() as workdir:
        bare = f"cd {workdir} || exit 1; eval {COMMAND!r}"
        scripts = {"bare (before)": bare} | {
            name: _remote_command(workdir, COMMAND, name, "0" * 16, None) for name in CONTAINMENTS
        }
        print(f"(1) the wrapper alone, median of {n} runs of {COMMAND!r}, ms per command:")
        for name, script in scripts.items():
            print(f"    {name:16} {wrapper_ms(script, n):6.2f}")


async def interleaved(
    n: int, concurrency: int, rounds: int, methods: list[Callable[[], Awaitable[None]]]
) -> list[float]:
    """Calls per second of each method, run in rounds that rotate their order."""
    spent = [0.0] * len(methods)
    per_round = max(n // rounds, 1)
    for r in range(rounds):
        for i in range(len(methods)):
            k = (i + r) % len(methods)
            spent[k] += per_round / await timed(per_round, concurrency, methods[k])
    return [per_round * rounds / t for t in spent]


async def measure_over_ssh(target: SSHTarget, n: int, concurrency: int, rounds: int) -> None:
    conn = await connect(target)
    sftp = await conn.start_sftp_client()
    names, executors = [], []
    for name in CONTAINMENTS:
        executor = SSHExecutor(target, containments=(name,))
        try:
            await executor.prepare(None, {})
        except ExecutorError:  # this login may not use it (pidns without root)
            await executor.aclose()
            continue
        names.append(name)
        executors.append(executor)

    async def raw_run() -> None:
        while True:
            try:
                result = await conn.run(COMMAND, check=True)
                break
            except asyncssh.ChannelOpenError:  # past MaxSessions: the same retry we do
                await anyio.sleep(0.01)
        assert result.stdout == "hi\n"

    def run_through(executor: SSHExecutor, workdir: str) -> Callable[[], Awaitable[None]]:
        async def one() -> None:
            observation = await executor.run_command(workdir, COMMAND, timeout=30)
            assert observation.success and observation.stdout.text == "hi\n"

        return one

    workdir = (await conn.run("mktemp -d", check=True)).stdout.strip()  # type: ignore[union-attr]
    counter = iter(range(10**9))

    async def sftp_write() -> None:
        async with sftp.open(f"{workdir}/s{next(counter)}", "wb") as handle:
            await handle.write(b"x" * 1024)

    def write_through(executor: SSHExecutor) -> Callable[[], Awaitable[None]]:
        async def one() -> None:
            observation = await executor.write_artifact(
                workdir, f"sub/e{next(counter)}", "x" * 1024
            )
            assert observation.success, observation.error

        return one

    commands = [raw_run, *(run_through(e, workdir) for e in executors)]
    writes = [sftp_write, *(write_through(e) for e in executors)]
    await interleaved(20, concurrency, 2, commands)  # warm up
    print(f"(2) through {target.label}, {n} calls, per second:")
    header = "".join(f"{name:>14}" for name in ("raw run", *names))
    print(f"    commands      {header}")
    for label, c in (("sequential", 1), (f"{concurrency} in flight", concurrency)):
        rates = await interleaved(n, c, rounds, commands)
        print(f"    {label:13} " + "".join(f"{rate:14.1f}" for rate in rates))
    header = "".join(f"{name:>14}" for name in ("SFTP (before)", *names))
    print(f"    1 KiB writes  {header}")
    for label, c in (("sequential", 1), (f"{concurrency} in flight", concurrency)):
        rates = await interleaved(n, c, rounds, writes)
        print(f"    {label:13} " + "".join(f"{rate:14.1f}" for rate in rates))
    for executor in executors:
        await executor.aclose()
    await conn.run(f"rm -rf -- {workdir}")
    conn.close()
    await conn.wait_closed()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--commands", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    add_target_options(parser)
    args = parser.parse_args()
    target = target_of(args)
    if os.geteuid() != 0:
        sys.exit("run as root: the pidns wrapper needs it")
    measure_wrappers(args.commands)
    anyio.run(measure_over_ssh, target, args.commands, args.concurrency, args.rounds)


if __name__ == "__main__":
    main()
