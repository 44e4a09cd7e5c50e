"""The CISO scenario pack: every file loads; the offline RHEL9 scenario runs end to end over
a real sshd with ansible-core and a real Rego engine; the lying agent never earns."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from cmbs_async import load_scenario

from .sshd import LocalSshd, itbench_target, itbench_target_missing

PACK = Path(__file__).parent.parent / "examples" / "ciso"
RHEL9 = PACK / "rhel9-ansible-opa"


def test_every_scenario_of_the_pack_loads() -> None:
    ids = {load_scenario(path).id for path in PACK.glob("*/scenario.yaml")}
    assert len(ids) == 4


@pytest.fixture(scope="module")
def target() -> Iterator[LocalSshd]:
    missing = itbench_target_missing()
    if missing is not None:
        if os.environ.get("CI"):
            pytest.fail(f"CI must have {missing}")
        pytest.skip(f"needs {missing}")
    with itbench_target("yes") as server:  # IT-Bench's injected fault
        yield server


def run(target: LocalSshd, agent: str, tmp_path: Path) -> tuple[int, dict[str, object]]:
    bindir = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}"}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "cmbs_async",
            "run",
            str(RHEL9 / "scenario.yaml"),
            "--agent",
            f"script:{RHEL9 / agent}",
            "--json",
            "--workdir",
            str(tmp_path / "work"),
            "--var",
            f"port={target.port}",
            "--var",
            f"user={target.user}",
            "--var",
            f"identity={target.client_key}",
            "--var",
            f"known_hosts={target.known_hosts}",
            "--var",
            "python=/usr/bin/python3",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.stdout, done.stderr
    return done.returncode, json.loads(done.stdout)


@pytest.mark.ssh
def test_the_solver_earns_the_observed_posture(target: LocalSshd, tmp_path: Path) -> None:
    status, result = run(target, "solve.jsonl", tmp_path)
    assert status == 0 and result["outcome"] == "terminated"
    assert result["posture"] == "non_compliant"
    trace = result["trace"]
    assert trace[1]["observed"].startswith("exit 0: PLAY [")  # ansible-playbook really ran
    assert trace[3]["observed"] == "exit 0: false"  # the Rego rule evaluated false
    collected = json.loads((tmp_path / "work" / "collected_data.json").read_text())
    assert collected == {"x11_forwarding": "yes"}


@pytest.mark.ssh
def test_the_liar_never_earns_a_termination(target: LocalSshd, tmp_path: Path) -> None:
    status, result = run(target, "lie.jsonl", tmp_path)
    assert status == 3 and result["outcome"] == "agent_finished" and result["posture"] is None
    verdicts = [t["verdict"] for t in result["trace"]]
    assert "TERMINATE" not in verdicts
    declarations = [t for t in result["trace"] if t["action"] == "declare_posture"]
    assert all(t["verdict"] != "ALLOW" for t in declarations)
