"""Reading a command's output pipes: all it wrote, however late the reader runs.

A command that has ended may have left a process holding its pipes open, so reading
stops a grace after its end. The grace is wall-clock time, and on a busy machine the
reader may not run at all within it: what the pipes already hold is then read without
waiting, so a late reader loses nothing the command wrote before it ended.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable, Sequence

import anyio

from .base import OutputBuffer

__all__ = ["read_held", "read_pipes"]

_CHUNK = 1 << 16
#: The most read without waiting from one pipe: a full pipe of the largest size Linux
#: gives by default (``/proc/sys/fs/pipe-max-size``), never a writer that keeps writing.
_HELD_AT_MOST = 1 << 20


async def read_pipes(
    pipes: Sequence[tuple[int, OutputBuffer]],
    ended: Callable[[], Awaitable[bool]],
    *,
    grace: float,
) -> None:
    """Read each pipe (a non-blocking descriptor) into its buffer while ``ended()`` runs.

    If it returns true, reading goes on for ``grace`` seconds at most until every pipe is
    closed; then whatever they already hold is taken (also when cancelled).
    """
    left = len(pipes)
    closed = anyio.Event()

    async def drain(fd: int, into: OutputBuffer) -> None:
        nonlocal left
        while True:
            await anyio.wait_readable(fd)
            if read_held(fd, into):
                break
        left -= 1
        if not left:
            closed.set()

    try:
        async with anyio.create_task_group() as tg:
            for fd, into in pipes:
                tg.start_soon(drain, fd, into)
            if await ended():
                with anyio.move_on_after(grace):
                    await closed.wait()
            tg.cancel_scope.cancel()
    finally:
        for fd, into in pipes:
            read_held(fd, into)


def read_held(fd: int, into: OutputBuffer) -> bool:
    """Feed ``into`` what the non-blocking pipe ``fd`` holds now, without waiting; true
    once its end of file is read."""
    taken = 0
    while taken < _HELD_AT_MOST:
        try:
            chunk = os.read(fd, _CHUNK)
        except BlockingIOError:
            return False
        if not chunk:
            return True
        into.feed(chunk)
        taken += len(chunk)
    return False
