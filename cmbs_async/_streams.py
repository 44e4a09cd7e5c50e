"""Memory-stream hops without a scheduling round when none is needed.

anyio's ``send``/``receive`` always yield to the event loop first. Between the actors
of one scenario most hops find room or an item at once; taking it directly halves the
event-loop rounds per step. When the hop must wait, the full awaitable runs, so every
actor still yields (and meets cancellation) at least once per step.

An actor that has just sent a request and now waits for what comes back uses
:func:`wait_next`: the answer cannot be there yet, so the round anyio's ``receive``
yields before it starts waiting only costs a pointless wake-up of a task whose memory
has gone cold, which is what dominates when thousands of scenarios interleave.
"""

from __future__ import annotations

from typing import Any, TypeVar

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

try:  # anyio's private waiting-receiver record; see wait_next
    from anyio.streams.memory import _MemoryObjectItemReceiver as _ItemReceiver
except ImportError:  # pragma: no cover - a future anyio; wait_next falls back
    _ItemReceiver = None  # type: ignore[assignment,misc]

__all__ = ["receive", "send", "wait_next"]

T = TypeVar("T")


async def send(stream: MemoryObjectSendStream[T], item: T) -> None:
    try:
        stream.send_nowait(item)
    except anyio.WouldBlock:
        await stream.send(item)


async def receive(stream: MemoryObjectReceiveStream[T]) -> T:
    """The next item; ``anyio.EndOfStream`` once the sender closed and nothing is left."""
    try:
        return stream.receive_nowait()
    except anyio.WouldBlock:
        return await stream.receive()


async def wait_next(stream: MemoryObjectReceiveStream[T]) -> T:
    """Like :func:`receive`, but wait at once when nothing is there.

    Registers as a waiting receiver exactly as anyio's ``receive`` does after its
    checkpoint (anyio 4.14 to 4.16 share that record), so senders hand the item over
    directly and closing the sending end still ends the wait with ``EndOfStream``.
    Waiting is itself a checkpoint: cancellation is met as before.
    """
    try:
        return stream.receive_nowait()
    except anyio.WouldBlock:
        pass
    waiting: Any = getattr(stream._state, "waiting_receivers", None)
    if _ItemReceiver is None or waiting is None:  # pragma: no cover
        return await stream.receive()
    event = anyio.Event()
    receiver: _ItemReceiver[T] = _ItemReceiver()
    waiting[event] = receiver
    try:
        await event.wait()
    finally:
        waiting.pop(event, None)
    try:
        return receiver.item
    except AttributeError:
        raise anyio.EndOfStream from None
