"""The audit store protocol (seed 002's checkpoint store, plus every gate verdict and
observation) and what reading it back returns."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict

__all__ = ["AuditRecord", "AuditStore", "StepHistory"]

#: (kind, step, data) of one record to append
Entry = tuple[str, int | None, dict[str, Any]]


class AuditRecord(BaseModel):
    model_config = ConfigDict(frozen=True)

    session_id: str
    seq: int
    kind: str
    step: int | None
    ts: float
    data: dict[str, Any]


class StepHistory(BaseModel):
    """Everything recorded about one step of a session, in order."""

    model_config = ConfigDict(frozen=True)

    session_id: str
    step: int
    records: tuple[AuditRecord, ...]

    def of_kind(self, kind: str) -> list[AuditRecord]:
        return [r for r in self.records if r.kind == kind]


@runtime_checkable
class AuditStore(Protocol):
    """Append-only, signed, chained records per session. Calls are synchronous and
    thread-safe: the runtime makes them from one sink task through a worker thread."""

    def open_session(self, session_id: str, data: dict[str, Any]) -> None: ...

    def append(self, session_id: str, entries: Sequence[Entry]) -> None: ...

    def save_pre(self, session_id: str, step: int, commitment: dict[str, Any]) -> None: ...

    def save_post(self, session_id: str, step: int, assessment: dict[str, Any]) -> None: ...

    def save_supervision(self, session_id: str, step: int, record: dict[str, Any]) -> None: ...

    def step_history(self, session_id: str, step: int) -> StepHistory: ...

    def session_history(self, session_id: str) -> list[StepHistory]: ...
