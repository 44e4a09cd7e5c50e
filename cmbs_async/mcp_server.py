"""``cmbs mcp``: a scenario's actions as MCP tools, every call supervised (extra ``[mcp]``).

Built on the official MCP Python SDK (2.x, anyio-based; imported only when a server is
built, so that the package works without it). Each action of the scenario's
profile is one tool whose input schema is the action's payload model. Every call goes
through a :class:`~cmbs_async.session.Session`: a refused call is an error result that
carries the gate's neutral message; an allowed command or artifact runs and its
observation comes back as the result; the scenario's deadline bounds the session, and the
audit trail records it like any run. Tool-calling clients send no belief, so the
session's belief policy applies (see :mod:`cmbs_async.session`).

The server ends with its session or its client, whatever the pipes do: the SDK's stdio
transport reads and writes in threads that nothing interrupts, so it is given pipes of
the process's own, relayed to the real stdin and stdout without ever blocking.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import stat
from collections.abc import Awaitable, Callable
from contextlib import ExitStack
from types import TracebackType
from typing import TYPE_CHECKING

import anyio
import anyio.lowlevel
from anyio.abc import TaskStatus

from ._reading import size_text
from .adapters import action_tools, answer
from .protocol import Verdict
from .session import Session, StepReply

if TYPE_CHECKING:
    from mcp.server.mcpserver import MCPServer

__all__ = ["build_server", "serve_stdio"]

#: how long calls still get an answer after the session's end (or the client's closing
#: stdin) before the server stops, and how long what it still owes may take after that
_AFTER_END = 1.0
_CHUNK = 65536
#: how far the server's output may run ahead of a client slow to read it, while it serves
_BACKLOG = 1 << 20
#: the longest message (one JSON-RPC line) the client may send: a longer one never
#: reaches the server, and the client is answered with an error for its id. (A step
#: within it is bounded again, as every agent's step is: see :mod:`._bounds`.)
MESSAGE_MAX_BYTES = 16 << 20
_ID = re.compile(rb'"id"\s*:\s*("(?:[^"\\]|\\.)*"|-?\d+)')


def build_server(session: Session) -> MCPServer:
    """An MCP server whose tools are ``session``'s actions."""
    from mcp.server.mcpserver import MCPServer  # the [mcp] extra: imported when served

    server = MCPServer(
        name="cmbs",
        instructions=session.goal,
        warn_on_duplicate_tools=False,
    )
    for tool in action_tools(session, _answer):
        server.add_tool(tool.function, name=tool.name, description=tool.description)
    return server


async def serve_stdio(session: Session) -> None:
    """Serve ``session`` over fds 0 and 1 until, shortly after, the session has ended
    (terminated, deadline, step budget) or the client has left (closed stdin), or until
    the client closes stdout. Calls still running then are cancelled; answers still owed
    get at most :data:`_AFTER_END`, whether the client reads them or not."""
    server = build_server(session)
    with _Relay() as relay:
        async with anyio.create_task_group() as outer:
            await outer.start(relay.send_out)
            try:
                async with anyio.create_task_group() as group:

                    async def stop_after_the_end() -> None:
                        await session.wait()
                        await anyio.sleep(_AFTER_END)  # the last answers reach the client
                        group.cancel_scope.cancel()

                    async def stop_when_the_client_leaves() -> None:
                        await relay.left.wait()
                        if not relay.stdout_closed:  # what it asked before is answered
                            await anyio.sleep(_AFTER_END)
                        group.cancel_scope.cancel()

                    group.start_soon(relay.take_in)
                    group.start_soon(stop_after_the_end)
                    group.start_soon(stop_when_the_client_leaves)
                    await server.run_stdio_async()
                    group.cancel_scope.cancel()
            finally:
                relay.stop()


class _Relay:
    """Stdin and stdout moved aside for pipes of the server's own, which fds 0 and 1 are
    while it serves; :meth:`take_in` and :meth:`send_out` copy between them and never
    block on the client. :attr:`left` is set once the client has closed stdin or stdout;
    what the server writes after stdout is closed goes nowhere."""

    def __init__(self) -> None:
        self.left = anyio.Event()
        self.stdout_closed = False
        self._stopping = False  # the server is stopping: its output is read, come what may
        self._stopped = False  # the server has stopped: what is pending is the rest
        self._pending = bytearray()  # read from the server, not yet taken by the client
        self._flushing = anyio.CancelScope()  # given a deadline once the server has stopped
        self._waiting = anyio.CancelScope()
        self._line = bytearray()  # the client's message being read, not yet passed on
        self._skipping = False  # the rest of a message over the cap: dropped
        self._refusals: list[bytes] = []  # answers of the relay's own, owed to the client
        self._at_boundary = True  # what the server wrote so far ends with a whole message

    def __enter__(self) -> _Relay:
        with ExitStack() as stack:
            self._client_in, self._pollable_in = _private_copy(0, stack)
            self._client_out, self._pollable_out = _private_copy(1, stack)
            server_in, self._to_server = os.pipe()
            self._from_server, server_out = os.pipe()
            for fd in (server_in, server_out, self._from_server):
                stack.callback(os.close, fd)
            stack.callback(self._end_input)
            os.set_blocking(self._to_server, False)
            os.set_blocking(self._from_server, False)
            stack.callback(self._give_back_stdio)
            os.dup2(server_in, 0)
            os.dup2(server_out, 1)
            self._stack = stack.pop_all()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stack.close()

    def _give_back_stdio(self) -> None:
        os.dup2(self._client_in, 0)
        if self.stdout_closed:  # a late print goes nowhere, not to a traceback at exit
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, 1)
            os.close(null)
        else:
            os.dup2(self._client_out, 1)

    async def take_in(self) -> None:
        """Copy stdin to the server until its end, then say the client left. Once this
        returns or is cancelled, the server's reader is at the end too, and the server's
        output is read whatever the client does: the server is stopping."""
        try:
            while data := await self._read_client():
                await self._pass_on(self._screen(data))
            if not self._skipping:  # a last message with no newline
                await self._pass_on(bytes(self._line))
        finally:
            self._end_input()
            self._stopping = True
            self._waiting.cancel()
        self.left.set()

    async def _pass_on(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            try:
                view = view[os.write(self._to_server, view) :]
            except BlockingIOError:
                await anyio.wait_writable(self._to_server)

    def _screen(self, data: bytes) -> bytes:
        """The whole messages ``data`` completes, to pass on to the server. A message
        over :data:`MESSAGE_MAX_BYTES` is dropped as it comes (never held whole) and its
        sender answered with an error, as the server answers a request it refuses."""
        out = bytearray()
        start = 0
        while start < len(data):
            end = data.find(b"\n", start)
            stop = len(data) if end < 0 else end + 1
            if self._skipping:
                self._skipping = end < 0
            else:
                self._line += data[start:stop]
                if len(self._line) > MESSAGE_MAX_BYTES + 1:
                    self._refuse(bytes(self._line[:65536]))
                    self._skipping = end < 0
                    self._line.clear()
                elif end >= 0:
                    out += self._line
                    self._line.clear()
            start = stop
        return bytes(out)

    def _refuse(self, head: bytes) -> None:
        """Answer the message ``head`` begins, if it names its id (a notification is
        answered by no one)."""
        found = _ID.search(head)
        if found is None:
            return
        with contextlib.suppress(ValueError):
            said = (
                f"request larger than {size_text(MESSAGE_MAX_BYTES)} (the cap for one MCP "
                "message): refused, nothing was run or recorded"
            )
            error = {"code": -32600, "message": said}
            reply = {"jsonrpc": "2.0", "id": json.loads(found.group(1)), "error": error}
            self._refusals.append(json.dumps(reply).encode() + b"\n")
            self._waiting.cancel()

    def _end_input(self) -> None:
        if self._to_server >= 0:
            os.close(self._to_server)
            self._to_server = -1

    async def _read_client(self) -> bytes:
        """The next bytes from stdin; none at its end (or when it fails)."""
        while True:
            if self._pollable_in:
                await anyio.wait_readable(self._client_in)
            else:  # a file: reading it does not block
                await anyio.lowlevel.checkpoint()
            try:
                return os.read(self._client_in, _CHUNK)
            except BlockingIOError:
                continue
            except OSError:
                return b""

    async def send_out(self, *, task_status: TaskStatus[None]) -> None:
        """Copy the server's output to stdout until :meth:`stop`, and what is left then for
        at most :data:`_AFTER_END`. Not cancelled from outside: the server's writer must
        never wait on the client once the server is stopping, and it does not."""
        with anyio.CancelScope(shield=True), self._flushing:
            task_status.started()
            while True:
                self._take_output()
                self._deliver()
                if self._stopped and not self._pending:
                    return
                with anyio.CancelScope() as self._waiting:
                    await self._wait()

    def stop(self) -> None:
        """The server has stopped: :meth:`send_out` delivers what is left and returns."""
        self._stopped = self._stopping = True
        self._flushing.deadline = anyio.current_time() + _AFTER_END
        self._waiting.cancel()

    def _take_output(self) -> None:
        """Read what the server wrote (up to :data:`_BACKLOG` ahead of the client while
        it serves); kept for the client unless stdout is gone."""
        while self._stopping or len(self._pending) < _BACKLOG:
            try:
                data = os.read(self._from_server, _CHUNK)
            except BlockingIOError:
                break
            if not data:  # cannot be while fd 1 is this pipe's, but never spin on it
                break
            self._at_boundary = data.endswith(b"\n")
            if not self.stdout_closed:
                self._pending += data
        if self._refusals and self._at_boundary:  # between the server's messages, never in one
            if not self.stdout_closed:
                self._pending += b"".join(self._refusals)
            self._refusals.clear()

    def _deliver(self) -> None:
        """Write what stdout takes now; a stdout that fails means the client left."""
        try:
            while self._pending:
                del self._pending[: os.write(self._client_out, self._pending)]
        except BlockingIOError:
            pass
        except OSError:  # EPIPE: the reader closed its end
            self.stdout_closed = True
            self._pending.clear()
            self.left.set()

    async def _wait(self) -> None:
        """Until the server has written more or stdout takes more, whichever is first."""
        async with anyio.create_task_group() as race:

            async def first(wait: Callable[[int], Awaitable[None]], fd: int) -> None:
                await wait(fd)
                race.cancel_scope.cancel()

            if self._stopping or len(self._pending) < _BACKLOG:
                race.start_soon(first, anyio.wait_readable, self._from_server)
            if self._pending and self._pollable_out:
                race.start_soon(first, anyio.wait_writable, self._client_out)


def _private_copy(fd: int, stack: ExitStack) -> tuple[int, bool]:
    """A close-on-exec copy of ``fd`` (closed by ``stack``) and whether it can be waited
    on (a pipe, a socket or a terminal, then non-blocking until ``stack`` closes; a file
    never blocks)."""
    copy = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 3)
    stack.callback(os.close, copy)
    mode = os.fstat(copy).st_mode
    pollable = stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode) or os.isatty(copy)
    if pollable and os.get_blocking(copy):
        os.set_blocking(copy, False)
        stack.callback(os.set_blocking, copy, True)
    return copy, pollable


def _answer(reply: StepReply) -> str:
    """An error result for a refused call, else the reply as JSON."""
    from mcp.server.mcpserver.exceptions import ToolError

    if reply.verdict in (Verdict.BLOCK, Verdict.CONTINUE):
        detail = f" ({reply.detail})" if reply.detail else ""
        raise ToolError(f"{reply.verdict.value}: {reply.message}{detail}")
    return answer(reply)
