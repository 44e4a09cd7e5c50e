"""The agent protocol: hand it a turn, get back one raw step (or nothing more to say)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, TypeAlias, runtime_checkable

from ..protocol import AgentStep, Turn

__all__ = ["Agent", "AgentMessage"]

#: What an agent may send: raw JSON text (sent to the gate verbatim, so it may be
#: invalid), a mapping, or a ready :class:`AgentStep`.
AgentMessage: TypeAlias = str | bytes | Mapping[str, Any] | AgentStep


@runtime_checkable
class Agent(Protocol):
    """Anything that proposes steps. ``None`` means it has nothing more to say."""

    async def next_step(self, turn: Turn) -> AgentMessage | None: ...
