"""Throughput of the SSH executor against the two obvious alternatives.

Run: ``python benchmarks/ssh_throughput.py ssh://USER@HOST[:PORT] --identity KEY
--known-hosts FILE [--commands N] [--concurrency C]`` against an sshd of your choice (a
local one measures the executor, a remote one adds the network). In one run it sends the
same N short commands through:

(a) one ``ssh`` client process per command, what a naive agent does;
(b) raw asyncssh ``conn.run()`` on one connection;
(c) the SSH executor (pooled connection, channel cap, process-group wrapper, capped
    output, kill on time-out);

each sequentially and with C in flight, interleaved in rounds, and prints commands per
second and the ratios (c)/(a) and (c)/(b). Log in as a user whose shell is /bin/sh: a
heavy login rc file (``pyenv init``, say) costs every command the same and would dominate
the measure.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Awaitable, Callable

import anyio
import asyncssh

from executors.ssh import SSHExecutor, SSHTarget

COMMAND = "echo hi"


def add_target_options(parser: argparse.ArgumentParser) -> None:
    """The sshd measured against: the benchmarks start none of their own."""
    parser.add_argument("target", help="ssh://USER@HOST[:PORT], a user whose shell is /bin/sh")
    parser.add_argument("--identity", required=True, help="the user's private key file")
    parser.add_argument("--known-hosts", required=True, help="a known_hosts file with the host")


def target_of(args: argparse.Namespace) -> SSHTarget:
    target = SSHTarget.parse(args.target, identities=(args.identity,), known_hosts=args.known_hosts)
    if target.user is None:
        raise SystemExit(f"{args.target}: name the user, ssh://USER@HOST[:PORT]")
    return target


async def connect(target: SSHTarget) -> asyncssh.SSHClientConnection:
    """A raw asyncssh connection, the baseline the executor is measured against."""
    return await asyncssh.connect(
        target.host,
        port=target.port,
        username=target.user,
        client_keys=list(target.identities),
        known_hosts=target.known_hosts,
    )


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


async def main(target: SSHTarget, n: int, concurrency: int, rounds: int) -> None:
    ssh_argv = [
        "ssh",
        "-q",
        "-p",
        str(target.port),
        *(option for key in target.identities for option in ("-i", key)),
        "-o",
        f"UserKnownHostsFile={target.known_hosts}",
        "-o",
        "BatchMode=yes",
        f"{target.user}@{target.host}",
        COMMAND,
    ]

    async def client_process() -> None:
        done = await anyio.run_process(ssh_argv, check=True)
        assert done.stdout == b"hi\n"

    conn = await connect(target)

    async def raw_run() -> None:
        while True:
            try:
                result = await conn.run(COMMAND, check=True)
                break
            except asyncssh.ChannelOpenError:  # past MaxSessions: the same retry we do
                await anyio.sleep(0.01)
        assert result.stdout == "hi\n"

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

    print(f"{n} commands ({COMMAND!r}) against {target.label}, commands per second:")
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
    add_target_options(parser)
    args = parser.parse_args()
    anyio.run(main, target_of(args), args.commands, args.concurrency, args.rounds)
