"""The stdio agent: a program in any language, speaking JSON lines."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import anyio
import pytest

from cmbs_async import Outcome, ScenarioSpec, StdioAgent, run_scenario
from executors import LocalExecutor, NullExecutor

pytestmark = pytest.mark.anyio

SPEC = ScenarioSpec(id="stdio", goal="check", deadline_s=20)

PYTHON_AGENT = r"""
import json, sys
for line in sys.stdin:
    turn = json.loads(line)
    masks = (turn["response"] or {}).get("masks") or {}
    evidence = masks.get("evidence", "none")
    if evidence != "successful":
        step = {"action": {"type": "check_status", "payload": {"command": "echo false"}}}
    elif masks["posture_history"][-1:] != ["non_compliant"]:
        step = {"action": {"type": "declare_posture", "payload": {"posture": "non_compliant"}}}
    else:
        step = {"action": {"type": "terminate", "payload": {}}}
    posture = "non_compliant" if evidence == "successful" else "unknown"
    step["belief"] = {"posture": posture, "evidence": evidence}
    print(json.dumps(step), flush=True)
"""

SHELL_AGENT = r"""
read turn
echo '{"belief": {}, "action": {"type": "check_status", "payload": {"command": "true"}}}'
read turn
echo 'this is not json'
read turn
"""


async def test_a_python_program_earns_termination(tmp_path: Path) -> None:
    script = tmp_path / "agent.py"
    script.write_text(PYTHON_AGENT)
    result = await run_scenario(
        SPEC, agent=StdioAgent([sys.executable, str(script)]), executor=LocalExecutor()
    )
    assert result.outcome is Outcome.TERMINATED and result.posture == "non_compliant"
    assert [t.action for t in result.trace] == ["check_status", "declare_posture", "terminate"]


async def test_a_shell_program_and_its_invalid_line(tmp_path: Path) -> None:
    script = tmp_path / "agent.sh"
    script.write_text(SHELL_AGENT)
    result = await run_scenario(SPEC, agent=StdioAgent(f"sh {script}"), executor=NullExecutor())
    assert result.outcome is Outcome.AGENT_FINISHED
    assert [t.verdict.value for t in result.trace] == ["ALLOW", "CONTINUE"]
    assert result.trace[1].message == "Invalid format. Re-emit."


async def test_a_crash_is_an_agent_error_with_its_stderr(tmp_path: Path) -> None:
    agent = StdioAgent("read turn; echo 'Traceback: model weights missing' >&2; exit 3")
    result = await run_scenario(SPEC, agent=agent, executor=NullExecutor())
    assert result.outcome is Outcome.AGENT_ERROR
    assert result.reason is not None
    assert "exited with status 3" in result.reason
    assert "Traceback: model weights missing" in result.reason


async def test_a_hang_is_an_agent_error_and_the_program_is_gone(tmp_path: Path) -> None:
    pidfile = tmp_path / "pid"
    agent = StdioAgent(f"echo $$ > {pidfile}; echo 'thinking...' >&2; sleep 60", step_timeout=0.5)
    with anyio.fail_after(10):
        result = await run_scenario(SPEC, agent=agent, executor=NullExecutor())
    assert result.outcome is Outcome.AGENT_ERROR
    assert result.reason is not None and "gave no step within 0.5 s" in result.reason
    assert "thinking..." in result.reason
    pid = int(pidfile.read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
