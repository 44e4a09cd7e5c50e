"""The chat-completions client the OpenAI agent and the stock reviewer share, without a
model: the agent's response-format negotiation against an in-process ASGI app (httpx's
``ASGITransport``: refusals a real server cannot be made to give on demand), and who
closes the connection, against a real HTTP server on 127.0.0.1."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anyio
import httpx
import pytest

from cmbs_async import ModelEndpointError, OpenAIAgent, Outcome, ScenarioSpec, Turn, run_scenario
from cmbs_async.review import OpenAIReviewer, ReviewRequest, SupervisionConfig, Verdict3
from executors import NullExecutor

from .helpers import Answer, ChatApp, chat_server, completion

pytestmark = pytest.mark.anyio

TURN = Turn(scenario_id="x", goal="g", step=1)
REQUEST = ReviewRequest(goal="g", commitment="c", trace="t", assessment="a", flags=())


def refusing(refusals: dict[str, int], text: str = '{"step": 1}') -> Answer:
    """A server that answers the response formats in ``refusals`` with that status."""

    def answer(body: dict[str, Any]) -> tuple[int, object]:
        fmt = body.get("response_format", {}).get("type", "none")
        return (
            (refusals[fmt], {"error": "unsupported"})
            if fmt in refusals
            else (200, completion(text))
        )

    return answer


def refs(node: object) -> Iterator[str]:
    """Every ``$ref`` in a JSON schema."""
    if isinstance(node, dict):
        yield from (node["$ref"],) if "$ref" in node else ()
        for value in node.values():
            yield from refs(value)
    elif isinstance(node, list):
        for item in node:
            yield from refs(item)


# -- response-format negotiation -------------------------------------------------------------


@pytest.mark.parametrize(
    ("refusals", "settled", "tried"),
    [
        ({}, "json_schema", ["json_schema"]),  # OpenAI's form
        ({"json_schema": 400}, "json_object", ["json_schema", "json_object"]),  # llama.cpp's
        (
            {"json_schema": 422, "json_object": 500},
            "none",
            ["json_schema", "json_object", "none"],
        ),
    ],
)
async def test_auto_settles_on_the_first_format_the_server_takes(
    refusals: dict[str, int], settled: str, tried: list[str]
) -> None:
    app = ChatApp(refusing(refusals, text='{"belief": {}}'))
    async with (
        app.client() as client,
        OpenAIAgent(model="m", base_url="http://m/v1", client=client) as agent,
    ):
        assert await agent.next_step(TURN) == '{"belief": {}}'  # the reply, unchanged
        assert (agent.response_format, app.formats) == (settled, tried)
        await agent.next_step(TURN.model_copy(update={"step": 2}))
    assert app.formats == [*tried, settled]  # remembered: no more refused requests
    first = app.bodies[0]["response_format"]
    schema = first["json_schema"]["schema"]
    assert first["json_schema"]["name"] == "agent_step" and "action" in schema["properties"]
    assert list(refs(schema)) == [] and "$defs" not in schema  # inlined for servers that need it
    if "json_object" in tried:
        assert app.bodies[1]["response_format"] == {"type": "json_object", "schema": schema}


@pytest.mark.parametrize("status", [401, 404, 429, 503])
async def test_an_error_that_is_no_format_refusal_is_not_retried_in_another_format(
    status: int,
) -> None:
    app = ChatApp(lambda body: (status, {"error": "no"}))
    async with (
        app.client() as client,
        OpenAIAgent(model="m", base_url="http://m/v1", client=client) as agent,
    ):
        with pytest.raises(ModelEndpointError, match=f"answered HTTP {status}$"):
            await agent.next_step(TURN)
    assert app.formats == ["json_schema"]


@pytest.mark.parametrize(
    ("configured", "tried"),
    [("auto", ["json_schema", "json_object", "none"]), ("json_schema", ["json_schema"])],
)
async def test_a_server_that_takes_no_format_tried_is_an_endpoint_error(
    configured: Any, tried: list[str]
) -> None:
    app = ChatApp(lambda body: (400, {"error": "bad request"}))
    async with (
        app.client() as client,
        OpenAIAgent(
            model="m", base_url="http://m/v1", client=client, response_format=configured
        ) as agent,
    ):
        with pytest.raises(ModelEndpointError, match="HTTP 400 to every response format tried"):
            await agent.next_step(TURN)
    assert app.formats == tried
    assert agent.response_format == configured  # nothing settled


async def test_the_run_ends_agent_error_when_the_endpoint_fails() -> None:
    app = ChatApp(lambda body: (503, {"error": "overloaded"}))
    async with (
        app.client() as client,
        OpenAIAgent(model="m", base_url="http://m/v1", client=client) as agent,
    ):
        result = await run_scenario(
            ScenarioSpec(id="x", goal="g", deadline_s=20), agent=agent, executor=NullExecutor()
        )
    assert result.outcome is Outcome.AGENT_ERROR
    assert result.reason == "agent raised ModelEndpointError: the model endpoint answered HTTP 503"


@pytest.mark.parametrize(
    ("status", "reply", "passed_on"),
    [
        (200, b"not a completion", "not a completion"),  # verbatim: the gate answers it
        (200, {"choices": []}, '{"choices": []}'),
        (200, completion({"belief": {}}), '{"belief": {}}'),  # content that is no string
    ],
)
async def test_a_reply_that_is_not_text_reaches_the_gate_as_text(
    status: int, reply: object, passed_on: str
) -> None:
    app = ChatApp(lambda body: (status, reply))
    async with (
        app.client() as client,
        OpenAIAgent(model="m", base_url="http://m/v1", client=client) as agent,
    ):
        assert await agent.next_step(TURN) == passed_on


async def test_the_key_is_read_from_the_environment_at_each_request(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    app = ChatApp(refusing({}))
    async with (
        app.client() as client,
        OpenAIAgent(model="m", base_url="http://m/v1", client=client) as agent,
    ):
        await agent.next_step(TURN)
        monkeypatch.setenv("CMBS_AGENT_API_KEY", "sk-test")
        await agent.next_step(TURN)
    assert "authorization" not in app.headers[0]
    assert app.headers[1]["authorization"] == "Bearer sk-test"
    assert all("sk-test" not in json.dumps(body) for body in app.bodies)


# -- who closes the connection -----------------------------------------------------------------


async def test_an_agent_keeps_one_connection_and_closes_it_at_the_end() -> None:
    async with chat_server('{"step": 1}') as server:
        async with OpenAIAgent(model="m", base_url=f"http://127.0.0.1:{server.port}/v1") as agent:
            for number in (1, 2, 3):
                await agent.next_step(TURN.model_copy(update={"step": number}))
            assert (server.opened, server.requests, server.closed) == (1, 3, 0)
        with anyio.fail_after(10):
            await server.all_closed()
        await agent.aclose()  # a second time: nothing left to close, no error
        assert server.closed == 1


async def test_a_reviewer_keeps_one_connection_and_closes_it_at_the_end() -> None:
    async with chat_server("VERDICT: CONTINUE\nREASONING: fine") as server:
        config = SupervisionConfig(base_url=f"http://127.0.0.1:{server.port}/v1")
        async with OpenAIReviewer(config) as reviewer:
            for _ in range(3):
                assert (await reviewer.review(REQUEST)).verdict is Verdict3.CONTINUE
            assert (server.opened, server.requests, server.closed) == (1, 3, 0)
        with anyio.fail_after(10):
            await server.all_closed()
        assert server.closed == 1


async def test_a_client_the_caller_passed_in_is_left_open_for_the_caller() -> None:
    async with chat_server("VERDICT: PAUSE\nREASONING: wait") as server:
        base_url = f"http://127.0.0.1:{server.port}/v1"
        async with httpx.AsyncClient() as client:
            async with OpenAIAgent(model="m", base_url=base_url, client=client) as agent:
                await agent.next_step(TURN)
            config = SupervisionConfig(base_url=base_url)
            async with OpenAIReviewer(config, client=client) as reviewer:
                assert (await reviewer.review(REQUEST)).verdict is Verdict3.PAUSE
            assert (server.opened, server.requests, server.closed) == (1, 2, 0)
            reply = await client.post(f"{base_url}/chat/completions", json={})
            assert reply.status_code == 200 and server.opened == 1  # the same connection
        with anyio.fail_after(10):
            await server.all_closed()  # closed by the one who opened it
