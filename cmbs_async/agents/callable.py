"""An adapter that makes any async callable an agent, for use from async agent code."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from .._closing import Closing
from ..protocol import Turn
from .base import AgentMessage

__all__ = ["CallableAgent"]

StepFunction = Callable[[Turn], Awaitable[AgentMessage | None]]


class CallableAgent(Closing):
    """Wraps ``async def step(turn) -> message | None``; works in ``async with`` like every
    agent (closing it closes nothing of the function's)."""

    def __init__(self, function: StepFunction) -> None:
        self._function = function

    async def next_step(self, turn: Turn) -> AgentMessage | None:
        return await self._function(turn)
