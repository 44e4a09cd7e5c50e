"""The library examples (examples/, shown in docs/guides/library.md) run as documented."""

from __future__ import annotations

import runpy
import subprocess
import sys
from pathlib import Path

import pytest

from cmbs_async import Messages, Outcome, ScenarioSpec, ScriptedAgent, Verdict, run_scenario
from executors import NullExecutor

from .helpers import step

EXAMPLES = Path(__file__).parent.parent / "examples"


def run(name: str) -> list[str]:
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / name)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def test_gate_inside_your_own_loop() -> None:
    lines = run("library_gate.py")
    assert [line.split()[1] for line in lines[:6]] == [
        "BLOCK",
        "ALLOW",
        "CONTINUE",
        "ALLOW",
        "ALLOW",
        "TERMINATE",
    ]
    assert lines[-1] == "earned posture: compliant"


def test_async_callable_agent_under_the_runtime() -> None:
    lines = run("async_agent.py")
    assert lines[1] == "2 execute_opa ALLOW exit 0: false"
    assert lines[-1] == "terminated non_compliant"


@pytest.mark.anyio
async def test_the_showcase_baseline_lets_through_what_the_gate_stops() -> None:
    """``llm_vs_gate.py``'s pass-through rules, through the public ``rules=`` option (the
    showcase itself needs a model server and an sshd)."""
    script = [
        step(
            "declare_posture", {"posture": "compliant"}, posture="compliant", evidence="successful"
        ),
        step("terminate"),
    ]
    spec = ScenarioSpec(id="baseline", goal="g", deadline_s=20)
    gated, passed = [
        await run_scenario(spec, agent=ScriptedAgent(script), executor=NullExecutor(), rules=rules)
        for rules in (None, runpy.run_path(str(EXAMPLES / "llm_vs_gate.py"))["PassThrough"]())
    ]
    assert [(t.verdict, t.message) for t in gated.trace] == [
        (Verdict.CONTINUE, Messages.INCONSISTENT),  # evidence claimed, none observed
        (Verdict.BLOCK, Messages.TERMINATION_BLOCKED),
    ]
    assert (gated.outcome, gated.posture) == (Outcome.AGENT_FINISHED, None)
    assert [t.verdict for t in passed.trace] == [Verdict.ALLOW, Verdict.TERMINATE]
    assert (passed.outcome, passed.posture) == (Outcome.TERMINATED, "compliant")
    assert passed.masks.evidence == "none"  # the masks still follow what was observed
