"""An agent that is any program, in any language: turns go to its stdin as JSON lines,
steps come back on its stdout, one line each."""

from __future__ import annotations

import os
import signal
import tempfile
from collections.abc import Sequence
from typing import IO

import anyio
from anyio.abc import Process

from ..protocol import Turn
from .base import AgentMessage

__all__ = ["AgentProcessError", "StdioAgent"]

_STDERR_TAIL = 2000


class AgentProcessError(RuntimeError):
    """The agent program crashed, hung or closed its output; the message says which."""


class StdioAgent:
    """Starts ``command`` (through the shell when it is a string) on first use.

    Each turn is written as one JSON line; the next line the program prints is its step,
    passed on verbatim. An empty line or end of output means it has nothing more to say.
    A program that exits with an error, or gives no line within ``step_timeout``
    seconds, raises :class:`AgentProcessError` with the tail of its stderr (the run ends
    ``agent_error``). Use as an async context manager, or call :meth:`aclose`.
    """

    def __init__(
        self,
        command: str | Sequence[str],
        *,
        step_timeout: float = 60.0,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.command = command
        self.step_timeout = step_timeout
        self.cwd = cwd
        self.env = env
        self._process: Process | None = None
        self._buffer = b""
        self._stderr: IO[bytes] | None = None

    async def next_step(self, turn: Turn) -> AgentMessage | None:
        process = await self._started()
        assert process.stdin is not None
        try:
            await process.stdin.send(turn.model_dump_json().encode() + b"\n")
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            await self._failed("closed its input")
        line = await self._read_line(process)
        if line is None:
            await self._wait_briefly(process)
            if process.returncode not in (0, None):
                await self._failed(f"exited with status {process.returncode}")
            return None
        text = line.decode("utf-8", "replace").strip()
        return text or None

    async def _read_line(self, process: Process) -> bytes | None:
        assert process.stdout is not None
        with anyio.move_on_after(self.step_timeout) as scope:
            while b"\n" not in self._buffer:
                try:
                    chunk = await process.stdout.receive()
                except anyio.EndOfStream:
                    rest, self._buffer = self._buffer, b""
                    return rest or None
                self._buffer += chunk
        if scope.cancelled_caught:
            await self._failed(f"gave no step within {self.step_timeout:g} s")
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line

    async def _started(self) -> Process:
        if self._process is None:
            # stderr goes to a file, not a pipe: a chatty program can never block on it
            self._stderr = tempfile.TemporaryFile()
            self._process = await anyio.open_process(
                self.command,
                cwd=self.cwd,
                env=self.env,
                start_new_session=True,
                stderr=self._stderr,
            )
        return self._process

    async def _wait_briefly(self, process: Process) -> None:
        with anyio.move_on_after(2):
            await process.wait()

    async def _failed(self, what: str) -> None:
        tail = await self._stderr_tail()
        await self.aclose()
        raise AgentProcessError(f"agent program {what}" + (f"; stderr: {tail}" if tail else ""))

    async def _stderr_tail(self) -> str:
        if self._stderr is None:
            return ""
        handle = self._stderr
        handle.seek(0, os.SEEK_END)
        handle.seek(max(handle.tell() - _STDERR_TAIL, 0))
        return " ".join(handle.read().decode("utf-8", "replace").split())

    async def aclose(self) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        with anyio.CancelScope(shield=True):
            if process.returncode is None:
                try:
                    os.killpg(process.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
                with anyio.move_on_after(1):
                    await process.wait()
                if process.returncode is None:
                    process.kill()
            await process.aclose()
        if self._stderr is not None:
            self._stderr.close()
            self._stderr = None

    async def __aenter__(self) -> StdioAgent:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()
