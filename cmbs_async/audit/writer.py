"""The audit sink: one task that writes records through a worker thread, so the event
loop never blocks on disk, and acknowledges each batch once it is durable.

The sink opens the session with the first batch written, so opening waits where every
record waits: inside the run's deadline; :meth:`AuditWriter.begin` adds to the session's
first record what is only known once the run has begun (how its commands are contained).
Nothing waits on the store longer than its caller does. A
write whose caller stopped waiting (a deadline passed on a locked or slow database) is
abandoned, not cancelled: its worker thread finishes a transaction that lands whole or
not at all, and leaving the writer stops the sink at once instead of waiting for it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from .store import AuditError, AuditStore, Entry, HashChained

__all__ = ["AuditWriter", "open_audit_writer"]


@dataclass
class _Batch:
    entries: list[Entry]
    session: dict[str, Any] = field(default_factory=dict)  # for the first record, if first
    done: anyio.Event = field(default_factory=anyio.Event)
    error: BaseException | None = None
    head: str | None = None  # the hash of the session's last record once durable, if known


class AuditWriter:
    """Hands batches to the sink task and waits until they are on disk."""

    def __init__(self, session_id: str, send: MemoryObjectSendStream[_Batch]) -> None:
        self.session_id = session_id
        self._send = send
        #: a write was cancelled before its records were durable
        self.stalled = False
        #: the hash of the last record made durable, where the store chains them
        #: (:class:`~cmbs_async.audit.store.HashChained`)
        self.head: str | None = None

    async def begin(self, **session: Any) -> None:
        """Open the session, with ``session`` added to its first record; return once it is
        durable. Without it, the first :meth:`write` opens the session as it is."""
        await self._write(_Batch([], session))

    async def write(self, *entries: Entry) -> None:
        """Return once ``entries`` are durable; :class:`AuditError` if they cannot be.

        Cancelling the caller ends the wait, not the write; :attr:`stalled` then says so.
        """
        await self._write(_Batch(list(entries)))

    async def _write(self, batch: _Batch) -> None:
        try:
            await self._send.send(batch)
            await batch.done.wait()
        except anyio.get_cancelled_exc_class():
            self.stalled = self.stalled or not batch.done.is_set()
            raise
        if batch.error is not None:
            raise AuditError(str(batch.error)) from batch.error
        self.head = batch.head or self.head


@asynccontextmanager
async def open_audit_writer(
    store: AuditStore, session_id: str, session_data: dict[str, Any], *, heads: bool = False
) -> AsyncIterator[AuditWriter]:
    """Run a sink that opens ``session_id`` in ``store``, for the ``async with`` body.

    If the session cannot be opened, every write fails with the reason. With ``heads``
    (a trace points at the records), :attr:`AuditWriter.head` follows each durable write;
    without, nothing is read back.
    """
    send, receive = anyio.create_memory_object_stream[_Batch](16)
    scopes: list[anyio.CancelScope] = []  # the sink's, once it runs
    async with anyio.create_task_group() as tg:
        # start_soon, not start: a start() cancelled half-way would wait for the sink,
        # which would wait for batches that never come
        tg.start_soon(_sink, store, session_id, session_data, receive, scopes, heads)
        try:
            async with send:
                yield AuditWriter(session_id, send)
        finally:
            for scope in scopes:
                scope.cancel()  # every write has been acknowledged or given up by now


async def _sink(
    store: AuditStore,
    session_id: str,
    session_data: dict[str, Any],
    batches: MemoryObjectReceiveStream[_Batch],
    scopes: list[anyio.CancelScope],
    heads: bool,
) -> None:
    # Shielded so that a run cancelled from outside can still record its end; the writer's
    # owner cancels this scope when the run is over (or, if it never started, closes the
    # stream of batches, which ends it).
    with anyio.CancelScope(shield=True) as scope:
        scopes.append(scope)
        async with batches:
            refused: Exception | None = None
            opened = False
            async for batch in batches:
                if not opened:
                    data = session_data | batch.session
                    refused = await _durably(_open, store, session_id, data, batch, heads)
                    opened = True
                if batch.entries:
                    batch.error = refused or await _durably(
                        _append, store, session_id, batch, heads
                    )
                else:
                    batch.error = refused
                batch.done.set()


def _open(
    store: AuditStore, session_id: str, data: dict[str, Any], batch: _Batch, heads: bool
) -> None:
    store.open_session(session_id, data)
    if heads:
        _note_head(store, session_id, batch)


def _append(store: AuditStore, session_id: str, batch: _Batch, heads: bool) -> None:
    store.append(session_id, batch.entries)
    if heads:
        _note_head(store, session_id, batch)


def _note_head(store: AuditStore, session_id: str, batch: _Batch) -> None:
    """Keep the hash the session's chain now ends on (in the worker thread, like the write:
    the store's lock may be held by another session's transaction)."""
    if isinstance(store, HashChained):
        batch.head = store.head(session_id)


async def _durably(call: Callable[..., None], *args: Any) -> Exception | None:
    """Run one store call in a worker thread; its error, if any. Cancelling abandons it."""
    try:
        await anyio.to_thread.run_sync(call, *args, abandon_on_cancel=True)
    except Exception as exc:
        return exc
    return None
