"""Throughput of the SSH executor against the obvious alternatives, side by side.

Run: ``python benchmarks/ssh_throughput.py ssh://USER@HOST[:PORT] --identity KEY
--known-hosts FILE [--commands N] [--concurrency C] [--rounds R]`` against an sshd of your
choice (a local one measures the executor, a remote one adds the network). In one run,
interleaved in rounds so that the machine's drift hits all alike, it sends the same N
short commands through

(a) one ``ssh`` client process per command, what a naive agent does;
(b) raw asyncssh ``conn.run()`` on one connection (a session and a login shell each);
(c) the SSH executor, in one prepared workdir (its sandbox built once, each command in a
    PID namespace of its own, capped output, kill on time-out);

each sequentially and with C in flight; and N writes of 1 KiB through (d) SFTP on an open
channel (which follows any link a racing process swaps in) and (e) the executor's
launcher (link-safe). It prints calls per second and the ratios c/a, c/b and e/d.

Log in as a user whose shell is /bin/sh: a heavy login rc file (``pyenv init``, say)
costs (a) and (b) every command and would flatter (c), which logs in once.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Awaitable, Callable
from itertools import count

import anyio
import asyncssh

from executors.ssh import SSHExecutor, SSHTarget

COMMAND = "echo hi"
CONTENT = "x" * 1024


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
        config=[],
        agent_path=None,
    )


async def timed(n: int, concurrency: int, one: Callable[[], Awaitable[None]]) -> float:
    """Calls per second for ``n`` calls of ``one`` with ``concurrency`` in flight."""
    limiter = anyio.Semaphore(concurrency)

    async def guarded() -> None:
        async with limiter:
            await one()

    start = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for _ in range(n):
            tg.start_soon(guarded)
    return n / (time.perf_counter() - start)


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


def raw_runner(conn: asyncssh.SSHClientConnection) -> Callable[[], Awaitable[None]]:
    async def raw_run() -> None:
        while True:
            try:
                result = await conn.run(COMMAND, check=True)
                break
            except asyncssh.ChannelOpenError:  # past MaxSessions: the same retry we do
                await anyio.sleep(0.01)
        assert result.stdout == "hi\n"

    return raw_run


def executor_runner(executor: SSHExecutor, workdir: str) -> Callable[[], Awaitable[None]]:
    async def through_executor() -> None:
        observation = await executor.run_command(workdir, COMMAND, timeout=30)
        assert observation.success and observation.stdout.text == "hi\n", observation

    return through_executor


def writers(
    sftp: asyncssh.SFTPClient, executor: SSHExecutor, workdir: str
) -> list[Callable[[], Awaitable[None]]]:
    """A 1 KiB write by SFTP into a directory of its own, and one through the executor."""
    numbers = count()

    async def sftp_write() -> None:
        async with sftp.open(f"{workdir}/sftp/s{next(numbers)}", "wb") as handle:
            await handle.write(CONTENT.encode())

    async def executor_write() -> None:
        observation = await executor.write_artifact(workdir, f"ours/e{next(numbers)}", CONTENT)
        assert observation.success, observation.error

    return [sftp_write, executor_write]


async def main(target: SSHTarget, n: int, concurrency: int, rounds: int) -> None:
    ssh_argv = [
        "ssh",
        "-q",
        "-F",
        "/dev/null",
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
    sftp = await conn.start_sftp_client()
    async with SSHExecutor(target) as executor:
        workdir = await executor.prepare(None, {"sftp/.keep": ""})
        sandbox = executor.containment_of(workdir).sandbox
        commands = [client_process, raw_runner(conn), executor_runner(executor, workdir)]
        writes = writers(sftp, executor, workdir)
        await interleaved(20, concurrency, 2, commands[1:] + writes)  # warm up
        rows = []
        for label, c in (("sequential", 1), (f"{concurrency} in flight", concurrency)):
            rows.append((label, *await interleaved(n, c, rounds, commands + writes)))
        await executor.cleanup(workdir)
    sftp.exit()
    conn.close()
    await conn.wait_closed()

    print(f"{n} calls against {target.label} (executor sandbox: {sandbox}), per second:")
    print(
        f"{'':14} {'(a) ssh CLI':>12} {'(b) raw run':>12} {'(c) executor':>13} "
        f"{'c/a':>6} {'c/b':>6}   {'(d) SFTP':>10} {'(e) executor':>13} {'e/d':>5}"
    )
    for label, a, b, x, d, e in rows:
        print(
            f"{label:14} {a:12.1f} {b:12.1f} {x:13.1f} {x / a:6.2f} {x / b:6.2f}   "
            f"{d:10.1f} {e:13.1f} {e / d:5.2f}"
        )
    print(f"commands: {COMMAND!r}; writes: {len(CONTENT)} bytes each, a new file each")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--commands", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    add_target_options(parser)
    args = parser.parse_args()
    anyio.run(main, target_of(args), args.commands, args.concurrency, args.rounds)
