"""The documentation's snippets (README.md and docs/), run as a reader would copy them.

A snippet is a fenced code block right under a ``<!-- snippet: NAME -->`` line (indented
as the block is, inside a list item). Every snippet the pages mark is run or checked here,
and every snippet this file checks must be on some page: moving one between pages is
free, dropping or renaming one fails."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from importlib import resources
from pathlib import Path

from cmbs_async import AgentStep, Turn

from .helpers import CMBS

ROOT = Path(__file__).parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
SNIPPET = re.compile(r"^([ \t]*)<!-- snippet: ([\w-]+) -->\n\1```\w+\n(.*?)^\1```", re.S | re.M)


def _snippets() -> dict[str, str]:
    found: dict[str, str] = {}
    for page in PAGES:
        for _, name, body in SNIPPET.findall(page.read_text()):
            assert name not in found, f"snippet {name} is marked twice"
            found[name] = textwrap.dedent(body)
    return found


SNIPPETS = _snippets()
#: every snippet a test below runs or checks
TESTED = {
    "tour-session",  # README.md
    "stdio-agent",  # docs/guides/agents.md
    "handle",  # docs/guides/library.md
    "session",
    "run-config",
    "mcp-config",  # docs/guides/mcp.md
    "wire-turn",  # docs/reference/wire-protocol.md
    "wire-step",
}


def python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )


def test_every_marked_snippet_is_tested_and_every_tested_one_is_marked() -> None:
    assert set(SNIPPETS) == TESTED


def test_the_readme_gives_the_two_commands_ci_runs() -> None:
    """The README's install command and its test command, exactly as .ci/run runs the
    latter (the former runs in its plain-install check); the docs' front pages agree."""
    readme = (ROOT / "README.md").read_text()
    first, second = [block.strip() for block in re.findall(r"```bash\n(.*?)```", readme, re.S)][:2]
    assert (first, second) == (
        "pip install . && cmbs demo",
        "pip install -e '.[test]' && python -m pytest",
    )
    assert second in (ROOT / ".ci" / "run").read_text().splitlines()
    for page in ("docs/index.md", "docs/getting-started.md"):
        text = (ROOT / page).read_text()
        assert first in text and second in text, page


def test_the_readmes_links_lead_somewhere() -> None:
    """The README is not part of the strictly built site: its links into docs/ and the
    repository, and to its own headings, are checked here."""
    readme = (ROOT / "README.md").read_text()
    headings = {
        re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
        for line in readme.splitlines()
        if line.startswith("#")
    }
    links = re.findall(r"\]\(([^)\s]+)\)", readme)
    assert links
    for link in links:
        if link.startswith(("http://", "https://")):
            continue
        path, _, anchor = link.partition("#")
        if path:
            assert (ROOT / path).exists(), link
        else:
            assert anchor in headings, link


def test_the_handle_snippet() -> None:
    done = python(SNIPPETS["handle"])
    assert done.returncode == 0, done.stderr
    assert done.stdout == "killed: the run ended while it ran\n"


def test_the_session_snippet() -> None:
    done = python(SNIPPETS["session"])
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "Posture declaration not permitted without successful execution.",
        "false",
        "",
        "terminated non_compliant",
    ]


def test_the_run_config_snippet_configures_a_run_and_a_session_alike(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", SNIPPETS["run-config"]],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["terminated", "12", "ALLOW"]
    assert (tmp_path / "audit.db").exists()


def test_the_readme_tour_session_snippet() -> None:
    done = python(SNIPPETS["tour-session"])
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["ALLOW", "X11Forwarding", "yes"]


def test_the_stdio_agent_snippet_earns_the_demo(tmp_path: Path) -> None:
    agent = tmp_path / "agent.py"
    agent.write_text(SNIPPETS["stdio-agent"])
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
    AgentStep.model_validate_json(SNIPPETS["wire-step"])
    Turn.model_validate_json(SNIPPETS["wire-turn"])
    config = json.loads(SNIPPETS["mcp-config"])
    assert config["mcpServers"]["cmbs"]["args"][0] == "mcp"
    turn = subprocess.run([*CMBS, "schema", "--turn"], capture_output=True, text=True, check=True)
    assert json.loads(turn.stdout)["title"] == "Turn"
