"""Human escalation for PAUSE (seed 003): proceed, abort, or modify with a correction."""

from __future__ import annotations

import json
import os
import stat
import sys
from collections.abc import Awaitable, Callable
from typing import Any, Literal, Protocol, TextIO, runtime_checkable

import anyio
from pydantic import BaseModel, ConfigDict, Field

from .._text import escape_controls

__all__ = ["CallbackHuman", "ConsoleHuman", "HumanChannel", "HumanDecision", "HumanRequest"]


class HumanRequest(BaseModel):
    model_config = ConfigDict(frozen=True)

    scenario_id: str
    step: int
    reasoning: str
    options: tuple[str, ...] = ("proceed", "abort", "modify")
    #: the step the question is about: the action it proposes, and its payload
    action: str | None = None
    payload: dict[str, Any] = Field(default_factory=dict)


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


#: the most of the reviewer's reasoning, and of the step's payload, a question shows
_REASONING_SHOWN = 2000
_PAYLOAD_SHOWN = 500
#: the most of one answer kept (the rest of a longer line is read and dropped)
_ANSWER_BYTES = 4096


class ConsoleHuman:
    """Asks on a terminal: ``p`` proceed, ``a`` abort, ``m`` modify (then the correction).

    The question shows the step it is about and the reviewer's reasoning, every string in
    it with its control characters escaped (a reviewer quoting the agent cannot clear the
    screen or forge a line). Answers are read from the file descriptor as they come, on
    the event loop: the deadline or a signal interrupts a question half answered (a line
    with no newline yet), and no thread is left holding the terminal.
    """

    def __init__(self, stdin: TextIO | None = None, stderr: TextIO | None = None) -> None:
        self._in = stdin or sys.stdin
        self._err = stderr or sys.stderr
        self._buffer = bytearray()  # what was read past the last answer
        self._ended = False  # the input is at its end

    async def decide(self, request: HumanRequest) -> HumanDecision:
        lines = [f"\n[cmbs] scenario {escape_controls(request.scenario_id)}, "]
        lines[0] += f"step {request.step}: review paused."
        if request.action is not None:
            payload = json.dumps(request.payload, ensure_ascii=False, default=str)
            lines.append(
                f"[cmbs] the step: {escape_controls(request.action)} "
                f"{escape_controls(_cut(payload, _PAYLOAD_SHOWN))}"
            )
        reasoning = escape_controls(_cut(request.reasoning, _REASONING_SHOWN))
        lines.append(f"[cmbs] the reviewer: {reasoning}")
        self._say("\n".join(lines) + "\n")
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
        """The next line (``""`` at the end of the input), its first 4 KiB.

        Read with one ``os.read`` each time the descriptor is readable, which returns what
        is there without waiting for a newline: the wait in between is the only place it
        blocks, and the deadline or a signal cancels it. No thread is left reading."""
        try:
            fd = self._in.fileno()
        except (OSError, ValueError):  # in memory (a StringIO): reading never blocks
            return self._in.readline()[:_ANSWER_BYTES]
        polled = not stat.S_ISREG(os.fstat(fd).st_mode)  # a file never blocks (nor polls)
        while (end := self._buffer.find(b"\n")) < 0 and not self._ended:
            if polled:
                try:
                    await anyio.wait_readable(fd)
                except PermissionError:  # /dev/null, say: cannot be polled, never blocks
                    polled = False
            try:
                chunk = os.read(fd, 65536)
            except BlockingIOError:  # another reader took it first
                continue
            self._ended = not chunk
            self._buffer += chunk
            if b"\n" not in self._buffer:  # a long line: its head is kept, the rest dropped
                del self._buffer[_ANSWER_BYTES:]
        if end < 0:
            line, self._buffer = bytes(self._buffer), bytearray()
        else:
            line = bytes(self._buffer[:end])
            del self._buffer[: end + 1]
        return line[:_ANSWER_BYTES].decode("utf-8", "replace")


def _cut(text: str, limit: int) -> str:
    """``text``, or its first ``limit`` characters and how many more there were."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text) - limit} more characters)"
