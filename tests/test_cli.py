"""The command line as users and scripts meet it: real processes, real exit codes."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from .helpers import CMBS, step


def cmbs(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CMBS, *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=cwd,
    )


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_demo_shows_the_gate_at_work(backend: str) -> None:
    done = cmbs("demo", "--backend", backend)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].split() == ["step", "action", "verdict", "message", "observed"]
    assert "Posture declaration not permitted without successful execution." in lines[2]
    assert "Termination accepted." in done.stdout
    assert "outcome   terminated (earned)" in done.stdout
    assert "posture   non_compliant" in done.stdout
    assert done.stderr == ""


def test_demo_json_contract() -> None:
    done = cmbs("demo", "--json")
    assert done.returncode == 0
    result = json.loads(done.stdout)
    assert set(result) >= {
        "scenario_id",
        "outcome",
        "posture",
        "steps",
        "verdicts",
        "duration_s",
        "trace",
    }
    assert result["outcome"] == "terminated" and result["posture"] == "non_compliant"
    assert result["verdicts"] == {"allow": 7, "block": 3, "continue": 1, "terminate": 1}
    printed = result["trace"][7]  # `echo true` ran, and earned no posture
    assert printed["observed"] == "exit 0: true" and result["trace"][8]["verdict"] == "BLOCK"
    assert result["trace"][9]["observed"] == "exit 0: false"  # cmbs-opa evaluated the policy
    assert set(result["trace"][0]) >= {"step", "action", "verdict", "message"}


@pytest.fixture
def scenario(tmp_path: Path) -> Path:
    path = tmp_path / "scenario.yaml"
    path.write_text("id: cli-test\ngoal: say hello\ndeadline_s: 20\n")
    return path


def test_run_a_scenario_file_that_does_not_earn_termination(scenario: Path, tmp_path: Path) -> None:
    steps = tmp_path / "steps.jsonl"
    steps.write_text(
        "\n".join(
            [
                step("check_status", {"command": "echo true"}),
                "not json at all",
                step("terminate", evidence="successful"),
            ]
        )
        + "\n"
    )
    done = cmbs("run", str(scenario), "--agent", f"script:{steps}", "--json", "--max-steps", "10")
    assert done.returncode == 3, done.stderr
    result = json.loads(done.stdout)
    assert result["outcome"] == "agent_finished"
    assert [t["verdict"] for t in result["trace"]] == ["ALLOW", "CONTINUE", "BLOCK"]
    assert result["posture"] is None


def test_run_overrides_the_deadline(scenario: Path, tmp_path: Path) -> None:
    steps = tmp_path / "steps.jsonl"
    steps.write_text(step("check_status", {"command": "sleep 30"}) + "\n")
    done = cmbs("run", str(scenario), "--agent", f"script:{steps}", "--deadline", "0.5", "--json")
    assert done.returncode == 3
    assert json.loads(done.stdout)["outcome"] == "deadline_exceeded"


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("id: x\ngoal: g\ncolour: blue\n", "colour: not a field here"),
        ("id: x\ngoal: g\ndeadline: 30\n", "deadline: not a field here (did you mean deadline_s?)"),
        ("id: x\n", "goal: Field required"),
        ("id: [unclosed\n", "not valid YAML"),
        ("- a list\n", "must be a mapping"),
        ("id: x\ngoal: g\ndeadline_s: -1\n", "deadline_s: Input should be greater than 0"),
        ("id: x\ngoal: g\nprofile: nonesuch\n", "nonesuch' (built-in: ciso"),
    ],
)
def test_an_invalid_scenario_file_is_one_line_and_exit_2(
    tmp_path: Path, content: str, message: str
) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(content)
    steps = tmp_path / "s.jsonl"
    steps.write_text("")
    done = cmbs("run", str(path), "--agent", f"script:{steps}")
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and message in done.stderr
    assert "Traceback" not in done.stderr and done.stdout == ""


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--agent", "script:/nonexistent.jsonl"], "/nonexistent.jsonl: cannot read"),
        (["--agent", "wizard:gpt"], "expected script:STEPS.jsonl, stdio:COMMAND or openai"),
        (["--agent", "openai:gpt"], "expected openai:MODEL@http(s)://"),
        (["--agent", "script:SCENARIO", "--var", "novalue"], "expected NAME=VALUE"),
        (["--agent", "script:SCENARIO", "--executor", "cloud"], "expected local"),
        (
            ["--agent", "script:SCENARIO", "--executor", "ssh://u@h", "--backend", "trio"],
            "needs --backend asyncio",
        ),
        (["--agent", "script:SCENARIO", "--executor", "ssh://u@h:x"], "port is not a number"),
        (
            ["--agent", "script:SCENARIO", "--executor", "ssh://u@h", "--identity", "/no/key"],
            "no such file: /no/key",
        ),
        (["--agent", "script:x", "--deadline", "soon"], "not a number: 'soon'"),
        ([], "the following arguments are required: --agent"),
    ],
)
def test_usage_errors_are_one_line_and_exit_2(
    scenario: Path, args: list[str], message: str
) -> None:
    done = cmbs("run", str(scenario), *(a.replace("SCENARIO", str(scenario)) for a in args))
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and message in done.stderr


def test_missing_scenario_file(tmp_path: Path) -> None:
    done = cmbs("run", str(tmp_path / "nope.yaml"), "--agent", "script:x")
    assert done.returncode == 2 and "cannot read: No such file or directory" in done.stderr


def test_schema_prints_the_agent_step_schema() -> None:
    done = cmbs("schema")
    assert done.returncode == 0
    schema = json.loads(done.stdout)
    variants = schema["$defs"]["Action"]["oneOf"]
    assert {v["properties"]["type"]["const"] for v in variants} >= {"declare_posture", "terminate"}


def test_json_logs_go_to_stderr_only() -> None:
    done = cmbs("demo", "--json", "--log-level", "info", "--log-format", "json")
    assert done.returncode == 0
    json.loads(done.stdout)
    events = [json.loads(line) for line in done.stderr.splitlines()]
    assert {e["event"] for e in events} >= {"scenario.started", "gate.verdict", "scenario.finished"}
    assert all(e["scenario_id"] == "demo-sshd-x11-forwarding" for e in events)


def test_the_audit_commands_read_the_database_runs_record_into_by_default() -> None:
    """No path to type: ``audit show``, ``show SESSION``, ``verify`` and ``replay SESSION``
    read the default database, the one ``cmbs demo`` just recorded into."""
    assert cmbs("demo").returncode == 0
    listed = cmbs("audit", "show")
    assert listed.returncode == 0, listed.stderr
    session = listed.stdout.splitlines()[-1].split()[0]
    shown = cmbs("audit", "show", session[:8])
    assert shown.returncode == 0 and "declare_posture  BLOCK" in shown.stdout, shown.stderr
    verified = cmbs("audit", "verify")
    assert verified.returncode == 0 and "intact" in verified.stdout, verified.stderr
    replayed = cmbs("replay", session[:8])
    assert replayed.returncode == 0 and "identical" in replayed.stdout, replayed.stderr
    missing = cmbs("audit", "show", "elsewhere/audit.db")
    assert (missing.returncode, missing.stderr.count("\n")) == (2, 1)


def test_a_run_that_ended_before_its_first_step_shows_no_empty_table(tmp_path: Path) -> None:
    scenario = tmp_path / "s.yaml"
    scenario.write_text("id: quiet\ngoal: g\n")
    done = cmbs("run", str(scenario), "--agent", "stdio:true", "--no-audit")
    assert done.returncode == 3, done.stderr
    assert done.stdout.startswith("scenario  quiet\n") and "action" not in done.stdout
