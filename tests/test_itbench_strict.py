"""``cmbs itbench evaluate --strict``: beyond IT-Bench's criterion, the opposite verdict on
the opposite state, so that a constant policy (``default result := false``) or a collector
that never reaches the target cannot pass.

Against two real sshds at once, one with IT-Bench's fault in its /etc/ssh/sshd_config
(``X11Forwarding yes``) and one fixed (``X11Forwarding no``), reached as a non-root user
with IT-Bench's limited sudo, by real ansible-playbook, scored by the real Rego engine;
the opposite input without a fixed target on both event loops."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from cmbs_async.itbench import Flip, ItbenchError, Kind, evaluate
from executors import LocalExecutor

from .helpers import CMBS, POLICY
from .k8s_plane import K8sPlane
from .sshd import ITBENCH_SUDO, LocalSshd, ThrowawayUser, itbench_target_missing

SOLVE = Path(__file__).parent.parent / "examples" / "ciso" / "rhel9-ansible-opa" / "solve.jsonl"
BIN = Path(sys.executable).parent
#: The check user of these targets: not test_itbench's, so both modules may run at once.
USER = "cmbsitbs"

#: The pack's honest playbook: it reads /etc/ssh/sshd_config on every host, with become.
PLAYBOOK = json.loads(SOLVE.read_text().splitlines()[0])["action"]["payload"]["content"]
#: A policy that prints false whatever it is given: IT-Bench's criterion passes it on the
#: faulty host.
CONSTANT = "package check\n\ndefault result := false\n"
#: A playbook that never reaches the target: it writes what a faulty host would show.
NOWHERE = (
    "- hosts: localhost\n  gather_facts: false\n  tasks:\n"
    "    - ansible.builtin.copy:\n"
    "        dest: '{{ playbook_dir }}/collected_data.json'\n"
    '        content: \'{"x11_forwarding": "yes"}\'\n'
)


@dataclass(frozen=True)
class Hosts:
    """IT-Bench's RHEL9 target in each state, and an evaluator's inventory for each."""

    fault: Path
    fixed: Path


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hosts]:
    missing = itbench_target_missing()
    if missing is not None:
        if os.environ.get("CI"):
            pytest.fail(f"CI must have {missing}")
        pytest.skip(f"needs {missing}")
    folder = tmp_path_factory.mktemp("evaluator")
    with ThrowawayUser(USER, sudo=ITBENCH_SUDO) as user:
        with (
            LocalSshd(extra_config="X11Forwarding yes\n", user=user, as_system_config=True) as a,
            LocalSshd(extra_config="X11Forwarding no\n", user=user, as_system_config=True) as b,
        ):
            found = Hosts(folder / "fault.ini", folder / "fixed.ini")
            found.fault.write_text(inventory(a))
            found.fixed.write_text(inventory(b))
            yield found


def inventory(target: LocalSshd) -> str:
    return (
        "[rhel9_servers]\n"
        f'rhel9 ansible_host="127.0.0.1" ansible_port="{target.port}" ansible_user="{USER}" '
        f'ansible_ssh_private_key_file="{target.client_key}" '
        'ansible_python_interpreter="/usr/bin/python3"\n'
    )


def workdir(tmp_path: Path, playbook: str, policy: str) -> Path:
    folder = tmp_path / "agent"
    folder.mkdir(exist_ok=True)
    (folder / "playbook.yml").write_text(playbook)
    (folder / "policy.rego").write_text(policy)
    return folder


def score(folder: Path, target: Path, *more: str) -> tuple[int, dict[str, Any]]:
    """``cmbs itbench evaluate`` of ``folder`` against ``target``: exit status, and what
    evaluation.json holds (the same as ``--json`` printed)."""
    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}"}
    done = subprocess.run(
        [*CMBS, "itbench", "evaluate", str(folder), "--kind", "rhel9-ansible-opa"]
        + ["--inventory", str(target), "--json", *more],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.stderr == "", done.stderr
    evaluation = json.loads((folder / "evaluation.json").read_text())
    assert json.loads(done.stdout) == evaluation
    assert done.returncode == (0 if evaluation["pass"] else 1)
    return done.returncode, evaluation


def verdicts(evaluation: dict[str, Any]) -> tuple[str | None, str | None]:
    found = evaluation["details"]["verdicts"]
    return found["target"], found["opposite"]


@pytest.mark.ssh
def test_strict_fails_a_constant_policy_that_itbench_passes(hosts: Hosts, tmp_path: Path) -> None:
    """``default result := false`` with the honest playbook: IT-Bench's criterion passes it
    on the faulty host; --strict prints false on the fixed host too, and fails it, as it
    does on the collected input with the setting reversed (named or found)."""
    folder = workdir(tmp_path, PLAYBOOK, CONSTANT)
    status, plain = score(folder, hosts.fault)
    assert status == 0 and plain["pass"] is True
    assert "verdicts" not in plain["details"] and "strict" not in plain["details"]

    status, strict = score(folder, hosts.fault, "--strict", "--fixed-inventory", str(hosts.fixed))
    assert status == 1 and verdicts(strict) == ("false", "false"), strict
    details = strict["details"]
    assert details["strict"]["against"] == "the fixed target"
    assert details["strict"]["expected"] == "true"
    assert details["strict"]["collector"]["exit_status"] == 0  # it reached the fixed host
    assert details["reason"] == (
        "printed 'false' on the target, printed 'false' on the fixed target; "
        "expected 'false' and 'true'"
    )

    for more in ((), ("--flip", "/x11_forwarding=no")):
        status, strict = score(folder, hosts.fault, "--strict", *more)
        assert status == 1 and verdicts(strict) == ("false", "false"), strict
        assert strict["details"]["strict"]["changed"] == [
            {"path": "/x11_forwarding", "from": "yes", "to": "no"}
        ]


@pytest.mark.ssh
def test_strict_fails_a_playbook_that_never_reaches_the_target(
    hosts: Hosts, tmp_path: Path
) -> None:
    """A playbook that writes what a faulty host shows, without reaching any: IT-Bench's
    criterion passes it with the honest policy; against the fixed host it shows the same,
    and --strict fails it. Without a fixed target --strict cannot tell (the policy does
    flip on the reversed input): docs/guides/itbench.md says so, and this shows it."""
    folder = workdir(tmp_path, NOWHERE, POLICY)
    status, plain = score(folder, hosts.fault)
    assert status == 0 and plain["pass"] is True

    status, strict = score(folder, hosts.fault, "--strict", "--fixed-inventory", str(hosts.fixed))
    assert status == 1 and verdicts(strict) == ("false", "false"), strict

    status, unaware = score(folder, hosts.fault, "--strict")  # the documented limit
    assert status == 0 and verdicts(unaware) == ("false", "true"), unaware


@pytest.mark.ssh
def test_strict_passes_the_honest_playbook_and_policy(hosts: Hosts, tmp_path: Path) -> None:
    """The pack's solve: false on the faulty host, true on the fixed one, whichever of the
    two is the evaluator's target; and true on its collected input with the setting
    reversed, found or named (on trio too)."""
    folder = workdir(tmp_path, PLAYBOOK, POLICY)
    status, plain = score(folder, hosts.fault)
    assert status == 0 and plain["details"]["evaluation"]["stdout"] == "false\n"

    status, strict = score(folder, hosts.fault, "--strict", "--fixed-inventory", str(hosts.fixed))
    assert status == 0 and verdicts(strict) == ("false", "true"), strict
    assert strict["details"]["strict"]["evaluation"]["stdout"] == "true\n"
    assert strict["details"]["reason"] == (
        "printed 'false' on the target, printed 'true' on the fixed target; "
        "expected 'false' and 'true'"
    )
    # the fixed host as the target, the faulty one as its opposite
    status, strict = score(
        folder, hosts.fixed, "--expect", "true", "--strict", "--fixed-inventory", str(hosts.fault)
    )
    assert status == 0 and verdicts(strict) == ("true", "false"), strict

    for more in (("--backend", "trio"), ("--flip", "/x11_forwarding=no")):
        status, strict = score(folder, hosts.fault, "--strict", *more)
        assert status == 0 and verdicts(strict) == ("false", "true"), strict
        check = strict["details"]["strict"]
        assert check["unchanged"]["stdout"] == "false\n"  # the input as collected, again
        assert check["changed"] == [{"path": "/x11_forwarding", "from": "yes", "to": "no"}]


def test_strict_options_that_do_not_go_together_are_one_line(tmp_path: Path) -> None:
    """Bad input is one line, exit 2, before anything runs or is written."""
    folder = workdir(tmp_path, PLAYBOOK, POLICY)
    evaluator, empty = tmp_path / "evaluator.ini", tmp_path / "empty.ini"
    evaluator.write_text('[rhel9_servers]\nrhel9 ansible_host="192.0.2.1"\n')
    empty.write_text("[rhel9_servers]\n")
    for more, said in (
        (["--flip", "/x11_forwarding=no"], "--flip is for --strict scoring"),
        (["--fixed-inventory", str(evaluator)], "--fixed-inventory is for --strict scoring"),
        (
            ["--strict", "--fixed-inventory", str(evaluator), "--flip", "/x=no"],
            "not both",
        ),
        (["--strict", "--fixed-kubeconfig", str(evaluator)], "given as --fixed-inventory"),
        (["--strict", "--flip", "x11_forwarding=no"], "a JSON Pointer"),
        (["--strict", "--flip", "/x11_forwarding"], "give POINTER=VALUE"),
        (["--strict", "--flip", "/x=" + "[" * 100_000], "nested too deeply"),
        (["--strict", "--fixed-inventory", str(tmp_path / "absent.ini")], "cannot read"),
        (["--strict", "--fixed-inventory", str(empty)], "the fixed target: "),
    ):
        done = subprocess.run(
            [*CMBS, "itbench", "evaluate", str(folder), "--inventory", str(evaluator), *more],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 2, (more, done.stdout, done.stderr)
        assert done.stderr.startswith("cmbs itbench: error: ") and said in done.stderr, more
        assert len(done.stderr.splitlines()) == 1
        assert not (folder / "evaluation.json").exists()


# Without a fixed target: the policy on the collected input, reversed. A kubectl + OPA
# workdir whose script writes pods as a cluster with a pod on the host network would
# show them, on both event loops; the kubeconfig names a real cluster (the evaluator
# checks that it answers before it scores), which the scripts do not read.

PODS = {"items": [{"metadata": {"name": "web"}, "spec": {"hostNetwork": True}}] * 2}
HOST_NETWORK = (
    "package check\n\ndefault result := false\n\n"
    "result if {\n    not some_host_network\n}\n\n"
    "some_host_network if {\n    some pod in input.items\n    pod.spec.hostNetwork\n}\n"
)


@pytest.fixture
def kubeconfig(k8s_plane: K8sPlane) -> str:
    """A kubeconfig of a real cluster: the evaluator checks it answers before it scores."""
    return k8s_plane.kubeconfig.read_text()


def pods_workdir(tmp_path: Path, policy: str, script: str | None = None) -> Path:
    folder = tmp_path / "agent"
    folder.mkdir(exist_ok=True)
    collected = json.dumps(PODS)
    (folder / "script.sh").write_text(
        script or f"printf '%s' '{collected}' > collected_data.json\n"
    )
    (folder / "policy.rego").write_text(policy)
    return folder


async def strictly(tmp_path: Path, folder: Path, kubeconfig: str, *flips: str, **more: Any) -> Any:
    (tmp_path / "kubeconfig.yaml").write_text(kubeconfig)
    async with LocalExecutor(workdir_root=str(tmp_path)) as executor:
        return await evaluate(
            folder,
            executor=executor,
            kind=Kind.KUBECTL_OPA,
            kubeconfig=str(tmp_path / "kubeconfig.yaml"),
            strict=True,
            flips=tuple(Flip.parse(f) for f in flips),
            **more,
        )


@pytest.mark.k8s
@pytest.mark.anyio
async def test_the_opposite_input_flips_an_honest_policy_and_not_a_constant(
    tmp_path: Path, kubeconfig: str
) -> None:
    folder = pods_workdir(tmp_path, HOST_NETWORK)
    for flips in ((), ("/items/*/spec/hostNetwork=false",)):
        passed = await strictly(tmp_path, folder, kubeconfig, *flips)
        assert passed.passed, passed.details
        assert passed.details["verdicts"] == {"target": "false", "opposite": "true"}
        changed = passed.details["strict"]["changed"]  # every pod's, at once
        assert [c["path"] for c in changed] == [f"/items/{i}/spec/hostNetwork" for i in (0, 1)]
        assert passed.details["strict"]["places"] == 2
        assert passed.details["strict"]["unchanged"]["stdout"] == "false\n"

    (folder / "policy.rego").write_text(CONSTANT)
    for flips in ((), ("/items/*/spec/hostNetwork=false",)):
        failed = await strictly(tmp_path, folder, kubeconfig, *flips)
        assert not failed.passed
        assert failed.details["verdicts"] == {"target": "false", "opposite": "false"}


@pytest.mark.k8s
@pytest.mark.anyio
async def test_an_opposite_input_that_cannot_be_made_fails(tmp_path: Path, kubeconfig: str) -> None:
    """A pointer that names nothing, a value already there, no setting with a known
    opposite, an input that is no JSON or a link: each fails, saying why."""
    folder = pods_workdir(tmp_path, HOST_NETWORK)
    for flips, why in (
        (("/items/*/spec/privileged=false",), "nothing at /items/*/spec/privileged"),
        (("/items/9/spec/hostNetwork=false",), "nothing at /items/9/spec/hostNetwork"),
        (("/items/*/spec/hostNetwork=true",), "changes nothing"),
    ):
        failed = await strictly(tmp_path, folder, kubeconfig, *flips)
        assert not failed.passed and why in failed.details["reason"], failed.details
        assert failed.details["verdicts"] == {"target": "false", "opposite": None}
    for script, why in (
        ("printf '{\"count\": 7}' > collected_data.json\n", "no setting"),
        ("printf 'pods: 2' > collected_data.json\n", "not JSON"),
        ("ln -s /etc/hostname collected_data.json\n", "no regular collected_data.json"),
    ):
        folder = pods_workdir(tmp_path, HOST_NETWORK, script)
        failed = await strictly(tmp_path, folder, kubeconfig)
        assert not failed.passed and why in failed.details["reason"], failed.details


@pytest.mark.k8s
@pytest.mark.anyio
async def test_a_fixed_target_is_scored_with_the_same_collector(
    tmp_path: Path, kubeconfig: str
) -> None:
    """With a fixed kubeconfig the collector runs again against it: a script that reads its
    target (here the kubeconfig itself: both name one cluster) passes when the two differ
    and fails when they do not; a fixed target's kind is checked first."""
    script = (
        'if grep -q fixed "$KUBECONFIG"; then v=false; else v=true; fi\n'
        'printf \'{"items": [{"spec": {"hostNetwork": %s}}]}\' $v > collected_data.json\n'
    )
    folder = pods_workdir(tmp_path, HOST_NETWORK, script)
    fixed = tmp_path / "fixed.yaml"
    fixed.write_text(kubeconfig + "# fixed\n")
    passed = await strictly(tmp_path, folder, kubeconfig, fixed_kubeconfig=str(fixed))
    assert passed.passed and passed.details["verdicts"] == {"target": "false", "opposite": "true"}
    fixed.write_text(kubeconfig)  # the same state: no opposite verdict
    failed = await strictly(tmp_path, folder, kubeconfig, fixed_kubeconfig=str(fixed))
    assert not failed.passed
    assert failed.details["verdicts"] == {"target": "false", "opposite": "false"}
    with pytest.raises(ItbenchError, match="--fixed-kubeconfig"):
        await strictly(tmp_path, folder, kubeconfig, fixed_inventory=str(fixed))
