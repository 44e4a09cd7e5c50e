"""What a supervised tool call costs over calling the tool directly.

Run: ``python benchmarks/session_overhead.py [--calls N] [--rounds R]``. In one run,
interleaved round by round, each running ``true`` N times in a workdir:
(a) the executor directly (``LocalExecutor.run_command``, the sandbox included),
(b) through a ``Session`` (``session.step("check_status", ...)``: gate, trace, turn),
(c) through ``cmbs mcp`` from the MCP SDK's own client over stdio (a JSON-RPC round
trip per call on top of (b)), (d) through the function the pydantic-ai toolset hands the
framework (``action_tools``: (b) plus the JSON answer), (e) through the OpenAI Agents
SDK's ``FunctionTool.on_invoke_tool`` (plus parsing the model's JSON arguments). Prints
calls per second,
milliseconds per call, and each one's time per call over (a)'s.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import anyio
from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client

from cmbs_async import ScenarioSpec, Session
from cmbs_async.adapters import action_tools
from cmbs_async.adapters.openai_agents import session_tools
from executors import LocalExecutor


async def direct(calls: int) -> float:
    executor = LocalExecutor()
    workdir = await executor.prepare(None, {})
    try:
        start = time.perf_counter()
        for _ in range(calls):
            await executor.run_command(workdir, "true", timeout=30)
        return (time.perf_counter() - start) / calls
    finally:
        await executor.cleanup(workdir)


async def session(calls: int) -> float:
    spec = ScenarioSpec(id="bench", goal="g", max_steps=calls + 1, deadline_s=600)
    async with Session(spec) as running:
        start = time.perf_counter()
        for _ in range(calls):
            await running.step("check_status", {"command": "true"})
        return (time.perf_counter() - start) / calls


async def adapter(calls: int) -> float:
    spec = ScenarioSpec(id="bench", goal="g", max_steps=calls + 1, deadline_s=600)
    async with Session(spec) as running:
        check = {tool.name: tool.function for tool in action_tools(running)}["check_status"]
        start = time.perf_counter()
        for _ in range(calls):
            await check(command="true")
        return (time.perf_counter() - start) / calls


async def openai_agents(calls: int) -> float:
    spec = ScenarioSpec(id="bench", goal="g", max_steps=calls + 1, deadline_s=600)
    async with Session(spec) as running:
        check = {tool.name: tool for tool in session_tools(running)}["check_status"]
        start = time.perf_counter()
        for _ in range(calls):
            await check.on_invoke_tool(None, '{"command": "true"}')  # type: ignore[arg-type]
        return (time.perf_counter() - start) / calls


async def mcp(calls: int, scenario: Path) -> float:
    server = StdioServerParameters(
        command=sys.executable, args=["-m", "cmbs_async", "mcp", str(scenario), "--no-audit"]
    )
    async with stdio_client(server) as (read, write), ClientSession(read, write) as client:
        await client.initialize()
        start = time.perf_counter()
        for _ in range(calls):
            await client.call_tool("check_status", {"command": "true"})
        return (time.perf_counter() - start) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    times: dict[str, list[float]] = {
        "direct": [],
        "session": [],
        "mcp": [],
        "adapter": [],
        "openai": [],
    }
    with tempfile.TemporaryDirectory() as folder:
        scenario = Path(folder) / "bench.yaml"
        scenario.write_text(f"id: bench\ngoal: g\nmax_steps: {args.calls + 1}\ndeadline_s: 600\n")
        for _ in range(args.rounds):  # interleaved: drift hits all three alike
            times["direct"].append(anyio.run(direct, args.calls))
            times["session"].append(anyio.run(session, args.calls))
            times["mcp"].append(anyio.run(mcp, args.calls, scenario))
            times["adapter"].append(anyio.run(adapter, args.calls))
            times["openai"].append(anyio.run(openai_agents, args.calls))
    base = statistics.median(times["direct"])
    print(f"{args.calls} calls of `true`, median of {args.rounds} interleaved rounds:")
    for name, label in (
        ("direct", "(a) executor directly"),
        ("session", "(b) Session.step"),
        ("mcp", "(c) cmbs mcp, SDK client"),
        ("adapter", "(d) pydantic-ai tool"),
        ("openai", "(e) OpenAI Agents SDK tool"),
    ):
        per = statistics.median(times[name])
        print(f"  {label:26} {1 / per:8.0f} calls/s  {per * 1000:7.2f} ms/call  x{per / base:.2f}")


if __name__ == "__main__":
    main()
