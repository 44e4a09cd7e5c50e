"""An audit store in memory: a run's records kept where it ran, to be handed whole to a
store that signs them (a batch's Ray worker hands them to its driver)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

from .store import AuditError, AuditRecord, Entry, RecordKind

__all__ = ["MemoryAuditStore"]


class MemoryAuditStore:
    """An :class:`~cmbs_async.audit.AuditStore` that keeps records in memory, unsigned and
    unchained: what a run recorded, in order, until :meth:`entries` hands it on."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sessions: dict[str, list[AuditRecord]] = {}

    def open_session(self, session_id: str, data: dict[str, Any]) -> None:
        with self._lock:
            if session_id in self._sessions:
                raise AuditError(f"session {session_id} is already open")
            self._sessions[session_id] = []
            self._add(session_id, [Entry(RecordKind.SESSION, None, data)])

    def append(self, session_id: str, entries: Sequence[Entry]) -> None:
        with self._lock:
            if session_id not in self._sessions:
                raise AuditError(f"no session {session_id}")
            self._add(session_id, entries)

    def records(self, session_id: str) -> Iterator[AuditRecord]:
        with self._lock:
            return iter(list(self._sessions.get(session_id, ())))

    def entries(self, session_id: str) -> list[Entry]:
        """The session's records as entries to append elsewhere, the first its session
        record; none if the session was never opened."""
        return [Entry(r.kind, r.step, r.data) for r in self.records(session_id)]

    @classmethod
    def holding(cls, session_id: str, entries: Sequence[Entry]) -> MemoryAuditStore:
        """A store holding ``entries`` (the first a session record) as ``session_id``."""
        store = cls()
        if entries:
            store.open_session(session_id, entries[0].data)
            store.append(session_id, entries[1:])
        return store

    def _add(self, session_id: str, entries: Sequence[Entry]) -> None:
        records = self._sessions[session_id]
        for kind, step, data in entries:
            records.append(
                AuditRecord(
                    session_id=session_id,
                    seq=len(records),
                    kind=RecordKind(kind),
                    step=step,
                    ts=time.time(),
                    data=data,
                )
            )
