"""SIGINT, SIGTERM and SIGHUP stop a command alike: they cancel its work through its cancel
scope, so executors kill what runs (in their shielded cleanup) and runs record their end,
and the command then exits with 128 + the signal's number (130, 143, 129)."""

from __future__ import annotations

import signal
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

import anyio
from anyio.abc import TaskStatus

__all__ = ["Interrupted", "cancel_on_signals", "interrupting"]

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

T = TypeVar("T")


class Interrupted(Exception):
    """The work was cancelled by a signal, and has wound down."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_status(self) -> int:
        return 128 + self.signum


async def cancel_on_signals(work: Callable[[], Awaitable[T]]) -> T:
    """Await ``work()``; the first of :data:`SIGNALS` cancels it, and once it has wound
    down :class:`Interrupted` is raised. Signals that follow are ignored while it winds
    down (its cleanup is bounded); the usual handlers are back once this returns."""
    scope = anyio.CancelScope()
    caught: list[int] = []
    failure: Exception | None = None
    async with anyio.create_task_group() as tg:
        await tg.start(_watch, scope, caught)
        try:
            with scope:
                result = await work()
        except Exception as exc:  # raised below as it is, not in an exception group
            failure = exc
        tg.cancel_scope.cancel()
    if failure is not None:
        raise failure
    if caught:
        raise Interrupted(caught[0])
    return result


async def _watch(
    scope: anyio.CancelScope, caught: list[int], *, task_status: TaskStatus[None]
) -> None:
    with anyio.open_signal_receiver(*SIGNALS) as signals:
        task_status.started()
        async for signum in signals:
            if not caught:
                caught.append(signum)
                scope.cancel()


@contextmanager
def interrupting(caught: list[int]) -> Iterator[None]:
    """For work that is no event loop of ours (a Ray batch's driver): the first of
    :data:`SIGNALS` raises :class:`KeyboardInterrupt` in it, as Ctrl-C does, its number
    appended to ``caught``; later ones are ignored while it winds down. The usual
    handlers are back once the block ends."""

    def stop(signum: int, frame: object) -> None:
        if not caught:
            caught.append(signum)
            raise KeyboardInterrupt

    before = {signum: signal.signal(signum, stop) for signum in SIGNALS}
    try:
        yield
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)
