"""The OpenAI Agents SDK: function tools from a session's profile, every call through the
session, the run ending when a termination is accepted (extra ``[openai-agents]``)::

    async with Session(spec) as session:
        result = await Runner.run(session_agent(session, model="gpt-4o"), session.goal)
    session.result
"""

from __future__ import annotations

import json
from typing import Any

from agents import Agent, FunctionTool, FunctionToolResult, RunContextWrapper
from agents import ToolsToFinalOutputResult as Final

from ..protocol import PAYLOAD_MODELS, ActionKind, Verdict
from ..session import Session
from ._tools import action_tools

__all__ = ["session_agent", "session_tools"]


def session_tools(session: Session) -> list[FunctionTool]:
    """The profile's actions as function tools, each schema the action's payload model;
    each answers with the supervisor's reply as JSON (a refusal too: the model reads why)."""
    tools = []
    for tool in action_tools(session):
        model = PAYLOAD_MODELS[session.profile.actions[tool.name].kind]

        async def invoke(context: Any, arguments: str, call: Any = tool.function) -> str:
            return str(await call(**(json.loads(arguments) if arguments.strip() else {})))

        tools.append(
            FunctionTool(
                name=tool.name,
                description=tool.description,
                params_json_schema=model.model_json_schema(),
                on_invoke_tool=invoke,
                strict_json_schema=False,
            )
        )
    return tools


def session_agent(session: Session, **options: Any) -> Agent[Any]:
    """An Agent with the session's goal as its instructions and its tools, whose run ends
    (final output: the accepted termination's reply) when the gate accepts a termination;
    ``options`` go to ``Agent`` (``model=``, ``model_settings=``, ...)."""
    ending = {n for n, s in session.profile.actions.items() if s.kind is ActionKind.TERMINATE}

    def stop_on_termination(
        context: RunContextWrapper[Any], results: list[FunctionToolResult]
    ) -> Final:
        for result in results:
            if result.tool.name in ending and _verdict(result.output) == Verdict.TERMINATE:
                return Final(is_final_output=True, final_output=result.output)
        return Final(is_final_output=False, final_output=None)

    return Agent(
        name="cmbs",
        instructions=session.goal,
        tools=list(session_tools(session)),
        tool_use_behavior=stop_on_termination,
        **options,
    )


def _verdict(output: object) -> str | None:
    try:
        said = json.loads(str(output))
    except ValueError:
        return None
    return said.get("verdict") if isinstance(said, dict) else None
