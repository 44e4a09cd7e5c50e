"""The agent program in a sandbox of its own, attacked as a hostile agent would: it tries to
plant a program on the operator's PATH, read the signing key, the audit database, the
operator's environment and root-only files, write to the audit log and into workdirs,
and reach the supervisor; then the host is checked."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from executors.sandbox import FRESH_UIDS

from .helpers import CMBS, processes_with, unique_seconds

HOSTILE = r"""
import json, os, signal, sqlite3, sys
sys.stdin.readline()
tried = {}
def attempt(name, action):
    try:
        action()
        tried[name] = "DONE"
    except Exception as exc:
        tried[name] = type(exc).__name__
def plant():
    for where in os.environ["PATH"].split(":"):
        with open(os.path.join(where, "opa"), "w") as handle:
            handle.write("#!/bin/sh\necho true\n")
attempt("plant on PATH", plant)
attempt("read the key", lambda: open(sys.argv[1], "rb").read(1) or 1 / 0)
attempt("read the database", lambda: open(sys.argv[2], "rb").read(1) or 1 / 0)
def append():
    db = sqlite3.connect(sys.argv[2])
    db.execute("insert into sessions values ('forged', 'x', 'x')")
    db.commit()
attempt("append to the database", append)
attempt("read /etc/shadow", lambda: open("/etc/shadow").read(1))
attempt("list the workdirs", lambda: os.listdir(sys.argv[3]) and None or 1 / 0)
attempt("write /tmp outside", lambda: open(sys.argv[4] + "/x", "w").write("x"))
attempt("signal the supervisor", lambda: os.kill(int(sys.argv[5]), signal.SIGSTOP))
secrets = [name for name in os.environ if "KEY" in name or name.startswith("CMBS_")]
tried["environment"] = ",".join(sorted(secrets)) or "clean"
tried["uid"] = os.getuid()
print("REPORT " + json.dumps(tried), file=sys.stderr)
sys.exit(3)
"""


def test_a_hostile_agent_program_reaches_nothing_of_the_operators(tmp_path: Path) -> None:
    key, db = tmp_path / "keys" / "signing_key", tmp_path / "audit.db"
    root, outside = tmp_path / "workdirs", tmp_path / "outside"
    outside.mkdir(mode=0o777)
    outside.chmod(0o777)  # even a world-writable directory of the host stays unwritten
    scenario = tmp_path / "s.yaml"
    scenario.write_text("id: hostile\ngoal: g\ndeadline_s: 60\nworkdir: w\n")
    agent = tmp_path / "hostile.py"
    agent.write_text(HOSTILE)
    mark = unique_seconds()
    first = subprocess.run(  # makes the key and the database the agent then goes after
        [*CMBS, "run", str(scenario), "--agent", "stdio:true", "--audit-db", str(db)]
        + ["--signing-key", str(key), "--workdir-root", str(root)],
        capture_output=True,
        text=True,
    )
    assert first.returncode == 3, first.stderr
    before = (key.read_bytes(), db.read_bytes())
    env = os.environ | {"OPENAI_API_KEY": "sk-operator", "CMBS_REVIEWER_API_KEY": "sk-review"}
    command = f"stdio:{sys.executable} {agent} {key} {db} {root} {outside} {os.getpid()} {mark}"
    done = subprocess.run(
        [*CMBS, "run", str(scenario), "--agent", command, "--audit-db", str(db)]
        + ["--signing-key", str(key), "--workdir-root", str(root), "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    result = json.loads(done.stdout)
    assert result["outcome"] == "agent_error"
    found = re.search(r"REPORT (\{.*?\})", result["reason"])
    assert found, result["reason"]
    report = json.loads(found.group(1))
    assert report.pop("environment") == "clean"
    assert report.pop("uid") in FRESH_UIDS  # a user of its own, owning nothing here
    assert "DONE" not in report.values(), report
    # and on the host: nothing planted, nothing written, the record intact
    for where in os.environ["PATH"].split(os.pathsep):
        assert not os.path.exists(os.path.join(where, "opa")) or where.startswith("/usr/local/go")
    assert list(outside.iterdir()) == []
    assert key.read_bytes() == before[0]
    verify = subprocess.run(
        [*CMBS, "audit", "verify", str(db), "--signing-key", str(key)],
        capture_output=True,
        text=True,
    )
    assert verify.returncode == 0, verify.stdout + verify.stderr
    assert processes_with(str(mark)) == []


@pytest.mark.parametrize("missing", ["--agent-env NOT_SET_ANYWHERE", "--agent-env 'a b'"])
def test_an_agent_variable_that_cannot_be_given_is_one_line(tmp_path: Path, missing: str) -> None:
    scenario = tmp_path / "s.yaml"
    scenario.write_text("id: s\ngoal: g\n")
    option, value = missing.split(" ", 1)
    done = subprocess.run(
        [*CMBS, "run", str(scenario), "--agent", "stdio:true", "--no-audit", option]
        + [value.strip("'")],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "--agent-env" in done.stderr
    assert "Traceback" not in done.stderr


SIBLING = """import json, pathlib, sys
helper = pathlib.Path(__file__).with_name("helper.txt").read_text()  # not named: not shown
for line in sys.stdin:
    print(json.dumps({"belief": {"affordances": {}, "posture": "unknown", "evidence": "none"},
                      "action": {"type": "terminate", "payload": {}}}), flush=True)
    break
"""


def test_an_agent_that_cannot_see_its_own_files_is_told_why(tmp_path: Path) -> None:
    """The commonest surprise of the agent's sandbox: a file beside the program, not
    given. The failure says what the sandbox shows; --agent-readable fixes it."""
    scenario = tmp_path / "s.yaml"
    scenario.write_text("id: s\ngoal: g\ndeadline_s: 60\n")
    code = tmp_path / "code"
    code.mkdir()
    (code / "agent.py").write_text(SIBLING)
    (code / "helper.txt").write_text("help\n")
    command = [*CMBS, "run", str(scenario), "--agent", f"stdio:{sys.executable} {code}/agent.py"]
    done = subprocess.run(
        [*command, "--no-audit", "--json"], capture_output=True, text=True, timeout=120
    )
    result = json.loads(done.stdout)
    assert result["outcome"] == "agent_error"
    assert "FileNotFoundError" in result["reason"]
    assert "--agent-readable" in result["reason"]
    given = subprocess.run(
        [*command, "--no-audit", "--json", "--agent-readable", str(code)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    ran = json.loads(given.stdout)
    assert ran["outcome"] != "agent_error" and ran["steps"] > 0, ran["reason"]
