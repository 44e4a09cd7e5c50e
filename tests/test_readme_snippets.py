"""The README's documented snippets, run as a reader would copy them."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from importlib import resources
from pathlib import Path

from cmbs_async import AgentStep

from .helpers import CMBS

README = (Path(__file__).parent.parent / "README.md").read_text()


def snippet(name: str) -> str:
    found = re.search(rf"<!-- snippet: {name} -->\n```\w+\n(.*?)```", README, re.S)
    assert found is not None, f"no snippet {name} in the README"
    return found.group(1)


def python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )


def test_the_handle_snippet() -> None:
    done = python(snippet("handle"))
    assert done.returncode == 0, done.stderr
    assert done.stdout == "killed: the run ended while it ran\n"


def test_the_session_snippet() -> None:
    done = python(snippet("session"))
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "Posture declaration not permitted without successful execution.",
        "false",
        "",
        "terminated non_compliant",
    ]


def test_the_stdio_agent_snippet_earns_the_demo(tmp_path: Path) -> None:
    agent = tmp_path / "agent.py"
    agent.write_text(snippet("stdio-agent"))
    scenario = tmp_path / "demo.yaml"
    scenario.write_text((resources.files("cmbs_async.demo") / "scenario.yaml").read_text())
    done = subprocess.run(
        [*CMBS, "run", str(scenario), "--agent", f"stdio:{sys.executable} {agent}"]
        + ["--json", "--no-audit"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(done.stdout)
    assert (result["outcome"], result["posture"]) == ("terminated", "non_compliant")


def test_the_wire_examples_and_the_mcp_configuration_are_what_they_say() -> None:
    step = re.search(r"2\. The program answers.*?```json\n(.*?)```", README, re.S)
    assert step is not None
    AgentStep.model_validate_json(step.group(1))
    config = json.loads(snippet("mcp-config"))
    assert config["mcpServers"]["cmbs"]["args"][0] == "mcp"
    turn = subprocess.run([*CMBS, "schema", "--turn"], capture_output=True, text=True, check=True)
    assert json.loads(turn.stdout)["title"] == "Turn"
