"""Every input gets a clear answer: one line and exit 2 for a mistake, never a traceback,
nothing left behind by a failed start, nothing silently ignored."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib import resources
from pathlib import Path

import pytest

from .helpers import CMBS, step

EXITS = {0, 2, 3}  # what docs/reference/cli.md lists for a run that was not interrupted


def cmbs(
    *args: str, cwd: Path | None = None, prefix: tuple[str, ...] = CMBS
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*prefix, *args], capture_output=True, text=True, timeout=120, cwd=cwd, check=False
    )


def one_line_error(done: subprocess.CompletedProcess[str], *said: str) -> None:
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
    for text in said:
        assert text in done.stderr


@pytest.fixture
def steps(tmp_path: Path) -> Path:
    path = tmp_path / "steps.jsonl"
    path.write_text(step("check_status", {"command": "echo out; echo why >&2; exit 4"}) + "\n")
    return path


def test_a_scenario_that_is_not_utf8(tmp_path: Path, steps: Path) -> None:
    scenario = tmp_path / "latin1.yaml"
    scenario.write_bytes(b"id: x\ngoal: caf\xe9\n")
    one_line_error(cmbs("run", str(scenario), "--agent", f"script:{steps}"), "not UTF-8 text")


def test_an_unknown_var_and_an_unfilled_placeholder_are_named(tmp_path: Path, steps: Path) -> None:
    scenario = tmp_path / "s.yaml"
    scenario.write_text("id: x\ngoal: 'reach {{ host }}'\nvars: {host: 127.0.0.1}\n")
    agent = f"script:{steps}"
    one_line_error(
        cmbs("run", str(scenario), "--agent", agent, "--no-audit", "--var", "hsot=10.0.0.9"),
        "no var 'hsot' (vars: host)",
    )
    scenario.write_text("id: x\ngoal: 'reach {{ hots }}'\nvars: {host: 127.0.0.1}\n")
    one_line_error(cmbs("run", str(scenario), "--agent", agent), "{{ hots }} in goal names no var")
    scenario.write_text("id: x\ngoal: g\nenv: {TARGET: '{{ nope }}'}\n")
    one_line_error(cmbs("run", str(scenario), "--agent", agent), "{{ nope }} in env")
    # in files, another tool's placeholder is left alone; a declared var is filled
    scenario.write_text(
        "id: x\ngoal: 'reach {{ host }}'\nvars: {host: h1}\n"
        "files: {play.yml: '{{ item }} on {{ host }}'}\n"
    )
    cat = tmp_path / "cat.jsonl"
    cat.write_text(step("check_status", {"command": "cat play.yml"}) + "\n")
    done = cmbs("run", str(scenario), "--agent", f"script:{cat}", "--no-audit", "--json")
    assert done.returncode == 3, done.stderr
    assert json.loads(done.stdout)["trace"][0]["stdout"] == "{{ item }} on h1"


@pytest.mark.parametrize("kind", ["junk", "passphrase"])
def test_an_unusable_identity_is_one_line(tmp_path: Path, steps: Path, kind: str) -> None:
    scenario = tmp_path / "s.yaml"
    scenario.write_text("id: x\ngoal: g\n")
    key = tmp_path / "id_key"
    if kind == "junk":
        key.write_bytes(os.urandom(300))
    else:
        subprocess.run(
            ["ssh-keygen", "-q", "-t", "ed25519", "-N", "secret", "-f", str(key)], check=True
        )
    done = cmbs(
        "run", str(scenario), "--agent", f"script:{steps}", "--no-audit",
        "--executor", "ssh://nobody@127.0.0.1:1", "--identity", str(key),
    )  # fmt: skip
    expected = "Invalid private key" if kind == "junk" else "Passphrase must be specified"
    one_line_error(done, f"--identity {key}: not a usable private key", expected)


def test_a_missing_backend_is_refused_and_leaves_nothing(tmp_path: Path, steps: Path) -> None:
    """trio made unimportable in a real CLI process: no traceback, no results file (which
    a retry would then refuse without --resume)."""
    no_trio = (
        sys.executable,
        "-c",
        "import sys; sys.modules['trio'] = None\n"
        "from cmbs_async.cli.main import main\n"
        "sys.exit(main(sys.argv[1:]))",
    )
    scenario = tmp_path / "s.yaml"
    scenario.write_text("id: x\ngoal: g\n")
    out = tmp_path / "results.jsonl"
    for command in (
        ["run", str(scenario), "--agent", f"script:{steps}", "--backend", "trio"],
        ["batch", str(scenario), "--agent", f"script:{steps}", "--backend", "trio"]
        + ["--out", str(out)],
    ):
        one_line_error(cmbs(*command, prefix=no_trio), "--backend trio needs trio")
    assert not out.exists()
    retried = cmbs("batch", str(scenario), "--agent", f"script:{steps}", "--out", str(out))
    assert retried.returncode == 3 and out.exists(), retried.stderr


def test_a_reader_that_goes_away_gets_no_traceback(tmp_path: Path, steps: Path) -> None:
    scenario = tmp_path / "s.yaml"
    scenario.write_text("id: x\ngoal: g\n")
    line = " ".join([*CMBS, "run", str(scenario), "--agent", f"script:{steps}", "--no-audit"])
    for _ in range(5):
        done = subprocess.run(
            ["bash", "-c", f"{line} --json | head -c 1 >/dev/null; echo ${{PIPESTATUS[0]}} >&2"],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert done.stderr.strip() == "3", done.stderr  # the run's own status, and no trace


def test_why_a_command_failed_is_in_the_json_trace_and_audit_show(
    tmp_path: Path, steps: Path
) -> None:
    scenario = tmp_path / "s.yaml"
    scenario.write_text("id: x\ngoal: g\n")
    db = tmp_path / "audit.db"
    done = cmbs("run", str(scenario), "--agent", f"script:{steps}", "--json", "--audit-db", str(db))
    assert done.returncode == 3, done.stderr
    result = json.loads(done.stdout)
    entry = result["trace"][0]
    assert (entry["observed"], entry["stdout"], entry["stderr"]) == (
        "exit 4: out",
        "out\n",
        "why\n",
    )
    shown = cmbs("audit", "show", str(db), result["session_id"], "--full")
    assert shown.returncode == 0, shown.stderr
    assert "step 1 stdout:\n  out\nstep 1 stderr:\n  why\n" in shown.stdout


def test_resume_knows_a_job_however_its_paths_are_spelt(tmp_path: Path, steps: Path) -> None:
    (tmp_path / "s.yaml").write_text("id: x\ngoal: g\n")
    out = tmp_path / "r.jsonl"
    first = cmbs(
        "batch", "s.yaml", "--agent", "script:steps.jsonl", "--agent", "script:./steps.jsonl",
        "--out", str(out), cwd=tmp_path,
    )  # fmt: skip
    assert first.returncode == 3, first.stderr
    assert len(out.read_text().splitlines()) == 1  # the same agent twice is one job
    again = cmbs(
        "batch", str(tmp_path / "s.yaml"), "--agent", f"script:{steps}", "--out", str(out),
        "--resume", cwd=tmp_path.parent,
    )  # fmt: skip
    assert again.returncode == 3, again.stderr
    assert "1 of 1 runs have results" in again.stdout and "(1 from before)" in again.stdout
    assert len(out.read_text().splitlines()) == 1


def test_a_relative_profile_is_found_beside_the_scenario(tmp_path: Path, steps: Path) -> None:
    """Run from elsewhere, and as a batch over the folder (the profile is not a scenario)."""
    folder = tmp_path / "pack"
    folder.mkdir()
    builtin = resources.files("cmbs_async") / "profiles" / "ciso.yaml"
    (folder / "mine.yaml").write_text(builtin.read_text())
    (folder / "s.yaml").write_text("id: x\ngoal: g\nprofile: ./mine.yaml\n")
    done = cmbs("run", str(folder / "s.yaml"), "--agent", f"script:{steps}", "--no-audit")
    assert done.returncode == 3, done.stderr
    out = tmp_path / "r.jsonl"
    batch = cmbs("batch", str(folder), "--agent", f"script:{steps}", "--out", str(out))
    assert batch.returncode == 3, batch.stderr
    assert [json.loads(line)["scenario_id"] for line in out.read_text().splitlines()] == ["x"]


def test_version_help_defaults_and_common_options_before_the_subcommand(
    tmp_path: Path, steps: Path
) -> None:
    version = cmbs("--version")
    assert version.returncode == 0 and version.stdout.startswith("cmbs ")
    for command in ("run", "batch", "demo"):
        shown = cmbs(command, "--help").stdout
        assert "(default: asyncio)" in shown and "(default: warning)" in shown
    assert "(default: 8)" in cmbs("batch", "--help").stdout
    scenario = tmp_path / "s.yaml"
    scenario.write_text("id: x\ngoal: g\n")
    done = cmbs(
        "--log-level", "info", "--log-format", "json",
        "run", str(scenario), "--agent", f"script:{steps}", "--no-audit",
    )  # fmt: skip
    assert done.returncode == 3
    events = [json.loads(line) for line in done.stderr.splitlines()]
    assert any(e["event"] == "gate.verdict" for e in events)


def test_a_nul_byte_in_a_command_is_a_failed_observation_and_the_run_goes_on(
    tmp_path: Path,
) -> None:
    scenario = tmp_path / "s.yaml"
    scenario.write_text("id: x\ngoal: g\n")
    lines = tmp_path / "nul.jsonl"
    lines.write_text(
        step("check_status", {"command": "echo a\x00b"})
        + "\n"
        + step("check_status", {"command": "echo after"})
        + "\n"
    )
    db, temporary = tmp_path / "audit.db", tmp_path / "tmp"
    temporary.mkdir()  # its own, so that no other run's workdirs are counted
    done = subprocess.run(
        [*CMBS, "run", str(scenario), "--agent", f"script:{lines}", "--json"]
        + ["--audit-db", str(db)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "TMPDIR": str(temporary)},
    )
    assert done.returncode == 3 and "Traceback" not in done.stderr, done.stderr
    result = json.loads(done.stdout)
    assert "cannot start the command" in result["trace"][0]["observed"]
    assert result["trace"][1]["stdout"] == "after\n"
    assert result["workdir"] is None and list(temporary.iterdir()) == []  # nothing left
    shown = cmbs("audit", "show", str(db), result["session_id"])
    assert "outcome  agent_finished" in shown.stdout
