"""The audit store's contract: what a record is, the kinds there are, the calls the runtime
and replay make, and the error they raise."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from enum import StrEnum
from typing import Any, NamedTuple, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict

from .._errors import CmbsError

__all__ = [
    "AuditError",
    "AuditRecord",
    "AuditStore",
    "Entry",
    "HashChained",
    "RecordKind",
    "StepHistory",
]


class AuditError(CmbsError, RuntimeError):
    """The audit store cannot be opened, written or read; the message is one line."""


class RecordKind(StrEnum):
    """What a record is about. The values are what is stored (and signed)."""

    SESSION = "session"  # the first record: scenario, profile, review config, public key
    STEP = "step"  # the agent's message as it arrived, with the reconciler's flags
    SUPERVISION = "supervision"  # the review layer's ruling on a flagged step
    DECISION = "decision"  # the gate's verdict
    OBSERVATION = "observation"  # what the executor saw
    EVIDENCE = "evidence"  # an evaluation's provenance chain, as the gate judged it
    END = "end"  # how the run ended
    PRE = "pre"  # the seed's pre-checkpoint (commitment)
    POST = "post"  # the seed's post-checkpoint (self-assessment)


class Entry(NamedTuple):
    """One record to append: its kind, the step it belongs to (if any) and its data."""

    kind: RecordKind
    step: int | None
    data: dict[str, Any]


class AuditRecord(BaseModel):
    """One record as read back."""

    model_config = ConfigDict(frozen=True)

    session_id: str
    seq: int
    kind: RecordKind
    step: int | None
    ts: float
    data: dict[str, Any]


class StepHistory(BaseModel):
    """Everything recorded about one step of a session, in order."""

    model_config = ConfigDict(frozen=True)

    session_id: str
    step: int
    records: tuple[AuditRecord, ...]

    def of_kind(self, kind: RecordKind) -> list[AuditRecord]:
        return [r for r in self.records if r.kind == kind]


@runtime_checkable
class AuditStore(Protocol):
    """Append-only records per session: what the runtime writes and replay reads. Calls
    are synchronous and thread-safe: the runtime makes them from one sink task through a
    worker thread. Each raises :class:`AuditError` when the store cannot do it."""

    def open_session(self, session_id: str, data: dict[str, Any]) -> None:
        """Start ``session_id``; its first record (:attr:`RecordKind.SESSION`) holds ``data``."""

    def append(self, session_id: str, entries: Sequence[Entry]) -> None:
        """Append ``entries`` durably, all or none."""

    def records(self, session_id: str) -> Iterable[AuditRecord]:
        """The session's records in order."""


@runtime_checkable
class HashChained(Protocol):
    """A store that hash-chains each session's records and can say where a chain ends,
    so a run can point elsewhere (a trace, say) at the record a step ended on."""

    def head(self, session_id: str) -> str:
        """The hash of the session's last record, as committed."""
