"""The README's library examples run as documented."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).parent.parent / "examples"


def run(name: str) -> list[str]:
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / name)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def test_gate_inside_your_own_loop() -> None:
    lines = run("library_gate.py")
    assert [line.split()[1] for line in lines[:5]] == [
        "BLOCK",
        "ALLOW",
        "ALLOW",
        "ALLOW",
        "TERMINATE",
    ]
    assert lines[-1] == "earned posture: compliant"


def test_async_callable_agent_under_the_runtime() -> None:
    lines = run("async_agent.py")
    assert lines[0] == "1 check_status ALLOW exit 0: false"
    assert lines[-1] == "terminated non_compliant"
