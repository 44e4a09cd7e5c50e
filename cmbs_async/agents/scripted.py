"""An agent that replays a fixed list of raw messages, regardless of the responses."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from .._closing import Closing
from ..protocol import Turn
from .base import AgentMessage

__all__ = ["ScriptedAgent"]


class ScriptedAgent(Closing):
    """Sends its messages in order, then says nothing more.

    From a JSONL file, each non-blank line is one message, sent verbatim: a line that is
    not valid JSON reaches the gate as it is, which is how malformed agents are tested.
    It holds nothing to close, but works in ``async with`` like every agent.
    """

    def __init__(self, messages: Iterable[AgentMessage]) -> None:
        self._messages = list(messages)
        self._next = 0

    @classmethod
    def from_jsonl(cls, path: str | Path) -> ScriptedAgent:
        """Load a script; ``OSError`` / ``UnicodeDecodeError`` if it cannot be read."""
        text = Path(path).read_text("utf-8")
        return cls(line for line in text.splitlines() if line.strip())

    @property
    def messages(self) -> tuple[AgentMessage, ...]:
        return tuple(self._messages)

    def __len__(self) -> int:
        return len(self._messages)

    async def next_step(self, turn: Turn) -> AgentMessage | None:
        if self._next >= len(self._messages):
            return None
        message = self._messages[self._next]
        self._next += 1
        return message
