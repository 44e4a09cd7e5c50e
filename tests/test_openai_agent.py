"""The language-model agent without a model: its spec form and its transport retries."""

from __future__ import annotations

import pytest

from cmbs_async import OpenAIAgent, Turn


@pytest.mark.anyio
async def test_transport_errors_are_retried_then_reported() -> None:
    agent = OpenAIAgent(model="m", base_url="http://127.0.0.1:9/v1", retries=2)
    with pytest.raises(RuntimeError, match="unreachable"):
        await agent.next_step(Turn(scenario_id="x", goal="g", step=1))
    assert agent.requests == 3
    await agent.aclose()


def test_the_spec_form() -> None:
    agent = OpenAIAgent.from_spec("smollm2@http://127.0.0.1:8000/v1")
    assert (agent.model, agent.base_url) == ("smollm2", "http://127.0.0.1:8000/v1")
    with pytest.raises(ValueError, match="expected openai:MODEL@"):
        OpenAIAgent.from_spec("smollm2")
