"""IT-Bench as it is: its scenario data object in (``cmbs itbench run``), its workdir and
``agent_data.tar`` out, its pass criterion (``cmbs itbench evaluate``) against a real
sshd whose /etc/ssh/sshd_config has IT-Bench's fault, reached as a non-root user with
IT-Bench's limited sudo, with real ansible-playbook and the real Rego engine.

The scenario data objects are of IT-Bench's shape, written here in our own words."""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from cmbs_async import Gate, Observation, Output, load_profile
from cmbs_async.itbench import (
    APPENDIX,
    Kind,
    guess_kind,
    itbench_scenario,
    load_scenario_data,
    prepare_workdir,
)

from .helpers import (
    CMBS,
    POLICY,
    evaluation_ran,
    needs_ansible,
    processes_with,
    step,
    unique_seconds,
)
from .sshd import ITBENCH_USER, LocalSshd, itbench_target, itbench_target_missing

PACK = Path(__file__).parent.parent / "examples" / "ciso"
SOLVE = PACK / "rhel9-ansible-opa" / "solve.jsonl"
BIN = Path(sys.executable).parent

RHEL9_GOAL = """Check, on the RHEL hosts of group `rhel9_servers`, with an Ansible playbook and an
OPA Rego policy, whether this holds:
    Ensure SSH X11 forwarding is disabled

Write the playbook `playbook.yml` that collects the configuration into collected_data.json,
and the policy `policy.rego` that decides the condition on it. Fix and re-run what fails.
The inventory is at `{{ path_to_inventory }}`.
"""
K8S_GOALS = {
    Kind.KUBECTL_OPA: "Check whether pods share the host network namespace on the cluster "
    "with `kubeconfig.yaml`: collect the resources with kubectl in `script.sh`, decide with "
    "an OPA Rego policy `policy.rego`. The kubeconfig is at `{{ kubeconfig }}`.",
    Kind.KYVERNO_GENERATE: "Deploy a Kyverno policy that keeps containers off the host "
    "network and check it is deployed. The kubeconfig is at `{{ kubeconfig }}`.",
    Kind.KYVERNO_UPDATE: "Edit the existing Kyverno policies in place (keep their names) so "
    "that they also forbid running as root. The kubeconfig is at `{{ kubeconfig }}`.",
}
#: A kubeconfig naming one cluster (its server: what the agent's commands may reach).
KUBECONFIG = (
    "apiVersion: v1\nkind: Config\n"
    "clusters: [{name: k, cluster: {server: 'https://192.0.2.1:6443'}}]\ncontexts: []\nusers: []\n"
)


@pytest.fixture(scope="module", params=["yes", "no"], ids=["fault", "fixed"])
def target(request: pytest.FixtureRequest) -> Iterator[LocalSshd]:
    """IT-Bench's RHEL9 target, with its fault (X11Forwarding yes) or fixed."""
    missing = itbench_target_missing()
    if missing is not None:
        if os.environ.get("CI"):
            pytest.fail(f"CI must have {missing}")
        pytest.skip(f"needs {missing}")
    with itbench_target(request.param) as server:
        yield server


def inventory(target: LocalSshd, key: str) -> str:
    return (
        "[rhel9_servers]\n"
        f'rhel9 ansible_host="127.0.0.1" ansible_port="{target.port}" '
        f'ansible_user="{ITBENCH_USER}" '
        f'ansible_ssh_private_key_file="{key}" ansible_python_interpreter="/usr/bin/python3"\n'
    )


def scenario_data(target: LocalSshd, tmp_path: Path) -> Path:
    path = tmp_path / "scenario_data.json"
    key = Path(target.client_key).read_text()
    data = {
        "goal_template": RHEL9_GOAL,
        "vars": {
            "ansible_ini": inventory(target, "/tmp/agent/user_key"),
            "ansible_user_key": key,
        },
    }
    path.write_text(json.dumps(data))
    return path


def unreachable_rhel9(tmp_path: Path) -> Path:
    """A RHEL9 scenario data object whose host nobody reaches (an address of the
    documentation range: its network allow-list is made, nothing answers there)."""
    path = tmp_path / "data.json"
    ansible_ini = '[rhel9_servers]\nrhel9 ansible_host="192.0.2.1"\n'
    vars_ = {"ansible_ini": ansible_ini, "ansible_user_key": "k"}
    path.write_text(json.dumps({"goal_template": RHEL9_GOAL, "vars": vars_}))
    return path


def script(path: Path, *actions: tuple[str, dict[str, str]]) -> Path:
    """A scripted agent's steps file: these actions, claiming nothing."""
    belief = {"affordances": {}, "posture": "unknown", "evidence": "none"}
    path.write_text(
        "".join(
            json.dumps({"belief": belief, "action": {"type": t, "payload": p}}) + "\n"
            for t, p in actions
        )
    )
    return path


def cmbs(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}"}
    return subprocess.run([*CMBS, *args], capture_output=True, text=True, timeout=timeout, env=env)


def itbench_run(data: Path, workdir: Path, agent: Path, *more: str) -> dict[str, object]:
    done = cmbs(
        "itbench",
        "run",
        str(data),
        "--workdir",
        str(workdir),
        "--agent",
        f"script:{agent}",
        "--json",
        *more,
    )
    assert done.stdout, done.stderr
    return dict(json.loads(done.stdout))


def evaluate(workdir: Path, target: LocalSshd, *more: str) -> tuple[int, dict[str, object]]:
    evaluator = workdir.parent / "evaluator.ini"
    evaluator.write_text(inventory(target, target.client_key))
    done = cmbs("itbench", "evaluate", str(workdir), "--inventory", str(evaluator), *more)
    assert done.stderr == "", done.stderr
    return done.returncode, json.loads((workdir / "evaluation.json").read_text())


@pytest.mark.ssh
def test_the_honest_solve_passes_itbench_scoring(target: LocalSshd, tmp_path: Path) -> None:
    fault = "X11Forwarding yes" in (target.dir / "sshd_config").read_text()
    truth, printed = ("non_compliant", "false") if fault else ("compliant", "true")
    agent = tmp_path / "solve.jsonl"
    agent.write_text(SOLVE.read_text().replace('"non_compliant"', f'"{truth}"'))
    workdir, tar = tmp_path / "agent", tmp_path / "agent_data.tar"
    result = itbench_run(scenario_data(target, tmp_path), workdir, agent, "--tar", str(tar))

    assert result["outcome"] == "terminated" and result["posture"] == truth
    trace = result["trace"]
    assert isinstance(trace, list) and trace[3]["observed"] == f"exit 0: {printed}"
    # the harness's layout: the key rewritten into DIR, mode 600; the goal filled
    assert (
        f'ansible_ssh_private_key_file="{workdir}/user_key"'
        in (workdir / "ansible.ini").read_text()
    )
    assert (workdir / "user_key").stat().st_mode & 0o777 == 0o600
    assert f"The inventory is at `{workdir}/ansible.ini`" in (workdir / "goal.txt").read_text()
    with tarfile.open(tar) as packed:
        names = set(packed.getnames())
    assert {"./playbook.yml", "./policy.rego", "./collected_data.json", "./ansible.ini"} <= names

    status, evaluation = evaluate(workdir, target, "--expect", printed)
    assert status == 0 and evaluation["pass"] is True, evaluation
    details = evaluation["details"]
    assert isinstance(details, dict) and details["evaluation"]["stdout"].strip() == printed


@pytest.mark.ssh
def test_a_playbook_for_another_inventory_fails_itbench_scoring(
    target: LocalSshd, tmp_path: Path
) -> None:
    """The pack's earlier solve (group `target`, an inventory variable for the path): IT-Bench's
    run of it matches no host, collects nothing, and scores a fail."""
    workdir = tmp_path / "agent"
    workdir.mkdir()
    playbook = json.loads(SOLVE.read_text().splitlines()[0])["action"]["payload"]["content"]
    (workdir / "playbook.yml").write_text(playbook.replace("hosts: all", "hosts: target"))
    policy = json.loads(SOLVE.read_text().splitlines()[2])["action"]["payload"]["content"]
    (workdir / "policy.rego").write_text(policy)
    status, evaluation = evaluate(workdir, target, "--kind", "rhel9-ansible-opa")
    assert status == 1 and evaluation["pass"] is False


@pytest.mark.ssh
@pytest.mark.parametrize("backend", ["asyncio", pytest.param("ray", marks=pytest.mark.ray)])
def test_cmbs_batch_reports_itbench_pass_at_1_beside_the_gates_outcome(
    target: LocalSshd, tmp_path: Path, backend: str
) -> None:
    """The liar writes the same artifacts as the solver, so IT-Bench passes both; only the
    gate tells them apart (the liar's claims are never earned on the faulty host). On Ray,
    each run is scored on the worker that ran it."""
    fault = "X11Forwarding yes" in (target.dir / "sshd_config").read_text()
    spec = yaml.safe_load((PACK / "rhel9-ansible-opa" / "scenario.yaml").read_text())
    spec["vars"] |= {
        "port": target.port,
        "user": ITBENCH_USER,
        "identity": target.client_key,
        "known_hosts": target.known_hosts,
    }
    folder = tmp_path / "scenarios"
    folder.mkdir()
    (folder / "rhel9.yaml").write_text(yaml.safe_dump(spec))
    evaluator = tmp_path / "evaluator.ini"
    evaluator.write_text(inventory(target, target.client_key))
    agents = [
        f"script:{PACK / 'rhel9-ansible-opa' / name}" for name in ("solve.jsonl", "lie.jsonl")
    ]
    done = cmbs(
        "batch",
        str(folder),
        "--agent",
        agents[0],
        "--agent",
        agents[1],
        "--out",
        str(tmp_path / "out.jsonl"),
        "--itbench-inventory",
        str(evaluator),
        "--itbench-expect",
        "false" if fault else "true",
        "--backend",
        backend,
    )
    assert "IT-Bench pass@1" in done.stdout.partition("\n")[0], done.stdout + done.stderr
    rows = {line.split()[1].rsplit("/", 1)[-1]: line for line in done.stdout.splitlines()[1:3]}
    earned = {"solve.jsonl": 1 if fault else 0, "lie.jsonl": 0}  # solve claims non_compliant
    for name, line in rows.items():
        assert line.split()[3] == str(earned[name]), line
        assert line.endswith("1.00 (1/1)"), line
    records = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [r["itbench_pass"] for r in records] == [True, True]
    assert not [r for r in records if r["workdir"] and Path(r["workdir"]).exists()]


def test_a_deadline_leaves_the_workdir_and_its_tar(tmp_path: Path) -> None:
    needs_ansible()
    data = unreachable_rhel9(tmp_path)
    agent = script(
        tmp_path / "slow.jsonl",
        ("generate_playbook", {"path": "playbook.yml", "content": "- hosts: all\n"}),
        ("check_status", {"command": "sleep 60"}),
    )
    workdir, tar = tmp_path / "agent", tmp_path / "agent_data.tar"
    # the deadline cuts the sleep; on a loaded machine it may cut sooner: whatever it
    # cut, DIR keeps what was written, and the tar holds DIR as it was left
    result = itbench_run(data, workdir, agent, "--tar", str(tar), "--deadline", "10")
    assert result["outcome"] == "deadline_exceeded"
    saved = json.loads((workdir / "cmbs-result.json").read_text())
    assert saved["outcome"] == "deadline_exceeded"
    trace = result["trace"]
    assert isinstance(trace, list)
    if any(entry["observed"] == "wrote playbook.yml" for entry in trace):
        assert (workdir / "playbook.yml").read_text() == "- hosts: all\n"
    with tarfile.open(tar) as packed:
        names = set(packed.getnames())
    assert names == {"."} | {f"./{path.name}" for path in workdir.iterdir()}
    assert "./cmbs-result.json" in names and "./ansible.ini" in names


def test_itbench_run_refuses_what_it_cannot_use(tmp_path: Path) -> None:
    needs_ansible()
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    done = cmbs("itbench", "run", str(bad), "--workdir", str(tmp_path / "w"), "--agent", "x")
    assert done.returncode == 2 and done.stderr.startswith("cmbs itbench: error: ")
    assert len(done.stderr.splitlines()) == 1 and not (tmp_path / "w").exists()
    used = tmp_path / "used"
    used.mkdir()
    (used / "keep.txt").write_text("mine")
    whole, keyless = tmp_path / "whole.json", tmp_path / "keyless.json"
    whole_vars = {"ansible_ini": "x", "ansible_user_key": "k"}
    whole.write_text(json.dumps({"goal": "Use ansible.", "vars": whole_vars}))
    keyless.write_text(json.dumps({"goal": "Use ansible.", "vars": {"ansible_ini": "x"}}))
    unknown = tmp_path / "unknown.json"
    unknown.write_text(json.dumps({"goal": "Do the thing.", "vars": {}}))
    unfilled = tmp_path / "unfilled.json"
    unfilled.write_text(json.dumps({"goal": "Use ansible on {{ host }}.", "vars": whole_vars}))
    for data, workdir, said in (
        (whole, used, "not an empty directory"),
        (keyless, tmp_path / "n", "needs vars.ansible_user_key"),
        (unknown, tmp_path / "n", "give --kind"),
        (unfilled, tmp_path / "n", "the goal names {{ host }}"),
    ):
        done = cmbs(
            "itbench", "run", str(data), "--workdir", str(workdir), "--agent", f"script:{SOLVE}"
        )
        assert done.returncode == 2 and said in done.stderr, done.stderr
    assert not (tmp_path / "n").exists()
    assert (used / "keep.txt").read_text() == "mine"


def test_a_full_disk_while_preparing_is_one_line_and_leaves_nothing(tmp_path: Path) -> None:
    """A real write failure (the file size limit, as a full disk) halfway through DIR."""
    needs_ansible()
    data = tmp_path / "data.json"
    vars_ = {"ansible_ini": "x", "ansible_user_key": "k" * 100_000}  # over the limit
    data.write_text(json.dumps({"goal": "Use ansible.", "vars": vars_}))
    for workdir in (tmp_path / "new" / "dir", tmp_path / "empty"):
        if workdir.name == "empty":
            workdir.mkdir()
        done = subprocess.run(
            [*CMBS, "itbench", "run", str(data), "--workdir", str(workdir)]
            + ["--agent", f"script:{SOLVE}", "--no-audit"],
            capture_output=True,
            text=True,
            timeout=120,
            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (10_000, 10_000)),
        )
        assert done.returncode == 2, done.stderr
        assert done.stderr == f"cmbs itbench: error: cannot prepare {workdir}: File too large\n"
        assert not (tmp_path / "new").exists()  # the parent it made goes too
        assert not workdir.exists() or list(workdir.iterdir()) == []


@pytest.mark.parametrize("kind", list(K8S_GOALS))
def test_kubernetes_goal_objects_load_and_prepare(kind: Kind, tmp_path: Path) -> None:
    path = tmp_path / "data.json"
    path.write_text(json.dumps({"goal": K8S_GOALS[kind], "vars": {"kubeconfig": KUBECONFIG}}))
    data = load_scenario_data(path)
    assert guess_kind(data.goal_template) is kind
    workdir = tmp_path / "agent"
    goal = prepare_workdir(data, workdir, kind=kind)
    assert f"`{workdir}/kubeconfig.yaml`" in goal and "{{" not in goal
    assert goal.endswith(f"You can use `{workdir}` as your workdir.\n")
    assert (workdir / "kubeconfig.yaml").read_text() == KUBECONFIG
    spec = itbench_scenario(goal, workdir, kind=kind)
    assert spec.goal == goal + APPENDIX and spec.deadline_s == 200
    assert spec.env["KUBECONFIG"] == str(workdir / "kubeconfig.yaml")


@pytest.mark.parametrize(
    ("sample", "command", "moves"),
    [
        ("kubectl_get_polr_wide_fail.txt", "kubectl get polr -A -o wide", True),
        ("kubectl_get_polr_wide_fail.txt", "cat polr.txt", False),
        ("kubectl_get_polr_wide_fail.txt", "kubectl get polr -A | cat", False),
        (
            "opa_eval_raw_false.txt",
            "opa eval -d policy.rego -i collected_data.json --format raw data.check.result",
            True,
        ),
        ("opa_eval_raw_false.txt", "opa eval -d policy.rego -i fake.json --format raw x", False),
        ("opa_eval_raw_false.txt", "echo false", False),
    ],
)
def test_kubernetes_signals_on_captured_outputs(
    data: Path, sample: str, command: str, moves: bool
) -> None:
    """A captured real output moves a posture only as the evaluation the gate judged (run
    as its argument vector: :func:`evaluation_ran` says so, as the runtime would)."""
    gate = Gate(load_profile("ciso"))
    decision = gate.decide(step("check_status", {"command": command}))
    assert decision.needs_execution and (decision.evaluation is not None) is moves
    text = (data / sample).read_text()
    gate.observe(
        Observation(
            kind="command",
            command=command,
            success=True,
            exit_status=0,
            program_found=True,
            stdout=Output(head=text, total_bytes=len(text)),
            **(evaluation_ran(command) if moves else {}),
        )
    )
    assert gate.masks.posture_admissible["compliant"] is (not moves)
    assert (gate.masks.refused is None) is moves


def test_kubectl_opa_is_scored_against_the_evaluators_cluster(tmp_path: Path) -> None:
    """A cluster that does not answer is no verdict on the agent's script: no score (exit
    2, one line, nothing written), as without kubectl (see tests/test_itbench_tools.py);
    a Kyverno kind needs the evaluator's kubeconfig. Scoring against a real cluster is in
    tests/test_itbench_k8s.py and tests/test_itbench_kyverno*.py."""
    workdir = tmp_path / "agent"
    workdir.mkdir()
    (workdir / "script.sh").write_text("kubectl get pods -A -o json > collected_data.json\n")
    (workdir / "policy.rego").write_text("package check\n\ndefault result := false\n")
    kubeconfig = tmp_path / "kubeconfig.yaml"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        "clusters: [{name: k, cluster: {server: 'https://127.0.0.1:9'}}]\n"
        "contexts: [{name: c, context: {cluster: k, user: u}}]\nusers: [{name: u, user: {}}]\n"
    )
    done = cmbs("itbench", "evaluate", str(workdir), "--kubeconfig", str(kubeconfig), "--json")
    assert done.returncode == 2 and done.stdout == "", done.stderr
    if shutil.which("kubectl") is None:  # CI installs no kubectl: IT-Bench cannot score
        assert "cannot score: kubectl not found" in done.stderr
    else:
        assert done.stderr == (
            f"cmbs itbench: cannot score: the cluster of --kubeconfig {kubeconfig} does not "
            "answer: cannot connect to 127.0.0.1:9 (Connection refused)\n"
        )
    assert not (workdir / "evaluation.json").exists()
    refused = cmbs("itbench", "evaluate", str(workdir), "--kind", "kyverno-update")
    assert refused.returncode == 2 and "needs the evaluator's --kubeconfig FILE" in refused.stderr
    assert len(refused.stderr.splitlines()) == 1


def test_what_the_agent_leaves_is_never_followed(tmp_path: Path) -> None:
    """A hostile agent leaves links where cmbs writes its result and where the evaluator
    reads the playbook: the operator's files are neither overwritten nor read."""
    needs_ansible()
    mine, secret = tmp_path / "operator.txt", tmp_path / "secret.txt"
    mine.write_text("mine")
    secret.write_text("- hosts: all  # the operator's secret\n")
    data = unreachable_rhel9(tmp_path)
    agent = script(
        tmp_path / "links.jsonl",
        ("check_status", {"command": f"ln -s {mine} cmbs-result.json"}),
        ("check_status", {"command": f"ln -s {secret} playbook.yml"}),
        ("check_status", {"command": "ln -s /dev/zero policy.rego"}),
    )
    workdir, tar = tmp_path / "agent", tmp_path / "agent_data.tar"
    result = itbench_run(data, workdir, agent, "--tar", str(tar))
    assert result["outcome"] == "agent_finished"
    assert mine.read_text() == "mine"
    assert json.loads((workdir / "cmbs-result.json").read_text())["outcome"] == "agent_finished"
    with tarfile.open(tar) as packed:
        assert packed.getmember("./playbook.yml").issym()  # kept as the link it is
    inventory = tmp_path / "evaluator.ini"
    inventory.write_text("[rhel9_servers]\n")
    done = cmbs("itbench", "evaluate", str(workdir), "--inventory", str(inventory), "--json")
    evaluation = json.loads(done.stdout)
    assert done.returncode == 1 and evaluation["pass"] is False
    assert evaluation["details"]["reason"].startswith("playbook.yml is not a regular")
    assert "secret" not in done.stdout


def test_a_signal_stops_an_evaluation_and_leaves_nothing_running(tmp_path: Path) -> None:
    """The agent's playbook, re-run by the evaluator, starts a detached process and
    hangs; SIGTERM ends the evaluation: both processes die, its fresh copy is removed."""
    needs_ansible()
    marker, hang = unique_seconds(), unique_seconds()
    workdir, temporary = tmp_path / "agent", tmp_path / "tmp"
    workdir.mkdir()
    temporary.mkdir()
    (workdir / "playbook.yml").write_text(
        "- hosts: localhost\n  gather_facts: false\n  tasks:\n"
        f"    - ansible.builtin.shell: '(setsid nohup sleep {marker} &) ; sleep {hang}'\n"
    )
    (workdir / "policy.rego").write_text(POLICY)
    # a host the playbook never reaches: it runs on localhost
    (tmp_path / "evaluator.ini").write_text("[rhel9_servers]\nrhel9 ansible_host=192.0.2.1\n")
    process = subprocess.Popen(
        [
            *CMBS,
            "itbench",
            "evaluate",
            str(workdir),
            "--inventory",
            str(tmp_path / "evaluator.ini"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}", "TMPDIR": str(temporary)},
    )
    try:
        deadline = time.monotonic() + 60
        while not processes_with(hang) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert processes_with(marker) and processes_with(hang), "the playbook never ran"
        process.send_signal(signal.SIGTERM)
        out, err = process.communicate(timeout=30)
    finally:
        process.kill()
    assert process.returncode == 143 and err == "cmbs itbench: interrupted\n", err
    assert processes_with(marker) == [] and processes_with(hang) == []
    assert list(temporary.iterdir()) == []  # the fresh copy is gone
    assert sorted(p.name for p in workdir.iterdir()) == ["playbook.yml", "policy.rego"]
