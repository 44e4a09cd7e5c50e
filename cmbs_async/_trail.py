"""A run's audit trail as the supervisor sees it: one call per kind of record, each
returning once the record is durable. A run without an audit store gets a trail that
records nothing, so the supervisor never asks which one it has (and builds no record it
would throw away)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, Protocol

import anyio

from .agents.base import AgentMessage
from .audit.store import AuditError, AuditStore
from .audit.writer import AuditWriter, open_audit_writer
from .events import Events, logger
from .gate import Decision
from .profile import Profile
from .protocol import Containment, Observation
from .records import (
    decision_record,
    end_record,
    evidence_record,
    observation_record,
    session_data,
    step_record,
    supervision_record,
)
from .result import ScenarioResult
from .review.config import SupervisionConfig
from .review.layer import SupervisionRecord
from .review.reconcile import Flag
from .scenario import ScenarioSpec

__all__ = ["Trail", "open_trail"]


class Trail(Protocol):
    """Where the supervisor records a run. Each call raises :class:`AuditError` if its
    record cannot be made durable."""

    @property
    def stalled(self) -> bool:
        """A record was still not durable when its wait was cancelled (by the deadline)."""

    @property
    def head(self) -> str | None:
        """The hash of the last record made durable, when the trail was opened to follow
        it (``heads``); else ``None``, as without an audit store."""

    async def begin(self, containment: Containment | None) -> None:
        """Open the session: its first record says how the run's commands are contained."""

    async def step(self, number: int, message: AgentMessage, flags: tuple[Flag, ...]) -> None: ...

    async def supervision(self, number: int, supervision: SupervisionRecord) -> None: ...

    async def decision(self, decision: Decision) -> None: ...

    async def observation(self, number: int, observation: Observation) -> None: ...

    async def evidence(self, number: int, chain: dict[str, Any]) -> None:
        """An evaluation's provenance chain, as the gate judged it."""

    async def end(self, result: ScenarioResult, *, until: float) -> None:
        """Record how the run ended by ``until`` (shielded), or warn that it was not."""


@asynccontextmanager
async def open_trail(
    store: AuditStore | None,
    session_id: str,
    *,
    spec: ScenarioSpec,
    profile: Profile,
    review: SupervisionConfig | None,
    agent: str | None = None,
    heads: bool = False,
) -> AsyncIterator[Trail]:
    """The trail of session ``session_id`` in ``store``; one that records nothing without.
    ``heads``: its :attr:`Trail.head` follows the records (a trace points at them)."""
    if store is None:
        yield _Unaudited()
        return
    async with open_audit_writer(
        store, session_id, session_data(spec, profile, review, agent=agent), heads=heads
    ) as writer:
        yield _Audited(writer)


class _Unaudited:
    stalled = False
    head = None

    async def begin(self, containment: Containment | None) -> None:
        pass

    async def step(self, number: int, message: AgentMessage, flags: tuple[Flag, ...]) -> None:
        pass

    async def supervision(self, number: int, supervision: SupervisionRecord) -> None:
        pass

    async def decision(self, decision: Decision) -> None:
        pass

    async def observation(self, number: int, observation: Observation) -> None:
        pass

    async def evidence(self, number: int, chain: dict[str, Any]) -> None:
        pass

    async def end(self, result: ScenarioResult, *, until: float) -> None:
        pass


class _Audited:
    def __init__(self, writer: AuditWriter) -> None:
        self._writer = writer

    @property
    def stalled(self) -> bool:
        return self._writer.stalled

    @property
    def head(self) -> str | None:
        return self._writer.head

    async def begin(self, containment: Containment | None) -> None:
        dumped = containment.model_dump(mode="json") if containment is not None else None
        await self._writer.begin(containment=dumped)

    async def step(self, number: int, message: AgentMessage, flags: tuple[Flag, ...]) -> None:
        await self._writer.write(step_record(number, message, flags))

    async def supervision(self, number: int, supervision: SupervisionRecord) -> None:
        await self._writer.write(supervision_record(number, supervision))

    async def decision(self, decision: Decision) -> None:
        await self._writer.write(decision_record(decision))

    async def observation(self, number: int, observation: Observation) -> None:
        await self._writer.write(observation_record(number, observation))

    async def evidence(self, number: int, chain: dict[str, Any]) -> None:
        await self._writer.write(evidence_record(number, chain))

    async def end(self, result: ScenarioResult, *, until: float) -> None:
        reason = "not durable in time: the audit database is locked or slow"
        with anyio.move_on_at(until, shield=True):
            try:
                await self._writer.write(end_record(result))
                return
            except AuditError as exc:
                reason = str(exc)
        logger.warning(Events.AUDIT_END_NOT_RECORDED, reason=reason)
