"""The agent protocol: hand it a turn, get back one raw step (or nothing more to say)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, TypeAlias, runtime_checkable

from ..protocol import AgentStep, Turn

__all__ = ["Agent", "AgentMessage", "agent_label"]

#: What an agent may send: raw JSON text (sent to the gate verbatim, so it may be
#: invalid), a mapping, or a ready :class:`AgentStep`.
AgentMessage: TypeAlias = str | bytes | Mapping[str, Any] | AgentStep


@runtime_checkable
class Agent(Protocol):
    """Anything that proposes steps. ``None`` means it has nothing more to say."""

    async def next_step(self, turn: Turn) -> AgentMessage | None: ...


def agent_label(agent: object) -> str:
    """What the audit log and the viewer call an agent: its ``label`` attribute if it has
    one (``stdio:python agent.py``, ``openai:MODEL@URL``), else its class name."""
    label = getattr(agent, "label", None)
    if not isinstance(label, str) or not label:
        return type(agent).__name__
    # a path or command that is not UTF-8 (a byte the file system allows) is shown escaped
    return label.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
