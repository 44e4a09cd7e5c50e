"""``cmbs mcp`` driven by the MCP SDK's own client over stdio: the tools and their
schemas, a premature claim refused, a command that really runs, a legal sequence that
earns termination, the deadline ending the session, and the audit trail of it all."""

from __future__ import annotations

import json
import sys
from importlib import resources
from pathlib import Path

import pytest
from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client

from cmbs_async.audit import SQLiteAuditStore

from .helpers import demo_check, processes_with, unique_seconds

pytestmark = pytest.mark.anyio


def _server(scenario: Path, tmp_path: Path) -> StdioServerParameters:
    return StdioServerParameters(
        command=sys.executable,
        args=["-m", "cmbs_async", "mcp", str(scenario), "--audit-db", str(tmp_path / "audit.db")]
        + ["--signing-key", str(tmp_path / "key")],
    )


def _text(result: object) -> str:
    content = result.content  # type: ignore[attr-defined]
    return "".join(getattr(block, "text", "") for block in content)


STRUCTURED = ("evaluate_policy", {"policy": "policy.rego", "input": "collected_data.json"})


@pytest.mark.parametrize("structured", [False, True], ids=["command", "evaluate_policy"])
async def test_an_mcp_client_is_supervised_call_by_call(tmp_path: Path, structured: bool) -> None:
    scenario = tmp_path / "demo.yaml"
    scenario.write_text((resources.files("cmbs_async.demo") / "scenario.yaml").read_text())
    async with (
        stdio_client(_server(scenario, tmp_path)) as (read, write),
        ClientSession(read, write) as client,
    ):
        await client.initialize()
        tools = {tool.name: tool for tool in (await client.list_tools()).tools}
        assert {"check_status", "declare_posture", "generate_script", "terminate"} <= set(tools)
        assert tools["check_status"].input_schema["required"] == ["command"]
        assert tools["declare_posture"].input_schema["properties"]["posture"]["enum"] == [
            "compliant",
            "non_compliant",
        ]

        early = await client.call_tool("declare_posture", {"posture": "compliant"})
        assert early.is_error
        assert "Posture declaration not permitted without successful execution" in _text(early)
        assert tools["evaluate_policy"].input_schema["required"] == ["input", "policy"]
        calls = demo_check()
        for action, payload in calls[:-1] + [STRUCTURED] if structured else calls:
            ran = await client.call_tool(action, payload)
            assert not ran.is_error and json.loads(_text(ran))["observation"]["success"]
        observed = json.loads(_text(ran))["observation"]
        assert observed["stdout"]["head"] == "false\n" and observed["exit_status"] == 0
        declared = await client.call_tool("declare_posture", {"posture": "non_compliant"})
        assert not declared.is_error
        done = json.loads(_text(await client.call_tool("terminate", {})))
        assert done["verdict"] == "TERMINATE" and done["outcome"] == "terminated"
    store = SQLiteAuditStore(tmp_path / "audit.db", read_only=True)
    try:
        assert [s["outcome"] for s in store.sessions()] == ["terminated"]
        assert store.verify().intact
    finally:
        store.close()


async def test_the_deadline_ends_an_mcp_session(tmp_path: Path) -> None:
    marker = unique_seconds()
    scenario = tmp_path / "slow.yaml"
    scenario.write_text("id: slow\ngoal: wait\ndeadline_s: 2\n")
    async with (
        stdio_client(_server(scenario, tmp_path)) as (read, write),
        ClientSession(read, write) as client,
    ):
        await client.initialize()
        late = json.loads(
            _text(await client.call_tool("check_status", {"command": f"sleep {marker}"}))
        )
        assert late["outcome"] == "deadline_exceeded"
    assert processes_with(marker) == []
    store = SQLiteAuditStore(tmp_path / "audit.db", read_only=True)
    try:
        assert [s["outcome"] for s in store.sessions()] == ["deadline_exceeded"]
    finally:
        store.close()
