"""What the command line says, before anything runs, about a containment it cannot give:
one line on stderr, exit 2, no traceback, and nothing made."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from .helpers import CMBS


def cmbs(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CMBS, *args], capture_output=True, text=True, timeout=120)


@pytest.fixture
def scenario(tmp_path: Path) -> Path:
    path = tmp_path / "s.yaml"
    path.write_text("id: s\ngoal: g\nfiles: {a.txt: hello}\n")
    return path


@pytest.mark.parametrize(
    ("options", "said"),
    [
        (["--workdir-root", "/usr/local/cmbs"], "the workdir root cannot be /usr/local/cmbs"),
        (["--workdir-root", "/"], "the workdir root cannot be /"),
        (["--sandbox-user", "no-such-user-here"], "no such user: no-such-user-here"),
        (["--sandbox-user", "root"], "commands cannot run as root"),
        (["--agent-network", "example.com"], "--agent-network 'example.com'"),
        (["--agent-env", "NOT_SET_ANYWHERE_HERE"], "not set in this environment"),
        (["--agent-readable", "/etc/shadow"], "the host's own credentials stay unreadable"),
        (["--agent-readable", "/nonexistent/x"], "no such file or directory"),
    ],
)
def test_a_containment_that_cannot_be_given_is_one_line(
    scenario: Path, options: list[str], said: str
) -> None:
    done = cmbs("run", str(scenario), "--agent", "stdio:true", "--no-audit", *options)
    assert done.returncode == 2, done.stderr
    assert said in done.stderr
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr


def test_a_scenario_workdir_outside_the_root_is_refused_and_nothing_is_touched(
    tmp_path: Path,
) -> None:
    scenario = tmp_path / "etc.yaml"
    scenario.write_text("id: s\ngoal: g\nworkdir: /etc\nfiles: {passwd: owned}\n")
    before = Path("/etc").stat()
    done = cmbs("run", str(scenario), "--agent", "stdio:true", "--no-audit")
    assert done.returncode == 2
    assert "workdir /etc is outside the workdir root" in done.stderr
    after = Path("/etc").stat()
    assert (after.st_uid, after.st_mode) == (before.st_uid, before.st_mode)


def test_a_relative_workdir_lies_under_the_named_root_and_is_kept(
    tmp_path: Path, scenario: Path
) -> None:
    scenario.write_text("id: s\ngoal: g\nworkdir: w\nfiles: {a.txt: hello}\n")
    root = tmp_path / "root"
    done = cmbs(
        "run", str(scenario), "--agent", "stdio:true", "--no-audit", "--json",
        "--workdir-root", str(root),
    )  # fmt: skip
    result = json.loads(done.stdout)
    assert result["workdir"] == str(root / "w")
    assert (root / "w" / "a.txt").read_text() == "hello"
    assert result["containment"]["sandbox"] == "bwrap"
    assert all(check["held"] for check in result["containment"]["canary"])
