"""``cmbs mcp``: a scenario's actions as MCP tools, every call supervised (extra ``[mcp]``).

Built on the official MCP Python SDK (2.x, anyio-based; imported only when a server is
built, so that the package works without it). Each action of the scenario's
profile is one tool whose input schema is the action's payload model. Every call goes
through a :class:`~cmbs_async.session.Session`: a refused call is an error result that
carries the gate's neutral message; an allowed command or artifact runs and its
observation comes back as the result; the scenario's deadline bounds the session, and the
audit trail records it like any run. Tool-calling clients send no belief, so the
session's belief policy applies (see :mod:`cmbs_async.session`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import anyio

from .adapters import action_tools, answer
from .protocol import Verdict
from .session import Session, StepReply

if TYPE_CHECKING:
    from mcp.server.mcpserver import MCPServer

__all__ = ["build_server", "serve_stdio"]

#: how long calls after the session's end still get an answer before the server stops
_AFTER_END = 1.0


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
    """Serve ``session`` over stdin and stdout until the client leaves or, shortly after,
    the session has ended (terminated, deadline, step budget)."""
    server = build_server(session)
    async with anyio.create_task_group() as group:

        async def stop_after_the_end() -> None:
            await session.wait()
            await anyio.sleep(_AFTER_END)  # the last answers reach the client
            group.cancel_scope.cancel()

        group.start_soon(stop_after_the_end)
        await server.run_stdio_async()
        group.cancel_scope.cancel()  # the client left


def _answer(reply: StepReply) -> str:
    """An error result for a refused call, else the reply as JSON."""
    from mcp.server.mcpserver.exceptions import ToolError

    if reply.verdict in (Verdict.BLOCK, Verdict.CONTINUE):
        detail = f" ({reply.detail})" if reply.detail else ""
        raise ToolError(f"{reply.verdict.value}: {reply.message}{detail}")
    return answer(reply)
