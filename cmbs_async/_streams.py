"""Memory-stream hops without a scheduling round when none is needed.

anyio's ``send``/``receive`` always yield to the event loop first. Between the actors
of one scenario most hops find room or an item at once; taking it directly halves the
event-loop rounds per step. When the hop must wait, the full awaitable runs, so every
actor still yields (and meets cancellation) at least once per step.
"""

from __future__ import annotations

from typing import TypeVar

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

__all__ = ["receive", "send"]

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
