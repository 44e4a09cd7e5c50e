"""The pydantic-ai adapter, driven by pydantic-ai's own TestModel: every tool call the
model makes goes through the session, and the gate's refusals reach the model."""

from __future__ import annotations

import json

import pytest
from pydantic_ai import Agent
from pydantic_ai.models.test import TestModel

from cmbs_async import Outcome, ScenarioSpec, Session, Verdict
from cmbs_async.adapters.pydantic_ai import session_toolset

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.parametrize("anyio_backend", ["asyncio"]),  # pydantic-ai runs on asyncio
]


async def test_every_tool_call_goes_through_the_session() -> None:
    spec = ScenarioSpec(id="tools", goal="check the host", deadline_s=60)
    model = TestModel(call_tools=["declare_posture", "check_status", "terminate"])
    async with Session(spec) as session:
        agent = Agent(model, toolsets=[session_toolset(session)])
        run = await agent.run(session.goal)
        names = {t.name for t in model.last_model_request_parameters.function_tools}
    assert {"check_status", "declare_posture", "generate_playbook", "terminate"} <= names
    result = session.result
    assert result is not None and result.outcome is Outcome.AGENT_FINISHED
    by_action = {entry.action: entry for entry in result.trace}
    assert set(by_action) == {"declare_posture", "check_status", "terminate"}
    # nothing observed yet when it declared: refused, and the model was told so
    assert by_action["declare_posture"].verdict is Verdict.BLOCK
    assert by_action["terminate"].verdict is Verdict.BLOCK
    assert by_action["check_status"].verdict is Verdict.ALLOW  # it really ran
    told = [
        json.loads(part.content)
        for message in run.all_messages()
        for part in message.parts
        if part.part_kind == "tool-return"
    ]
    assert {said["verdict"] for said in told} == {"BLOCK", "ALLOW"}
    assert any(
        said["message"] == "Posture declaration not permitted without successful execution."
        for said in told
    )
