"""The OpenAI Agents SDK adapter. The SDK ships no test model, so a model here is one
written against the SDK's public ``Model`` interface that calls the given tools in order
(what a model's tool calls are to the SDK); the SDK's own Runner, tools and
tool-use behaviour do the rest, and the run ends on an accepted termination."""

from __future__ import annotations

import json
from typing import Any

import pytest
from agents import ModelResponse, RunConfig, Runner, Usage
from agents.models.interface import Model
from openai.types.responses import (
    ResponseFunctionToolCall,
    ResponseOutputMessage,
    ResponseOutputText,
)

from cmbs_async import Outcome, Session, Verdict
from cmbs_async.adapters.openai_agents import session_agent
from cmbs_async.demo import demo_scenario

from .helpers import demo_check

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.parametrize("anyio_backend", ["asyncio"]),  # the SDK runs on asyncio
]


class CallsTools(Model):
    """Calls each (tool, arguments) in turn, one per response; then says it is done."""

    def __init__(self, calls: list[tuple[str, dict[str, Any]]]) -> None:
        self.calls = list(calls)
        self.tools_offered: list[str] = []

    async def get_response(self, *args: Any, **kwargs: Any) -> ModelResponse:
        tools = kwargs["tools"] if "tools" in kwargs else args[3]
        self.tools_offered = [tool.name for tool in tools]
        if self.calls:
            name, arguments = self.calls.pop(0)
            number = len(self.calls)
            item: Any = ResponseFunctionToolCall(
                type="function_call",
                id=f"fc_{number}",
                call_id=f"call_{number}",
                name=name,
                arguments=json.dumps(arguments),
                status="completed",
            )
        else:
            text = ResponseOutputText(type="output_text", text="done", annotations=[])
            item = ResponseOutputMessage(
                type="message", id="msg", role="assistant", status="completed", content=[text]
            )
        return ModelResponse(output=[item], usage=Usage(), response_id=None)

    def stream_response(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError


async def test_the_run_ends_on_an_accepted_termination() -> None:
    model = CallsTools(
        [
            ("declare_posture", {"posture": "compliant"}),  # too early: refused
            *demo_check(),
            ("declare_posture", {"posture": "non_compliant"}),
            ("terminate", {}),
            ("check_status", {"command": "echo never"}),  # never asked for: the run ended
        ]
    )
    async with Session(demo_scenario()) as session:
        ran = await Runner.run(
            session_agent(session, model=model),
            session.goal,
            run_config=RunConfig(tracing_disabled=True),
        )
    assert {"check_status", "declare_posture", "terminate"} <= set(model.tools_offered)
    assert json.loads(ran.final_output)["outcome"] == "terminated"
    assert model.calls == [("check_status", {"command": "echo never"})]
    result = session.result
    assert result is not None and result.outcome is Outcome.TERMINATED
    assert result.posture == "non_compliant"
    assert [t.verdict for t in result.trace] == [
        Verdict.BLOCK,
        *[Verdict.ALLOW] * 5,  # the check's four calls, the declaration
        Verdict.TERMINATE,
    ]
