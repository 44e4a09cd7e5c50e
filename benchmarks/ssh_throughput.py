"""Throughput of the SSH executor against the two obvious alternatives.

Run: ``python benchmarks/ssh_throughput.py [--commands N] [--concurrency C]``. Starts its
own sshd on 127.0.0.1 (Debian's openssh-server must be installed) and, in one run, sends
the same N short commands through:

(a) one ``ssh`` client process per command, what a naive agent does;
(b) raw asyncssh ``conn.run()`` on one connection;
(c) the SSH executor (pooled connection, channel cap, process-group wrapper, capped
    output, kill on time-out);

each sequentially and with C in flight, interleaved in rounds, and prints commands per
second and the ratios (c)/(a) and (c)/(b). Run as root, it logs in as a throwaway user
whose shell is /bin/sh, so that a heavy login rc file does not dominate the measure.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import anyio
import asyncssh

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from executors.ssh import SSHExecutor, SSHTarget  # noqa: E402
from tests.sshd import LocalSshd, ThrowawayUser  # noqa: E402

COMMAND = "echo hi"


async def timed(n: int, concurrency: int, one: Callable[[], Awaitable[None]]) -> float:
    """Commands per second for ``n`` calls of ``one`` with ``concurrency`` in flight."""
    limiter = anyio.Semaphore(concurrency)

    async def guarded() -> None:
        async with limiter:
            await one()

    start = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for _ in range(n):
            tg.start_soon(guarded)
    return n / (time.perf_counter() - start)


async def main(n: int, concurrency: int, rounds: int, light_user: bool) -> None:
    with contextlib.ExitStack() as stack:
        user = stack.enter_context(ThrowawayUser()) if light_user else None
        sshd = stack.enter_context(LocalSshd(user=user))
        ssh_argv = [
            "ssh",
            "-q",
            "-p",
            str(sshd.port),
            "-i",
            sshd.client_key,
            "-o",
            f"UserKnownHostsFile={sshd.known_hosts}",
            "-o",
            "BatchMode=yes",
            f"{sshd.user}@127.0.0.1",
            COMMAND,
        ]

        async def client_process() -> None:
            done = await anyio.run_process(ssh_argv, check=True)
            assert done.stdout == b"hi\n"

        conn = await asyncssh.connect(
            "127.0.0.1",
            port=sshd.port,
            username=sshd.user,
            client_keys=[sshd.client_key],
            known_hosts=sshd.known_hosts,
        )

        async def raw_run() -> None:
            while True:
                try:
                    result = await conn.run(COMMAND, check=True)
                    break
                except asyncssh.ChannelOpenError:  # past MaxSessions: the same retry we do
                    await anyio.sleep(0.01)
            assert result.stdout == "hi\n"

        target = SSHTarget.parse(
            sshd.url, identities=(sshd.client_key,), known_hosts=sshd.known_hosts
        )
        async with SSHExecutor(target) as executor:
            workdir = await executor.prepare(None, {})

            async def through_executor() -> None:
                observation = await executor.run_command(workdir, COMMAND, timeout=30)
                assert observation.success and observation.stdout.text == "hi\n"

            await timed(20, concurrency, through_executor)  # warm up
            await timed(20, concurrency, raw_run)
            methods = (client_process, raw_run, through_executor)
            rows = []
            for label, c in (("sequential", 1), (f"{concurrency} in flight", concurrency)):
                # Interleaved in rounds, so that the machine's drift hits all three alike.
                spent = [0.0, 0.0, 0.0]
                per_round = max(n // rounds, 1)
                for r in range(rounds):
                    for i in range(3):
                        k = (i + r) % 3
                        spent[k] += per_round / await timed(per_round, c, methods[k])
                total = per_round * rounds
                rows.append((label, *(total / t for t in spent)))
            await executor.cleanup(workdir)
        conn.close()
        await conn.wait_closed()

    print(f"{n} commands ({COMMAND!r}) against a local sshd, commands per second:")
    print(
        f"{'':14} {'(a) ssh CLI':>12} {'(b) raw run':>12} {'(c) executor':>13} "
        f"{'c/a':>6} {'c/b':>6}"
    )
    for label, a, b, x in rows:
        print(f"{label:14} {a:12.1f} {b:12.1f} {x:13.1f} {x / a:6.2f} {x / b:6.2f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--commands", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--as-current-user",
        action="store_true",
        help="log in as yourself instead of a throwaway /bin/sh user (the default as root)",
    )
    args = parser.parse_args()
    light = os.geteuid() == 0 and not args.as_current_user
    print(f"remote user: {'a throwaway user with /bin/sh' if light else 'the current user'}")
    anyio.run(main, args.commands, args.concurrency, args.rounds, light)
