"""An agent that replays a fixed list of raw messages, regardless of the responses."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from .._closing import Closing
from .._reading import read_text
from ..protocol import Turn
from .base import AgentMessage

__all__ = ["STEPS_MAX_BYTES", "ScriptedAgent"]

#: The largest steps file read (each step is bounded again when the run takes it).
STEPS_MAX_BYTES = 64 * 1024 * 1024


class ScriptedAgent(Closing):
    """Sends its messages in order, then says nothing more.

    From a JSONL file, each non-blank line is one message, sent verbatim: a line that is
    not valid JSON reaches the gate as it is, which is how malformed agents are tested.
    It holds nothing to close, but works in ``async with`` like every agent.
    """

    def __init__(self, messages: Iterable[AgentMessage], *, label: str = "script") -> None:
        self._messages = list(messages)
        self.label = label
        self._next = 0

    @classmethod
    def from_jsonl(cls, path: str | Path, *, max_bytes: int = STEPS_MAX_BYTES) -> ScriptedAgent:
        """Load a script of at most ``max_bytes``; :class:`~cmbs_async.ReadError` (one
        line naming the file: unreadable, too large, not UTF-8) if it cannot be."""
        text = read_text(path, what="a steps file", max_bytes=max_bytes)
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
