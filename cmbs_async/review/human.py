"""Human escalation for PAUSE (seed 003): proceed, abort, or modify with a correction."""

from __future__ import annotations

import os
import stat
import sys
from collections.abc import Awaitable, Callable
from typing import Literal, Protocol, TextIO, runtime_checkable

import anyio
from pydantic import BaseModel, ConfigDict

__all__ = ["CallbackHuman", "ConsoleHuman", "HumanChannel", "HumanDecision", "HumanRequest"]


class HumanRequest(BaseModel):
    model_config = ConfigDict(frozen=True)

    scenario_id: str
    step: int
    reasoning: str
    options: tuple[str, ...] = ("proceed", "abort", "modify")


class HumanDecision(BaseModel):
    model_config = ConfigDict(frozen=True)

    decision: Literal["proceed", "abort", "modify"]
    correction: str = ""


@runtime_checkable
class HumanChannel(Protocol):
    """Asked when a review pauses. Waiting is bounded by the scenario's deadline."""

    async def decide(self, request: HumanRequest) -> HumanDecision: ...


class CallbackHuman:
    """Wraps ``async def decide(request) -> HumanDecision`` for library users."""

    def __init__(self, function: Callable[[HumanRequest], Awaitable[HumanDecision]]) -> None:
        self._function = function

    async def decide(self, request: HumanRequest) -> HumanDecision:
        return await self._function(request)


class ConsoleHuman:
    """Asks on a terminal: ``p`` proceed, ``a`` abort, ``m`` modify (then the correction)."""

    def __init__(self, stdin: TextIO | None = None, stderr: TextIO | None = None) -> None:
        self._in = stdin or sys.stdin
        self._err = stderr or sys.stderr

    async def decide(self, request: HumanRequest) -> HumanDecision:
        self._say(
            f"\n[cmbs] scenario {request.scenario_id}, step {request.step}: review paused.\n"
            f"[cmbs] {request.reasoning}\n"
        )
        while True:
            answer = (await self._ask("[cmbs] proceed, abort or modify? [p/a/m] ")).lower()
            if answer in ("p", "proceed"):
                return HumanDecision(decision="proceed")
            if answer in ("a", "abort", ""):
                return HumanDecision(decision="abort")
            if answer in ("m", "modify"):
                correction = await self._ask("[cmbs] correction for the agent: ")
                return HumanDecision(decision="modify", correction=correction)

    def _say(self, text: str) -> None:
        self._err.write(text)
        self._err.flush()

    async def _ask(self, prompt: str) -> str:
        self._say(prompt)
        return (await self._line()).strip()

    async def _line(self) -> str:
        """The next line, awaited on the event loop: no thread is left blocked in a read
        when the deadline cancels the question, so the program can exit."""
        try:
            fd = self._in.fileno()
        except (OSError, ValueError):  # in memory (a StringIO): reading never blocks
            return self._in.readline()
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # a file never blocks (nor can be polled)
            await anyio.wait_readable(fd)
        return self._in.readline()
