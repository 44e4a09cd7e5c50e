"""IT-Bench's programs where commands run: a missing evaluator is no verdict (``cannot
score``, exit 2), never the agent's ``fail``; ``itbench run`` refuses to start without
the kind's programs; every host of the laid-out inventory uses ``user_key``; the example
scenario data file loads and runs up to where it needs a target.

The PATH without a program is real: the CLI runs as a subprocess of an interpreter whose
own scripts directory (which cmbs puts on PATH for ``cmbs-opa``) lacks it too."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from cmbs_async.itbench import (
    Kind,
    guess_kind,
    load_scenario_data,
    prepare_workdir,
    with_key_file,
)

from .helpers import CMBS, needs_ansible

EXAMPLE = Path(__file__).parent.parent / "examples" / "itbench" / "scenario_data.json"
BIN = Path(sys.executable).parent
#: What the evaluator runs, per kind: none of it may be on the bare PATH.
TOOLS = ("ansible-playbook", "kubectl", "opa", "cmbs-opa")
GOAL = "Check with an Ansible playbook and a Rego policy. The inventory: {{ path_to_inventory }}."


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An interpreter that imports cmbs (this environment's packages, by a ``.pth``) but
    whose scripts directory holds none of the tools."""
    folder = tmp_path_factory.mktemp("bare") / "venv"
    venv.EnvBuilder(with_pip=False).create(folder)
    python = folder / "bin" / "python"
    found = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        capture_output=True,
        text=True,
        check=True,
    )
    here = subprocess.run(
        [sys.executable, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        capture_output=True,
        text=True,
        check=True,
    )
    Path(found.stdout.strip(), "cmbs-test.pth").write_text(here.stdout.strip() + "\n")
    return python


def bare_path(folder: Path, *programs: str) -> str:
    """A PATH of one directory: links to ``programs`` (and to bwrap, where it is, so the
    sandbox is what it would be) and nothing else."""
    folder.mkdir(exist_ok=True)
    for name in (*programs, "bwrap"):
        real = shutil.which(name, path=f"{BIN}{os.pathsep}{os.environ['PATH']}")
        if real is not None:
            (folder / name).symlink_to(real)
    assert not [t for t in TOOLS if t not in programs and (folder / t).exists()]
    return str(folder)


def cmbs_bare(
    python: Path, path: str, *args: str, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PATH": path}
    return subprocess.run(
        [str(python), "-m", "cmbs_async", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=cwd,
    )


def agent_workdir(tmp_path: Path, *files: str) -> Path:
    """What an agent left: a collector and a policy (never run here)."""
    workdir = tmp_path / "case" / "agent"
    workdir.mkdir(parents=True)
    for name in files:
        (workdir / name).write_text("- hosts: all\n" if name == "playbook.yml" else "x\n")
    (workdir / "policy.rego").write_text("package check\n\ndefault result := false\n")
    return workdir


def test_evaluate_without_ansible_playbook_cannot_score(bare_python: Path, tmp_path: Path) -> None:
    workdir = agent_workdir(tmp_path, "playbook.yml")
    inventory = tmp_path / "case" / "evaluator.ini"
    inventory.write_text("[rhel9_servers]\nrhel9 ansible_host=192.0.2.1\n")
    done = cmbs_bare(
        bare_python,
        bare_path(tmp_path / "bin"),
        "itbench",
        "evaluate",
        str(workdir),
        "--inventory",
        str(inventory),
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines()[-1].startswith(
        "cmbs itbench: cannot score: ansible-playbook not found"
    ), done.stderr
    assert "fail" not in done.stdout + done.stderr and done.stdout == ""
    assert not (workdir / "evaluation.json").exists()  # no verdict is written


def test_evaluate_without_kubectl_cannot_score(bare_python: Path, tmp_path: Path) -> None:
    workdir = agent_workdir(tmp_path, "script.sh")
    kubeconfig = tmp_path / "case" / "evaluator.yaml"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\nclusters: [{name: k, cluster: {server: 'https://192.0.2.1'}}]\n"
    )
    done = cmbs_bare(
        bare_python,
        bare_path(tmp_path / "bin"),
        "itbench",
        "evaluate",
        str(workdir),
        "--kubeconfig",
        str(kubeconfig),
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines()[-1].startswith("cmbs itbench: cannot score: kubectl not found")
    assert not (workdir / "evaluation.json").exists()


def test_evaluate_without_opa_or_cmbs_opa_cannot_score(bare_python: Path, tmp_path: Path) -> None:
    if shutil.which("ansible-playbook", path=f"{BIN}{os.pathsep}{os.environ['PATH']}") is None:
        if os.environ.get("CI"):
            pytest.fail("CI must have ansible-core")
        pytest.skip("needs ansible-core (the ciso extra)")
    workdir = agent_workdir(tmp_path, "playbook.yml")
    inventory = tmp_path / "case" / "evaluator.ini"
    inventory.write_text("[rhel9_servers]\nrhel9 ansible_host=192.0.2.1\n")
    path = bare_path(tmp_path / "bin", "ansible-playbook")
    args = ["itbench", "evaluate", str(workdir), "--inventory", str(inventory)]
    # unsandboxed: a program under /tmp (this test's PATH) is one commands can run
    done = cmbs_bare(bare_python, path, *args, "--sandbox", "none")
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines()[-1].startswith(
        "cmbs itbench: cannot score: opa or cmbs-opa not found"
    ), done.stderr
    named = cmbs_bare(bare_python, path, *args, "--sandbox", "none", "--opa", "/nowhere/opa")
    assert named.returncode == 2
    assert "cannot score: /nowhere/opa not found" in named.stderr.splitlines()[-1]
    assert not (workdir / "evaluation.json").exists()


def test_itbench_run_refuses_to_start_without_the_kinds_programs(
    bare_python: Path, tmp_path: Path
) -> None:
    data = tmp_path / "data.json"
    vars_ = {"ansible_ini": "[rhel9_servers]\nrhel9 ansible_host=192.0.2.1\n"}
    data.write_text(json.dumps({"goal": GOAL, "vars": vars_ | {"ansible_user_key": "k"}}))
    steps = tmp_path / "steps.jsonl"
    steps.write_text("")
    workdir = tmp_path / "runs" / "agent"
    done = cmbs_bare(
        bare_python,
        bare_path(tmp_path / "bin"),
        "itbench",
        "run",
        str(data),
        "--workdir",
        str(workdir),
        "--agent",
        f"script:{steps}",
        "--no-audit",
    )
    assert done.returncode == 2, done.stderr
    [line] = [ln for ln in done.stderr.splitlines() if "warning" not in ln]
    assert line.startswith("cmbs itbench: error: ansible-playbook not found"), line
    assert "rhel9-ansible-opa" in line
    assert not (tmp_path / "runs").exists()  # nothing was made


def ansible_inventory_vars(inventory: Path) -> dict[str, dict[str, object]]:
    """Each host's variables as Ansible itself reads the inventory."""
    program = shutil.which("ansible-inventory", path=f"{BIN}{os.pathsep}{os.environ['PATH']}")
    if program is None:
        if os.environ.get("CI"):
            pytest.fail("CI must have ansible-core")
        pytest.skip("needs ansible-core (the ciso extra)")
    done = subprocess.run(
        [program, "-i", str(inventory), "--list"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        env={**os.environ, "ANSIBLE_LOCAL_TEMP": str(inventory.parent / ".ansible-tmp")},
    )
    hostvars: dict[str, dict[str, object]] = json.loads(done.stdout)["_meta"]["hostvars"]
    return hostvars


def test_every_host_line_gets_the_user_key(tmp_path: Path) -> None:
    """A host line without a key file gets one (before its comment); one that names a
    key elsewhere is pointed at ``user_key``; a local host and the vars are left be."""
    ansible_ini = (
        "ungrouped-host ansible_host=192.0.2.3\n"
        "[rhel9_servers]\n"
        'rhel9 ansible_host="192.0.2.1" ansible_user=checker  # the target\n'
        "web[1:2] ansible_host=192.0.2.2 ansible_private_key_file=/tmp/agent/user_key\n"
        "; a comment\n"
        "here ansible_connection=local\n"
        "[rhel9_servers:vars]\n"
        "ansible_python_interpreter=/usr/bin/python3\n"
    )
    data = tmp_path / "data.json"
    data.write_text(
        json.dumps({"goal": GOAL, "vars": {"ansible_ini": ansible_ini, "ansible_user_key": "k"}})
    )
    workdir = tmp_path / "agent"
    prepare_workdir(load_scenario_data(data), workdir, kind=Kind.RHEL9_ANSIBLE_OPA)
    written = workdir / "ansible.ini"
    key = str(workdir / "user_key")
    assert f'rhel9 ansible_ssh_private_key_file="{key}" ansible_host' in written.read_text()
    hostvars = ansible_inventory_vars(written)
    for host in ("ungrouped-host", "rhel9", "web1", "web2"):
        own = hostvars[host]
        assert key in (
            own.get("ansible_ssh_private_key_file"),
            own.get("ansible_private_key_file"),
        ), (host, own)
    assert hostvars["rhel9"]["ansible_user"] == "checker"  # the comment stayed a comment
    assert "ansible_ssh_private_key_file" not in hostvars["here"]
    assert hostvars["rhel9"]["ansible_python_interpreter"] == "/usr/bin/python3"
    assert with_key_file(ansible_ini, key) == written.read_text()


def test_the_example_scenario_data_loads_and_runs_up_to_its_target(tmp_path: Path) -> None:
    needs_ansible()
    data = load_scenario_data(EXAMPLE)
    assert guess_kind(data.goal_template) is Kind.RHEL9_ANSIBLE_OPA
    assert "ansible_ssh_private_key_file" not in data.vars["ansible_ini"]
    steps = tmp_path / "steps.jsonl"
    belief = {"affordances": {}, "posture": "unknown", "evidence": "none"}
    action = {"type": "check_status", "payload": {"command": "grep -o 192.0.2.10 ansible.ini"}}
    steps.write_text(json.dumps({"belief": belief, "action": action}) + "\n")
    workdir = tmp_path / "agent"
    done = subprocess.run(
        [*CMBS, "itbench", "run", str(EXAMPLE), "--workdir", str(workdir)]
        + ["--agent", f"script:{steps}", "--json", "--no-audit", "--deadline", "60"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"},
    )
    assert done.stdout, done.stderr
    result = json.loads(done.stdout)
    assert result["outcome"] == "agent_finished", result
    [entry] = result["trace"]
    inventory = (workdir / "ansible.ini").read_text()
    assert f'ansible_ssh_private_key_file="{workdir}/user_key"' in inventory
    assert entry["observed"] == "exit 0: 192.0.2.10"  # the agent's command read it
    assert f"The inventory is at `{workdir}/ansible.ini`" in (workdir / "goal.txt").read_text()
