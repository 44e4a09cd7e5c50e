"""A session's actions as tools for agent frameworks: the MCP server and pydantic-ai.

Each action of the session's profile becomes one tool whose parameters are the fields of
the action's payload model; every call goes through :meth:`Session.step`.
"""

from ._tools import ActionTool, action_tools, answer

__all__ = ["ActionTool", "action_tools", "answer"]
