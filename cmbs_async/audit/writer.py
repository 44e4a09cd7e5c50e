"""The audit sink: one task that writes records through a worker thread, so the event
loop never blocks on disk, and acknowledges each batch once it is durable."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from .sqlite import AuditError
from .store import AuditStore, Entry

__all__ = ["AuditWriter", "open_audit_writer"]


@dataclass
class _Batch:
    entries: list[Entry]
    done: anyio.Event = field(default_factory=anyio.Event)
    error: BaseException | None = None


class AuditWriter:
    """Hands batches to the sink task and waits until they are on disk."""

    def __init__(self, session_id: str, send: MemoryObjectSendStream[_Batch]) -> None:
        self.session_id = session_id
        self._send = send

    async def write(self, *entries: Entry) -> None:
        """Return once ``entries`` are durable; :class:`AuditError` if they cannot be."""
        batch = _Batch(list(entries))
        await self._send.send(batch)
        await batch.done.wait()
        if batch.error is not None:
            raise AuditError(str(batch.error)) from batch.error


@asynccontextmanager
async def open_audit_writer(
    store: AuditStore, session_id: str, session_data: dict[str, Any]
) -> AsyncIterator[AuditWriter]:
    """Open a session in ``store`` and run its sink task for the ``async with`` body."""
    await anyio.to_thread.run_sync(store.open_session, session_id, session_data)
    send, receive = anyio.create_memory_object_stream[_Batch](16)
    async with anyio.create_task_group() as tg:
        tg.start_soon(_sink, store, session_id, receive)
        async with send:
            yield AuditWriter(session_id, send)


async def _sink(
    store: AuditStore, session_id: str, batches: MemoryObjectReceiveStream[_Batch]
) -> None:
    async with batches:
        async for batch in batches:
            try:
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(store.append, session_id, batch.entries)
            except Exception as exc:
                batch.error = exc
            finally:
                batch.done.set()
