"""The command line's one wiring, tried as a careless operator and a hostile agent would:
a label no database can hold, a shared profile changed behind a run's back, ``--head-out``
aimed at the record itself, and usage mistakes that must leave nothing behind."""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
from pathlib import Path

import pytest

from cmbs_async import CallableAgent, RunConfig, ScenarioSpec, Turn, run_scenario
from cmbs_async.profile import load_profile
from executors.ssh import SSHTarget

from .helpers import cmbs, one_line_exit_2, step

LIE = [step("declare_posture", {"posture": "compliant"}, posture="compliant")]


def scenario(folder: Path, name: str = "a") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.yaml"
    path.write_text(json.dumps({"id": name, "goal": "g", "deadline_s": 60}))
    return path


def script(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_an_agent_spec_that_is_not_utf8_runs_and_is_recorded(tmp_path: Path) -> None:
    """A steps file whose name is not UTF-8 (a file name may be any bytes): its label is
    recorded escaped, and the run is in the database under the session it names."""
    steps = Path(os.fsdecode(bytes(tmp_path) + b"/lie\xff.jsonl"))
    script(steps, LIE)
    db = tmp_path / "audit.db"
    done = cmbs(
        "run",
        str(scenario(tmp_path / "pack")),
        "--agent",
        os.fsencode(f"script:{steps}"),
        "--audit-db",
        str(db),
        "--signing-key",
        str(tmp_path / "key"),
        "--json",
    )
    assert "Traceback" not in done.stderr
    if done.returncode == 2:  # refused in one line: fine too
        assert len(done.stderr.strip().splitlines()) == 1
        return
    result = json.loads(done.stdout)
    assert result["outcome"] != "audit_error", result["reason"]
    with sqlite3.connect(db) as connection:
        sessions = {row[0] for row in connection.execute("SELECT session_id FROM records")}
    assert result["session_id"] in sessions


@pytest.mark.anyio
async def test_a_configurations_profile_changed_changes_no_other_run() -> None:
    """A library user trims one configuration's profile for an experiment: a plain
    ``RunConfig()`` run still has the whole built-in profile (each load is a copy)."""
    variant = RunConfig(profile=load_profile("ciso"))
    assert variant.profile is not None
    variant.profile.actions.pop("generate_script")

    async def agent(turn: Turn) -> str | None:
        if turn.step == 1:
            return step("generate_script", {"path": "a.sh", "content": "echo hi\n"})
        return None

    result = await run_scenario(
        ScenarioSpec(id="plain", goal="g", deadline_s=60),
        agent=CallableAgent(agent),
        config=RunConfig(),
    )
    assert result.trace[0].verdict.value == "ALLOW", result.trace[0].observed


def _demo_then(
    tmp_path: Path, target: str
) -> tuple[Path, Path, bytes, subprocess.CompletedProcess[str]]:
    db, key = tmp_path / "audit.db", tmp_path / "key"
    env = dict(os.environ, XDG_DATA_HOME=str(tmp_path / "data"))
    first = cmbs("demo", "--audit-db", str(db), "--signing-key", str(key), env=env)
    assert first.returncode == 0, first.stderr
    kept = key.read_bytes()
    head = {"db": db, "key": key}[target]
    done = cmbs(
        "demo", "--audit-db", str(db), "--signing-key", str(key), "--head-out", str(head), env=env
    )
    return db, key, kept, done


@pytest.mark.parametrize("target", ["db", "key"])
def test_head_out_never_replaces_the_audit_db_or_the_signing_key(
    tmp_path: Path, target: str
) -> None:
    """``--head-out`` naming the audit database or the signing key is refused in one line:
    the record and the operator's key stay as they were."""
    db, key, kept, done = _demo_then(tmp_path, target)
    assert key.read_bytes() == kept, "the signing key was replaced"
    # read as cmbs reads it (a plain sqlite3 connection would checkpoint the WAL into
    # the replaced file and hide the damage)
    verified = cmbs("audit", "verify", str(db), "--signing-key", str(key))
    assert verified.returncode == 0 and "intact" in verified.stdout, verified.stderr
    one_line_exit_2(done)


def test_itbench_run_with_a_bad_key_leaves_no_dir_behind(tmp_path: Path) -> None:
    """A bad signing key stops ``itbench run`` before DIR is laid out (the scenario data,
    the target's SSH key): fixed, the same command is not refused for a DIR in use."""
    if shutil.which("ansible-playbook") is None:
        pytest.skip("needs ansible-playbook on PATH (the ciso extra)")
    from .test_itbench import RHEL9_GOAL

    data = tmp_path / "data.json"
    ini = '[rhel9_servers]\nrhel9 ansible_host="192.0.2.1"\n'
    data.write_text(
        json.dumps(
            {"goal_template": RHEL9_GOAL, "vars": {"ansible_ini": ini, "ansible_user_key": "k"}}
        )
    )
    bad = tmp_path / "badkey"
    bad.write_text("not a key\n")
    bad.chmod(0o600)
    steps = script(tmp_path / "steps.jsonl", [step("terminate")])
    workdir = tmp_path / "runs" / "w"
    args = ["itbench", "run", str(data), "--workdir", str(workdir), "--agent", f"script:{steps}"]
    done = cmbs(*args, "--signing-key", str(bad), "--audit-db", str(tmp_path / "audit.db"))
    one_line_exit_2(done)
    assert not workdir.exists() or not any(workdir.iterdir()), sorted(
        p.name for p in workdir.iterdir()
    )
    again = cmbs(
        *args, "--signing-key", str(tmp_path / "good"), "--audit-db", str(tmp_path / "audit.db")
    )
    assert "not an empty directory" not in again.stderr, again.stderr


def test_an_ssh_port_of_zero_is_refused_not_port_22() -> None:
    """``ssh://u@h:0`` (a template's empty port, say) is refused, not taken as port 22:
    commands must run where the scenario says or nowhere."""
    with pytest.raises(ValueError):
        SSHTarget.parse("ssh://u@h:0")


@pytest.mark.parametrize("mistake", ["key", "db", "otel"])
def test_a_usage_mistake_of_mcp_leaves_no_workdir_root(tmp_path: Path, mistake: str) -> None:
    """A bad signing key, audit database or ``--otel-endpoint`` stops ``cmbs mcp`` before
    it makes its executor: no temporary ``cmbs-workdirs-*`` root is left behind."""
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    spec = tmp_path / "s.json"
    spec.write_text(json.dumps({"id": "w", "goal": "g", "deadline_s": 60, "workdir": "named"}))
    bad = tmp_path / "badkey"
    bad.write_text("not a key\n")
    bad.chmod(0o600)
    given = {
        "key": ["--signing-key", str(bad)],
        "db": ["--audit-db", str(tmp_path)],  # a directory
        "otel": ["--otel-endpoint", "ftp://collector"],
    }[mistake]
    env = dict(os.environ, TMPDIR=str(temporary))
    done = cmbs("mcp", str(spec), *given, env=env)
    one_line_exit_2(done)
    assert sorted(p.name for p in temporary.iterdir()) == []
