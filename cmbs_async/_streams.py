"""Memory-stream hops that skip anyio's scheduling round when none is needed.

anyio's ``send``/``receive`` always yield to the event loop first. Between the actors of
one scenario most hops find room or an item at once; taking it directly saves a round.
Each hop still checks for cancellation first, so once a run's deadline has fired no
actor takes one more item (and starts one more action) from a buffer. Public anyio API
only: ``send_nowait``/``receive_nowait`` and ``checkpoint_if_cancelled``.
"""

from __future__ import annotations

from typing import TypeVar

import anyio
from anyio.lowlevel import checkpoint_if_cancelled
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

__all__ = ["receive", "send"]

T = TypeVar("T")


async def send(stream: MemoryObjectSendStream[T], item: T) -> None:
    await checkpoint_if_cancelled()
    try:
        stream.send_nowait(item)
    except anyio.WouldBlock:
        await stream.send(item)


async def receive(stream: MemoryObjectReceiveStream[T]) -> T:
    """The next item; ``anyio.EndOfStream`` once the sender closed and nothing is left."""
    await checkpoint_if_cancelled()
    try:
        return stream.receive_nowait()
    except anyio.WouldBlock:
        return await stream.receive()
