"""A pydantic-ai toolset whose every tool call goes through a session (extra
``[pydantic-ai]``)::

    async with Session(spec) as session:
        agent = pydantic_ai.Agent(model, toolsets=[session_toolset(session)])
        await agent.run(session.goal)
    session.result
"""

from __future__ import annotations

from pydantic_ai import FunctionToolset, Tool

from ..session import Session
from ._tools import action_tools

__all__ = ["session_toolset"]


def session_toolset(session: Session) -> FunctionToolset[None]:
    """The profile's actions as pydantic-ai tools. Each answers the model with the
    supervisor's reply as JSON: the verdict and its neutral message (a refusal included:
    the model reads why, and may go on), what running the action observed, and the
    outcome once the session has ended."""
    return FunctionToolset(
        [Tool(t.function, name=t.name, description=t.description) for t in action_tools(session)]
    )
