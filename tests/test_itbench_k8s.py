"""IT-Bench's kubectl-opa scenario (gen-cis-b-k8s-kubectl-opa) as IT-Bench runs it, against
a real Kubernetes control plane (``tests/k8s_plane.py``) holding IT-Bench's fault (the
Deployment ``nginx-deployment`` with ``hostNetwork: true``), with the real kubectl and the
real opa built by ``tools/k8s/build.sh``: ``cmbs itbench run`` of a scenario data object,
``cmbs itbench evaluate`` (plain and ``--strict``), ten scenarios in one ``cmbs batch``
scored with ``--itbench-kubeconfig``, and the input that is refused before anything runs.

Sandboxed commands do not see the home or ``/tmp``, where build.sh's cache and pytest's
folders are: the programs are linked into a directory of their own under ``/var/tmp``,
first on the ``PATH`` cmbs runs with, as a user would install them (``/usr/local/bin``,
say). The scenario data objects are of IT-Bench's shape, written in our own words."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from cmbs_async.itbench import KYVERNO_CRDS

from . import k8s_helpers
from .k8s_helpers import FAULT, run_args, steps
from .k8s_plane import K8sPlane, k8s_tools
from .sshd import free_port
from .test_itbench_tools import bare_python  # noqa: F401 (a fixture)

pytestmark = pytest.mark.k8s

BIN = Path(sys.executable).parent
#: IT-Bench's goal for the kind, in our own words: it names `script.sh`; the evaluator
#: takes `fetcher.sh` as well (the agents here write that one).
GOAL = """I would like to check whether this condition holds on the Kubernetes cluster whose
kubeconfig is `kubeconfig.yaml`:
    Minimize the admission of containers wishing to share the host network namespace.

Get the resources it depends on with kubectl, and decide it with an OPA Rego policy
`policy.rego` (package `check`, rule `result`). Save the kubectl command as `script.sh`:
it writes what it collects to `collected_data.json` in the current working directory, and
names no kubeconfig (no --kubeconfig argument): the user sets it by environment.

If running the policy fails and you can fix it, fix it and run it again.
The cluster's kubeconfig is at `{{ kubeconfig }}`.
"""
#: Where the faulty Deployment is, and one like it with the host network off (the
#: session's plane keeps IT-Bench's own `paa` for tests/test_k8s_plane.py).
NAMESPACE, FIXED = "itb-paa", "itb-fixed"
#: Collects the Deployments of the kubeconfig's namespace.
FETCHER = "kubectl get deployments -o json > collected_data.json\n"
#: False when a Deployment asks for the host network (CIS 5.2.5).
POLICY = """package check

default result := false

result if count(violations) == 0

violations contains name if {
\tsome item in input.items
\titem.spec.template.spec.hostNetwork == true
\tname := item.metadata.name
}
"""
CONSTANT = "package check\n\ndefault result := false\n"
STRUCTURED = ("evaluate_policy", {"policy": "policy.rego", "input": "collected_data.json"})
FREE_FORM = (
    "execute_opa",
    {"command": "opa eval -d policy.rego -i collected_data.json -f raw data.check.result"},
)


@dataclass(frozen=True)
class Cluster:
    """The plane with the fault, and the programs: ``kubeconfig`` the target's (its
    context's namespace the faulty one), ``fixed`` one whose namespace is fixed, ``admin``
    the plane's own; ``kubectl_dir`` and ``opa_dir`` hold the real programs, each alone,
    where sandboxed commands see them."""

    plane: K8sPlane
    kubeconfig: Path
    fixed: Path
    admin: Path
    kubectl_dir: Path
    opa_dir: Path

    @property
    def path(self) -> str:
        """The PATH cmbs runs with: the real programs first."""
        return os.pathsep.join(
            [str(self.kubectl_dir), str(self.opa_dir), str(BIN), os.environ["PATH"]]
        )


def kubeconfig_in(plane: K8sPlane, namespace: str | None, server: str | None = None) -> str:
    """The plane's kubeconfig, its context set to ``namespace``, its server to ``server``."""
    config = json.loads(plane.kubeconfig.read_text())
    if namespace is not None:
        config["contexts"][0]["context"]["namespace"] = namespace
    if server is not None:
        config["clusters"][0]["cluster"]["server"] = server
    return json.dumps(config, indent=2) + "\n"


def inject(plane: K8sPlane, folder: Path, namespace: str, *, host_network: bool = True) -> None:
    """IT-Bench's fault (or the Deployment fixed) applied into a namespace of its own."""
    manifest = folder / f"{namespace}.yaml"
    manifest.write_text(
        FAULT.replace("hostNetwork: true", f"hostNetwork: {str(host_network).lower()}")
    )
    plane.kubectl("create", "namespace", namespace)
    plane.kubectl("apply", "-n", namespace, "-f", str(manifest))


def staged(names: tuple[str, ...], bin_dir: Path) -> Path:
    """A directory of its own, outside the home and /tmp (which sandboxed commands do not
    see), holding ``names`` from ``bin_dir`` (hard links where it can, else copies)."""
    folder = Path(tempfile.mkdtemp(prefix="cmbs-k8s-bin-", dir="/var/tmp"))
    folder.chmod(0o755)  # the sandbox's user searches it
    for name in names:
        try:
            os.link(bin_dir / name, folder / name)
        except OSError:
            shutil.copy2(bin_dir / name, folder / name)
    return folder


@pytest.fixture(scope="module")
def cluster(k8s_plane: K8sPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    bin_dir = k8s_tools("kubectl", "opa")
    if not os.access("/var/tmp", os.W_OK):
        pytest.skip("needs a writable /var/tmp for the programs sandboxed commands run")
    folder = tmp_path_factory.mktemp("cluster")
    inject(k8s_plane, folder, NAMESPACE)
    inject(k8s_plane, folder, FIXED, host_network=False)
    paths = {name: folder / f"{name}.yaml" for name in ("target", "fixed")}
    paths["target"].write_text(kubeconfig_in(k8s_plane, NAMESPACE))
    paths["fixed"].write_text(kubeconfig_in(k8s_plane, FIXED))
    kubectl_dir, opa_dir = staged(("kubectl",), bin_dir), staged(("opa",), bin_dir)
    try:
        yield Cluster(
            k8s_plane,
            paths["target"],
            paths["fixed"],
            k8s_plane.kubeconfig,
            kubectl_dir,
            opa_dir,
        )
    finally:
        shutil.rmtree(kubectl_dir)
        shutil.rmtree(opa_dir)


def cmbs(cluster: Cluster, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return k8s_helpers.cmbs_on(cluster.path, *args, timeout=timeout)


def scenario_data(folder: Path, kubeconfig: str, goal: str = GOAL) -> Path:
    return k8s_helpers.scenario_data(folder, kubeconfig, goal)


def honest(
    evaluation: tuple[str, dict[str, Any]] = STRUCTURED,
) -> list[tuple[str, dict[str, Any], str]]:
    """The honest solve: the real kubectl asked its version, the fetcher written and run,
    the policy written and evaluated by the real opa, the posture it showed declared."""
    return [
        ("execute_kubectl", {"command": "kubectl version -o json"}, "unknown"),
        ("generate_script", {"path": "fetcher.sh", "content": FETCHER}, "unknown"),
        ("execute_kubectl", {"command": "bash fetcher.sh"}, "unknown"),
        ("generate_policy", {"path": "policy.rego", "content": POLICY}, "unknown"),
        (*evaluation, "unknown"),
        ("declare_posture", {"posture": "non_compliant"}, "non_compliant"),
        ("terminate", {}, "non_compliant"),
    ]


def itbench_run(
    cluster: Cluster, folder: Path, agent: list[tuple[str, dict[str, Any], str]], *more: str
) -> tuple[Path, dict[str, Any]]:
    """``cmbs itbench run`` of the target's scenario data with a scripted agent: its DIR
    and its result (``--json``)."""
    data = scenario_data(folder, cluster.kubeconfig.read_text())
    return k8s_helpers.itbench_run(cluster.path, data, folder, agent, *more)


def evaluate(cluster: Cluster, workdir: Path, *more: str) -> tuple[int, dict[str, Any]]:
    """``cmbs itbench evaluate`` of ``workdir`` against the target."""
    return k8s_helpers.evaluate(cluster.path, cluster.kubeconfig, workdir, *more)


def evidence(cluster: Cluster, result: dict[str, Any]) -> list[dict[str, Any]]:
    """The provenance chains the run's audit trail recorded."""
    return k8s_helpers.evidence(cluster.path, result)


@pytest.fixture(scope="module")
def solved(
    cluster: Cluster, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, dict[str, Any]]:
    """The honest solve through ``cmbs itbench run``, timed; its DIR and result."""
    folder = tmp_path_factory.mktemp("honest")
    begun = time.monotonic()
    workdir, result = itbench_run(
        cluster, folder, honest(), "--tar", str(folder / "agent_data.tar")
    )
    print(f"itbench run (kubectl-opa, honest, real plane): {time.monotonic() - begun:.1f}s")
    return workdir, result


def test_the_honest_solve_earns_non_compliant_from_the_real_outputs(
    cluster: Cluster, solved: tuple[Path, dict[str, Any]]
) -> None:
    workdir, result = solved
    assert (result["outcome"], result["posture"]) == ("terminated", "non_compliant"), result
    trace = result["trace"]
    version = json.loads(trace[0]["stdout"])  # the real kubectl, answered by the real plane
    assert version["clientVersion"]["gitVersion"] == "v1.36.3"
    assert version["serverVersion"]["gitVersion"] == "v1.36.3"
    assert trace[4]["observed"] == "exit 0: false" and trace[4]["refused"] is None
    assert trace[4]["masks"]["posture_admissible"] == {"compliant": False, "non_compliant": True}
    # the evaluation as the gate judged it: the real opa, over what the fetcher collected
    [chain] = evidence(cluster, result)
    assert chain["program"]["path"] == str(cluster.opa_dir / "opa")
    assert chain["eliminates"] == "compliant" and chain["refused"] is None
    origins = {i["argument"]: i["origin"] for i in chain["inputs"]}
    assert origins == {
        "collected_data.json": "step 3: bash fetcher.sh",
        "policy.rego": "the agent's write action (policy.rego)",
    }
    collected = json.loads((workdir / "collected_data.json").read_text())
    [deployment] = collected["items"]
    assert deployment["metadata"]["namespace"] == NAMESPACE
    assert deployment["spec"]["template"]["spec"]["hostNetwork"] is True
    # the harness's layout, and the tar IT-Bench scores
    assert f"`{workdir}/kubeconfig.yaml`" in (workdir / "goal.txt").read_text()
    with tarfile.open(workdir.parent / "agent_data.tar") as packed:
        names = set(packed.getnames())
    assert {"./fetcher.sh", "./policy.rego", "./collected_data.json", "./kubeconfig.yaml"} <= names


def test_itbench_evaluate_passes_the_honest_solve_with_the_real_opa(
    cluster: Cluster, solved: tuple[Path, dict[str, Any]]
) -> None:
    workdir, _ = solved
    status, evaluation = evaluate(cluster, workdir)
    assert status == 0 and evaluation["pass"] is True, evaluation
    details = evaluation["details"]
    assert details["kind"] == "kubectl-opa"
    assert details["collector"]["command"] == "bash fetcher.sh"  # as IT-Bench runs it
    assert details["evaluation"]["command"].startswith(f"{cluster.opa_dir / 'opa'} eval ")
    assert details["evaluation"]["stdout"] == "false\n"  # the real opa, raw
    assert json.loads((workdir / "evaluation.json").read_text()) == evaluation


def test_the_free_form_opa_command_earns_the_same(cluster: Cluster, tmp_path: Path) -> None:
    """``opa eval -d ... -i ... -f raw`` as a model spells it: the profile's template takes
    it, and the real opa's output moves the posture as the structured action's does."""
    _, result = itbench_run(cluster, tmp_path, honest(FREE_FORM), "--no-audit")
    assert (result["outcome"], result["posture"]) == ("terminated", "non_compliant"), result
    assert result["trace"][4]["observed"] == "exit 0: false"


def test_strict_scoring_on_the_real_cluster(
    cluster: Cluster, solved: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    """The honest solve passes --strict against each opposite state: the collected input
    with a setting reversed (found, or named by --flip) and a fixed target (the same
    Deployment with the host network off, the namespace of the fixed kubeconfig); the
    constant policy passes plain IT-Bench scoring and fails --strict both ways."""
    workdir, _ = solved
    flip = "/items/*/spec/template/spec/hostNetwork=false"
    for more in ((), ("--flip", flip), ("--fixed-kubeconfig", str(cluster.fixed))):
        status, evaluation = evaluate(cluster, workdir, "--strict", *more)
        assert status == 0, evaluation["details"]["reason"]
        assert evaluation["details"]["verdicts"] == {"target": "false", "opposite": "true"}
    constant = tmp_path / "constant"
    constant.mkdir()
    (constant / "fetcher.sh").write_text(FETCHER)
    (constant / "policy.rego").write_text(CONSTANT)
    assert evaluate(cluster, constant)[0] == 0  # IT-Bench's criterion passes it
    for more in ((), ("--fixed-kubeconfig", str(cluster.fixed))):
        status, evaluation = evaluate(cluster, constant, "--strict", *more)
        assert status == 1 and evaluation["details"]["verdicts"]["target"] == "false"
    # options that do not go together: one line, exit 2, before anything runs
    refusals: list[tuple[tuple[str, ...], str]] = [
        (("--strict", "--fixed-inventory", str(cluster.fixed)), "given as --fixed-kubeconfig"),
        (("--flip", flip), "--flip is for --strict scoring"),
        (("--strict", "--flip", flip, "--fixed-kubeconfig", str(cluster.fixed)), "not both"),
    ]
    for options, said in refusals:
        done = cmbs(
            cluster,
            "itbench",
            "evaluate",
            str(constant),
            "--kubeconfig",
            str(cluster.kubeconfig),
            *options,
        )
        assert done.returncode == 2 and said in done.stderr, done.stderr
        assert len(done.stderr.splitlines()) == 1


#: Liars, each with what IT-Bench's criterion makes of what it leaves.
LIARS: dict[str, tuple[list[tuple[str, dict[str, Any], str]], bool]] = {
    # the honest artifacts, but `echo false` instead of the evaluation: IT-Bench, which
    # scores only the artifacts, passes it; the gate never lets it terminate
    "echoes false": (
        [
            *honest()[1:4],
            ("execute_opa", {"command": "echo false"}, "unknown"),
            ("declare_posture", {"posture": "non_compliant"}, "non_compliant"),
            ("terminate", {}, "non_compliant"),
        ],
        True,
    ),
    # evaluates a file of its own (the fetcher copies it): the collected input is the
    # agent's own writing, by content
    "evaluates its own file": (
        [
            (
                "generate_script",
                {"path": "own.json", "content": json.dumps({"items": []})},
                "unknown",
            ),
            (
                "generate_script",
                {"path": "fetcher.sh", "content": "cat own.json > collected_data.json\n"},
                "unknown",
            ),
            ("execute_kubectl", {"command": "bash fetcher.sh"}, "unknown"),
            ("generate_policy", {"path": "policy.rego", "content": POLICY}, "unknown"),
            (*STRUCTURED, "unknown"),
            ("declare_posture", {"posture": "compliant"}, "compliant"),
            ("terminate", {}, "compliant"),
        ],
        False,
    ),
    # claims the posture before any evaluation, then collects and stops
    "claims before evaluating": (
        [
            ("declare_posture", {"posture": "non_compliant"}, "non_compliant"),
            ("generate_script", {"path": "fetcher.sh", "content": FETCHER}, "non_compliant"),
            ("execute_kubectl", {"command": "bash fetcher.sh"}, "non_compliant"),
            ("declare_posture", {"posture": "non_compliant"}, "non_compliant"),
            ("terminate", {}, "non_compliant"),
        ],
        False,
    ),
}


@pytest.mark.parametrize("liar", list(LIARS))
def test_lying_agents_earn_nothing(cluster: Cluster, liar: str, tmp_path: Path) -> None:
    agent, itbench_passes = LIARS[liar]
    workdir, result = itbench_run(cluster, tmp_path, agent, "--no-audit")
    assert result["outcome"] != "terminated" and result["posture"] is None, result
    trace = result["trace"]
    assert trace[-1]["verdict"] != "TERMINATE"
    if liar == "evaluates its own file":
        evaluated = trace[4]
        assert evaluated["observed"] == "exit 0: true"  # the real opa, on the agent's file
        assert "the agent's own writing" in evaluated["refused"]
    if liar == "claims before evaluating":
        assert trace[0]["verdict"] == "BLOCK"
    status, evaluation = evaluate(cluster, workdir)
    assert evaluation["pass"] is itbench_passes, evaluation["details"]["reason"]


AGENT = """\
import json
import sys

POLICY = {policy!r}
INPUT = "collected_data.json"
steps = None
for line in sys.stdin:
    turn = json.loads(line)
    if steps is None:  # the scenario's namespace, from its vars
        fetcher = (
            f"kubectl get deployments -n {{turn['vars']['namespace']}} -o json "
            "> collected_data.json\\n"
        )
        steps = iter([
            ("generate_script", {{"path": "fetcher.sh", "content": fetcher}}, "unknown"),
            ("execute_kubectl", {{"command": "bash fetcher.sh"}}, "unknown"),
            ("generate_policy", {{"path": "policy.rego", "content": POLICY}}, "unknown"),
            ("evaluate_policy", {{"policy": "policy.rego", "input": INPUT}}, "unknown"),
            ("declare_posture", {{"posture": "non_compliant"}}, "non_compliant"),
            ("terminate", {{}}, "non_compliant"),
        ])
    step = next(steps, None)
    if step is None:
        break
    action, payload, posture = step
    belief = {{"affordances": {{}}, "posture": posture, "evidence": "none"}}
    action = {{"type": action, "payload": payload}}
    print(json.dumps({{"belief": belief, "action": action}}), flush=True)
"""


def test_ten_scenarios_in_one_batch_each_in_its_namespace(
    cluster: Cluster, tmp_path: Path, record_property: Callable[[str, object], None]
) -> None:
    """Ten kubectl-opa scenarios against the one plane, each with the fault in a
    namespace of its own that its fetcher looks at (a program agent reads it from the
    scenario's vars), scored as IT-Bench scores them, with the time per scenario."""
    scenarios = tmp_path / "scenarios"
    scenarios.mkdir()
    port = cluster.plane.port
    for number in range(10):
        namespace = f"itb-batch-{number}"
        inject(cluster.plane, tmp_path, namespace)
        spec = {
            "id": f"kubectl-opa-{number}",
            "goal": "Check whether the Deployments in namespace {{ namespace }} of the "
            "cluster with kubeconfig {{ kubeconfig }} share the host network namespace: "
            "collect them with kubectl in `fetcher.sh`, decide with the OPA Rego policy "
            "`policy.rego`.",
            "vars": {"namespace": namespace, "kubeconfig": str(cluster.admin)},
            "env": {"KUBECONFIG": "{{ kubeconfig }}"},
            "readable": ["{{ kubeconfig }}"],
            "network": [f"127.0.0.1:{port}"],
            "expected": "non_compliant",
            "profile": "ciso",
        }
        (scenarios / f"s{number}.json").write_text(json.dumps(spec))
    agent = tmp_path / "agent.py"
    agent.write_text(AGENT.format(policy=POLICY))
    out = tmp_path / "out.jsonl"
    begun = time.monotonic()
    done = cmbs(
        cluster,
        "batch",
        str(scenarios),
        "--agent",
        f"stdio:python3 {agent}",
        "--out",
        str(out),
        "--concurrency",
        "10",
        "--no-audit",
        "--itbench-kubeconfig",
        str(cluster.admin),
    )
    wall = time.monotonic() - begun
    assert done.returncode == 0, done.stdout + done.stderr
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 10
    for record in records:
        assert (record["outcome"], record["posture"]) == ("terminated", "non_compliant"), record
        assert record["correct"] is True and record["itbench_pass"] is True, record
    runs = [record["duration_s"] for record in records]
    print(
        f"cmbs batch, 10 kubectl-opa scenarios on one plane (concurrency 10, scored): "
        f"{wall:.1f}s wall, {wall / 10:.2f}s per scenario; each run "
        f"{min(runs):.2f}-{max(runs):.2f}s (mean {sum(runs) / 10:.2f}s)"
    )
    record_property("batch10_wall_s", round(wall, 2))
    record_property("batch10_per_scenario_s", round(wall / 10, 2))
    assert "IT-Bench pass@1" in done.stdout and "1.00 (10/10)" in done.stdout, done.stdout


# -- refused before anything runs ------------------------------------------------------


def test_a_kubeconfig_that_reaches_no_server_is_refused(
    cluster: Cluster, solved: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    destination = f"127.0.0.1:{free_port()}"  # nothing listens there
    nowhere = kubeconfig_in(cluster.plane, NAMESPACE, server=f"https://{destination}")
    data = scenario_data(tmp_path, nowhere)
    script = steps(tmp_path / "steps.jsonl", *honest())
    workdir = tmp_path / "runs" / "agent"
    done = cmbs(cluster, *run_args(data, workdir, script, "--no-audit"))
    assert done.returncode == 2, done.stderr
    [line] = done.stderr.splitlines()
    assert line.startswith("cmbs itbench: error: the cluster of vars.kubeconfig does not answer")
    assert "(Connection refused)" in line
    assert not (tmp_path / "runs").exists()  # nothing was made
    # the evaluator's: no verdict, nothing written
    kubeconfig = tmp_path / "nowhere.yaml"
    kubeconfig.write_text(nowhere)
    scored = tmp_path / "scored"
    scored.mkdir()
    for name in ("fetcher.sh", "policy.rego"):
        shutil.copy(solved[0] / name, scored / name)
    for option in ("--kubeconfig", "--fixed-kubeconfig"):
        target = str(kubeconfig if option == "--kubeconfig" else cluster.kubeconfig)
        fixed = (
            ["--strict", "--fixed-kubeconfig", str(kubeconfig)] if option != "--kubeconfig" else []
        )
        done = cmbs(cluster, "itbench", "evaluate", str(scored), "--kubeconfig", target, *fixed)
        assert done.returncode == 2, done.stderr
        assert done.stderr == (
            f"cmbs itbench: cannot score: the cluster of {option} {kubeconfig} does not "
            f"answer: cannot connect to {destination} (Connection refused)\n"
        )
        assert done.stdout == "" and not (scored / "evaluation.json").exists()


KYVERNO_GOALS = {
    "kyverno-generate": "Deploy a Kyverno policy that keeps containers off the host network "
    "and check it is deployed. The kubeconfig is at `{{ kubeconfig }}`.",
    "kyverno-update": "Edit the existing Kyverno policies in place (keep their names) so "
    "that they also forbid running as root. The kubeconfig is at `{{ kubeconfig }}`.",
}


@contextlib.contextmanager
def without_kyverno(plane: K8sPlane) -> Iterator[K8sPlane]:
    """A plane with no Kyverno CRDs: the session's, unless a test installed them there."""
    listed = plane.kubectl("get", "crd", "-o", "name").stdout
    if not any(name in listed for name in KYVERNO_CRDS):
        yield plane
        return
    with K8sPlane(plane.bin) as own:
        yield own


def test_a_kyverno_kind_without_kyverno_in_the_cluster_is_refused(
    cluster: Cluster, tmp_path: Path
) -> None:
    script = steps(tmp_path / "steps.jsonl", ("terminate", {}, "unknown"))
    with without_kyverno(cluster.plane) as plane:
        for kind, goal in KYVERNO_GOALS.items():
            data = scenario_data(tmp_path, kubeconfig_in(plane, None), goal)
            workdir = tmp_path / "runs" / kind
            done = cmbs(cluster, *run_args(data, workdir, script, "--no-audit"))
            assert done.returncode == 2, done.stderr
            assert done.stderr == (
                "cmbs itbench: error: the cluster of vars.kubeconfig has no Kyverno (no CRD "
                f"policyreports.wgpolicyk8s.io): a {kind} scenario needs it installed\n"
            )
            assert not (tmp_path / "runs").exists()


def bare_path(folder: Path, *dirs: Path) -> str:
    """A PATH of ``dirs`` and one directory with only bwrap and ``true`` (what the
    sandbox's probe runs), so that the sandbox is what it would be and no kubectl, opa or
    cmbs-opa is found but where ``dirs`` have them."""
    folder.mkdir()
    for name in ("bwrap", "true"):
        real = shutil.which(name)
        if real is not None:
            (folder / name).symlink_to(real)
    return os.pathsep.join([*map(str, dirs), str(folder)])


def cmbs_bare(python: Path, path: str, *args: str) -> subprocess.CompletedProcess[str]:
    """cmbs run by an interpreter whose scripts directory holds no cmbs-opa."""
    return subprocess.run(
        [str(python), "-m", "cmbs_async", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PATH": path},
        stdin=subprocess.DEVNULL,
    )


def test_missing_kubectl_or_opa_is_one_line_before_anything_runs(
    cluster: Cluster,
    solved: tuple[Path, dict[str, Any]],
    bare_python: Path,  # noqa: F811 (the fixture)
    tmp_path: Path,
) -> None:
    if shutil.which("bwrap") is None:
        pytest.skip("needs bubblewrap: without a sandbox every PATH entry is seen")
    data = scenario_data(tmp_path, cluster.kubeconfig.read_text())
    script = steps(tmp_path / "steps.jsonl", *honest())
    run = ["itbench", "run", str(data), "--agent", f"script:{script}", "--no-audit"]
    # kubectl on the operator's PATH, but in /tmp, which sandboxed commands do not see
    hidden = tmp_path / "hidden"
    hidden.mkdir()
    os.link(cluster.kubectl_dir / "kubectl", hidden / "kubectl")
    path = bare_path(tmp_path / "bare1", hidden, cluster.opa_dir)
    done = cmbs_bare(bare_python, path, *run, "--workdir", str(tmp_path / "runs" / "a"))
    assert done.returncode == 2, done.stderr
    [line] = done.stderr.splitlines()
    assert line == (
        "cmbs itbench: error: kubectl not found on the PATH commands run with: a kubectl-opa "
        f"scenario runs it ({hidden}/kubectl is on your PATH but under /tmp, which sandboxed "
        "commands do not see: put it in a directory outside the home and /tmp, or run with "
        "--sandbox none)"
    )
    # no opa, and no cmbs-opa where this interpreter's cmbs was installed
    path = bare_path(tmp_path / "bare2", cluster.kubectl_dir)
    done = cmbs_bare(bare_python, path, *run, "--workdir", str(tmp_path / "runs" / "b"))
    assert done.returncode == 2, done.stderr
    [line] = done.stderr.splitlines()
    assert line.startswith("cmbs itbench: error: opa or cmbs-opa not found on the PATH"), line
    assert not (tmp_path / "runs").exists()
    scored = tmp_path / "scored"
    scored.mkdir()
    for name in ("fetcher.sh", "policy.rego"):
        shutil.copy(solved[0] / name, scored / name)
    done = cmbs_bare(
        bare_python,
        path,
        "itbench",
        "evaluate",
        str(scored),
        "--kubeconfig",
        str(cluster.kubeconfig),
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("cmbs itbench: cannot score: opa or cmbs-opa not found")
    assert not (scored / "evaluation.json").exists()
