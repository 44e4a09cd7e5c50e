"""IT-Bench's two Kyverno kinds scored by ``cmbs_async.kyverno`` (marker ``k8s``), against
a real control plane running Kyverno's own reports controller (``tests/k8s_plane.py``),
with the real kubectl in the sandbox: the workdir's policies applied, Kyverno's reports
awaited and read as IT-Bench reads them, the cluster put back afterwards.

One plane for the module holds IT-Bench's faults in ``paa``: the generate kind's
Deployment ``nginx-deployment`` (``hostNetwork: true``) and the update kind's
ServiceAccount and Pod ``test-untrusted-registry``; the update kind's existing policies
are applied for its tests only (their Pod rules fail the Deployment too, which would pass
any generate workdir). Every manifest and policy here is written in our own words, of the
shape of IT-Bench's ``scenarios/ciso/{1.gen,4.upd}-cis-b-k8s-kyverno/manifests``."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import pytest
import yaml

from cmbs_async.itbench import CannotScore, Evaluation, Kind
from cmbs_async.kyverno import (
    GENERATE_TARGET,
    UPDATE_TARGET,
    Resource,
    agent_policies,
    compliant_twin,
    covers,
    evaluate_kyverno,
    generate_check,
    rules_unchanged_check,
    violation_check,
    without_policies,
)
from executors import LocalExecutor

from .k8s_helpers import (
    CONTAINER_CONTROLS,
    EXISTING,
    FAULT,
    FIX,
    HOST_NETWORK_POLICY,
    SERVICE_ACCOUNT_POLICY,
    UPDATE_FAULT,
)
from .k8s_plane import PLANE_PROGRAMS, K8sPlane, k8s_tools

pytestmark = pytest.mark.k8s

#: CIS 5.2.5 as the generate kind asks for it: Pods (and, by Kyverno's autogen, their
#: controllers) must keep off the host network.
HONEST = HOST_NETWORK_POLICY
#: The same rule, for a namespace that does not exist: it matches nothing.
NOWHERE = HONEST.replace("keep-off-host-network", "keep-off-host-network-nowhere").replace(
    "kinds: [Pod]", "kinds: [Pod]\n            namespaces: [no-such-namespace]"
)
#: A policy every Pod fails (a label nothing has): it fails the fault, and all else.
EVERYTHING = """\
apiVersion: kyverno.io/v1
kind: ClusterPolicy
metadata:
  name: require-a-label-nobody-has
spec:
  validationFailureAction: Audit
  background: true
  rules:
    - name: label
      match:
        any:
        - resources:
            kinds: [Pod]
      validate:
        message: "Pods must carry the label cmbs-nowhere."
        pattern:
          metadata:
            labels:
              cmbs-nowhere: "?*"
"""
#: An honest edit of another shape: the old rule kept, a rule added for each new demand.
#: The old one (which the Pod passes) is first in name order, and IT-Bench's check reads
#: only the first result of the policy: it fails this edit.
THREE_RULES = (
    CONTAINER_CONTROLS
    + """\
    - name: run-as-non-root
      match:
        resources:
          kinds: [Pod]
      validate:
        message: "Containers must not run as root."
        pattern:
          spec:
            containers:
              - (name): "*"
                securityContext:
                  runAsNonRoot: true
    - name: trusted-registry-only
      match:
        resources:
          kinds: [Pod]
      validate:
        message: "Images must come from trusted-registry.com."
        pattern:
          spec:
            containers:
              - (name): "*"
                image: "trusted-registry.com/*"
"""
)
#: The service-account policy edited too: IT-Bench's other check fails it.
SERVICE_ACCOUNT_CHANGED = SERVICE_ACCOUNT_POLICY.replace('"!default"', '"!default & !kube-*"')
assert SERVICE_ACCOUNT_CHANGED != SERVICE_ACCOUNT_POLICY


@dataclass
class Bench:
    """The plane with Kyverno and both faults; ``existing`` IT-Bench's existing policies
    as a file (for scoring the cluster as it is); the times each evaluation took."""

    plane: K8sPlane
    existing: Path
    times: dict[str, float] = field(default_factory=dict)

    def evaluate(self, name: str, workdir: Path, kind: Kind, **options: Any) -> Evaluation:
        """``evaluate_kyverno`` of ``workdir`` with the plane's admin kubeconfig, in the
        sandbox (kubectl is staged where sandboxed commands find it); timed as ``name``."""

        async def scored() -> Evaluation:
            async with LocalExecutor() as executor:
                return await evaluate_kyverno(
                    workdir,
                    executor=executor,
                    kind=kind,
                    kubeconfig=self.plane.kubeconfig,
                    **options,
                )

        begun = time.monotonic()
        try:
            return anyio.run(scored)
        finally:
            self.times[name] = round(time.monotonic() - begun, 1)
            print(f"{name}: {self.times[name]}s")

    def policies(self) -> list[str]:
        """The ClusterPolicies the cluster holds, by name."""
        return self.plane.kubectl("get", "clusterpolicies", "-o", "name").stdout.split()


def staged_kubectl(bin_dir: Path) -> Path:
    """kubectl in a directory of its own under /var/tmp: sandboxed commands see neither the
    home (build.sh's cache) nor /tmp."""
    folder = Path(tempfile.mkdtemp(prefix="cmbs-kyverno-bin-", dir="/var/tmp"))
    folder.chmod(0o755)
    shutil.copy2(bin_dir / "kubectl", folder / "kubectl")
    return folder


@pytest.fixture(scope="module")
def bench(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bench]:
    bin_dir = k8s_tools(*PLANE_PROGRAMS, "kyverno-reports-controller")
    if not os.access("/var/tmp", os.W_OK):
        pytest.skip("needs a writable /var/tmp for the kubectl sandboxed commands run")
    folder = tmp_path_factory.mktemp("kyverno-bench")
    for name, text in (("fault", FAULT), ("update-fault", UPDATE_FAULT), ("existing", EXISTING)):
        (folder / f"{name}.yaml").write_text(text)
    staged = staged_kubectl(bin_dir)
    try:
        with pytest.MonkeyPatch.context() as patch, K8sPlane(bin_dir) as plane:
            patch.setenv("PATH", os.pathsep.join([str(staged), os.environ["PATH"]]))
            plane.start_kyverno()
            plane.kubectl("create", "namespace", "paa")
            for manifest in ("fault", "update-fault"):
                plane.kubectl("apply", "-n", "paa", "-f", str(folder / f"{manifest}.yaml"))
            bench = Bench(plane, folder / "existing.yaml")
            yield bench
            print(plane.timings, "evaluations:", bench.times)
    finally:
        shutil.rmtree(staged)


@pytest.fixture
def existing(bench: Bench) -> Iterator[Bench]:
    """The update kind's existing policies in the cluster for one test (as IT-Bench's
    fault_inject deploys them), deleted afterwards."""
    bench.plane.kubectl("apply", "-f", str(bench.existing))
    yield bench
    bench.plane.kubectl("delete", "-f", str(bench.existing), "--ignore-not-found")


def workdir(folder: Path, **files: str) -> Path:
    """An agent's workdir: its files, and the kubeconfig IT-Bench's harness leaves there."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "kubeconfig.yaml").write_text("apiVersion: v1\nkind: Config\n")
    for name, text in files.items():
        (folder / name).write_text(text)
        time.sleep(0.01)  # written in this order (the later file is the one applied)
    return folder


# --- the generate kind -------------------------------------------------------------------


def test_an_honest_generate_policy_passes(
    bench: Bench, tmp_path: Path, record_property: Callable[[str, object], None]
) -> None:
    scored = bench.evaluate(
        "generate honest", workdir(tmp_path, **{"policy.yaml": HONEST}), Kind.KYVERNO_GENERATE
    )
    record_property("kyverno_generate_s", bench.times["generate honest"])
    assert scored.passed, scored.details
    details = scored.details
    assert details["policies"] == [
        {"kind": "ClusterPolicy", "name": "keep-off-host-network", "file": "policy.yaml"}
    ]
    assert details["tasks"] == {"generate_policy": True, "evidence_available": True}
    assert details["itbench"]["checks"] == [
        {
            "check": "generate_assessment_posture",
            "pass": True,
            "message": "a report on Deployment paa/nginx-deployment has summary.fail 1",
        }
    ]
    assert 0 < details["waited_s"] < 120
    # put back: the policy and the probe are gone from the cluster
    assert details["restored"][-1] == "removed ClusterPolicy keep-off-host-network"
    assert bench.policies() == []


def test_a_policy_that_matches_nothing_fails(bench: Bench, tmp_path: Path) -> None:
    scored = bench.evaluate(
        "generate nowhere", workdir(tmp_path, **{"policy.yaml": NOWHERE}), Kind.KYVERNO_GENERATE
    )
    assert not scored.passed
    # Kyverno reported on the fault (the evaluator's probe): none of it is the agent's
    assert scored.details["reason"] == "no report on Deployment paa/nginx-deployment"
    assert bench.policies() == []


def test_strict_fails_a_policy_that_fails_a_compliant_deployment_too(
    bench: Bench, tmp_path: Path
) -> None:
    everything = bench.evaluate(
        "generate everything strict",
        workdir(tmp_path / "everything", **{"policy.yaml": EVERYTHING}),
        Kind.KYVERNO_GENERATE,
        strict=True,
    )
    assert everything.details["itbench"]["pass"] is True  # IT-Bench passes it
    assert not everything.passed
    twin = everything.details["twin"]
    assert twin.startswith("Deployment cmbs-compliant-") and twin.endswith("/nginx-deployment")
    assert everything.details["reason"] == (
        f"the compliant twin {twin} fails require-a-label-nobody-has too"
    )
    honest = bench.evaluate(
        "generate honest strict",
        workdir(tmp_path / "honest", **{"policy.yaml": HONEST}),
        Kind.KYVERNO_GENERATE,
        strict=True,
    )
    assert honest.passed, honest.details
    assert [c["message"] for c in honest.details["strict"]] == [
        "Deployment paa/nginx-deployment fails keep-off-host-network",
        f"the compliant twin {honest.details['twin']} passes keep-off-host-network",
    ]
    # the twins' namespaces go (gone, or their deletion under way), the policies are gone
    for scored in (everything, honest):
        name = scored.details["twin"].split()[1].split("/")[0]
        phase = bench.plane.kubectl(
            "get", "namespace", name, "-o", "jsonpath={.status.phase}", "--ignore-not-found"
        )
        assert phase.stdout in ("", "Terminating")
    assert bench.policies() == []


#: A report of the agent's own making (``kubectl apply`` of it): the fault Deployment
#: failing the agent's policy that matches nothing.
FORGED_REPORT = """\
apiVersion: wgpolicyk8s.io/v1alpha2
kind: PolicyReport
metadata:
  name: made-by-the-agent
  namespace: paa
scope:
  apiVersion: apps/v1
  kind: Deployment
  name: nginx-deployment
  namespace: paa
results:
  - policy: keep-off-host-network-nowhere
    rule: autogen-keep-off-host-network
    result: fail
    message: "Sharing the host network is not allowed."
    source: kyverno
    scored: true
summary: {pass: 0, fail: 1, warn: 0, error: 0, skip: 0}
"""


def test_a_report_the_agent_made_passes_itbench_but_not_strict(
    bench: Bench, tmp_path: Path
) -> None:
    """The cluster as the agent left it: its policy, which matches nothing, and a report it
    made itself saying the fault fails that policy. IT-Bench's criterion reads every
    report, and passes it as IT-Bench's evaluator would; ``--strict`` counts only the
    reports Kyverno wrote as the evaluation ran, and fails it."""
    folder = workdir(tmp_path, **{"policy.yaml": NOWHERE, "report.yaml": FORGED_REPORT})
    made = [str(folder / "policy.yaml"), str(folder / "report.yaml")]
    for path in made:
        bench.plane.kubectl("apply", "-f", path)
    try:
        plain = bench.evaluate("generate forged", folder, Kind.KYVERNO_GENERATE, apply=False)
        strict = bench.evaluate(
            "generate forged strict", folder, Kind.KYVERNO_GENERATE, apply=False, strict=True
        )
        # the forged report is still there: Kyverno neither took nor removed it
        held = bench.plane.kubectl("get", "polr", "-n", "paa", "made-by-the-agent", "-o", "name")
        assert held.stdout.strip() == "policyreport.wgpolicyk8s.io/made-by-the-agent"
    finally:
        for path in reversed(made):
            bench.plane.kubectl("delete", "-f", path, "--ignore-not-found")
    assert plain.passed, plain.details  # IT-Bench's criterion, kept as it is: it is fooled
    assert strict.details["itbench"]["pass"] is True
    assert not strict.passed
    assert strict.details["reason"] == (
        "no policy of the workdir fails Deployment paa/nginx-deployment (a report Kyverno "
        "did not write as the evaluation ran says it fails keep-off-host-network-nowhere: "
        "set aside)"
    )


def test_no_report_in_time_is_no_verdict_and_the_cluster_is_put_back(
    bench: Bench, tmp_path: Path
) -> None:
    with pytest.raises(CannotScore) as waited:
        bench.evaluate(
            "generate no time",
            workdir(tmp_path, **{"policy.yaml": HONEST}),
            Kind.KYVERNO_GENERATE,
            wait_s=0.5,
        )
    message = str(waited.value)
    assert message.startswith(
        "no Kyverno policy report on Deployment paa/nginx-deployment showed the evaluator's "
        "probe policy cmbs-evaluation-probe-"
    )
    assert message.endswith(
        " within 0.5 s: is Kyverno's reports controller running, with background scans?"
    )
    assert "\n" not in message
    assert bench.policies() == []


# --- the update kind ---------------------------------------------------------------------


def test_the_honest_update_passes_also_strictly(existing: Bench, tmp_path: Path) -> None:
    bench = existing
    before = bench.plane.kubectl(
        "get", "clusterpolicy", "container-security-controls", "-o", "json"
    )
    scored = bench.evaluate(
        "update honest strict",
        workdir(tmp_path, **{"fixed.yaml": FIX}),
        Kind.KYVERNO_UPDATE,
        strict=True,
    )
    assert scored.passed, scored.details
    assert scored.details["itbench"]["checks"] == [
        {
            "check": "violation of container-security-controls",
            "pass": True,
            "message": "detected expected result 'fail' in policy "
            "'container-security-controls' for Pod paa/test-untrusted-registry",
        },
        {
            "check": "rules of service-account-requirements unchanged",
            "pass": True,
            "message": "no modification detected in the rules of policy "
            "'service-account-requirements'",
        },
    ]
    assert scored.details["strict"][1]["message"] == (
        f"the compliant twin {scored.details['twin']} passes container-security-controls"
    )
    # the existing policy is back as it was
    assert scored.details["restored"][-1] == "put back ClusterPolicy container-security-controls"
    after = bench.plane.kubectl("get", "clusterpolicy", "container-security-controls", "-o", "json")
    assert json.loads(after.stdout)["spec"]["rules"] == json.loads(before.stdout)["spec"]["rules"]


def test_no_update_fails(existing: Bench, tmp_path: Path) -> None:
    bench = existing
    nothing = bench.evaluate("update nothing", workdir(tmp_path / "none"), Kind.KYVERNO_UPDATE)
    assert not nothing.passed
    assert nothing.details["reason"].startswith("no Kyverno Policy or ClusterPolicy in a *.yaml")
    # the cluster as the agent left it (untouched), scored as IT-Bench scores it
    as_is = bench.evaluate(
        "update as is",
        workdir(tmp_path / "none"),
        Kind.KYVERNO_UPDATE,
        apply=False,
        existing=bench.existing,
    )
    assert not as_is.passed
    assert as_is.details["reason"] == (
        "detected result 'pass' (rule 'no-privilege-escalation') in policy "
        "'container-security-controls' for Pod paa/test-untrusted-registry, expected 'fail'"
    )


def test_an_update_that_changes_the_service_account_policy_fails(
    existing: Bench, tmp_path: Path
) -> None:
    bench = existing
    scored = bench.evaluate(
        "update sa changed",
        workdir(tmp_path, **{"fixed.yaml": FIX, "service-account.yaml": SERVICE_ACCOUNT_CHANGED}),
        Kind.KYVERNO_UPDATE,
    )
    assert not scored.passed
    checks = scored.details["itbench"]["checks"]
    assert [c["pass"] for c in checks] == [True, False]
    assert scored.details["reason"] == "rules mismatch in policy 'service-account-requirements'"
    assert scored.details["restored"][-2:] == [
        "put back ClusterPolicy container-security-controls",
        "put back ClusterPolicy service-account-requirements",
    ]


def test_an_update_whose_first_rule_passes_fails_as_in_itbench(
    existing: Bench, tmp_path: Path
) -> None:
    """IT-Bench reads only the first result of the policy, and Kyverno sorts them by rule
    name: the old rule, which the Pod passes, comes first."""
    scored = existing.evaluate(
        "update three rules", workdir(tmp_path, **{"fixed.yaml": THREE_RULES}), Kind.KYVERNO_UPDATE
    )
    assert not scored.passed
    assert scored.details["reason"].startswith(
        "detected result 'pass' (rule 'no-privilege-escalation')"
    )


# --- no Kyverno --------------------------------------------------------------------------


def test_a_cluster_without_kyverno_is_refused_in_one_line(
    bench: Bench, k8s_plane: K8sPlane, tmp_path: Path
) -> None:
    plane = k8s_plane
    if plane.kyverno_installed():  # another module installed its CRDs there
        pytest.skip("the session's plane has Kyverno's CRDs")
    folder = workdir(tmp_path, **{"policy.yaml": HONEST})

    async def scored() -> Evaluation:
        async with LocalExecutor() as executor:
            return await evaluate_kyverno(
                folder, executor=executor, kind=Kind.KYVERNO_GENERATE, kubeconfig=plane.kubeconfig
            )

    with pytest.raises(CannotScore) as refused:
        anyio.run(scored)
    assert str(refused.value) == (
        f"the cluster of --kubeconfig {plane.kubeconfig} has no Kyverno (no CRD "
        "policyreports.wgpolicyk8s.io): a kyverno-generate scenario needs it installed"
    )
    assert not plane.kyverno_installed()  # nothing was applied


# --- IT-Bench's criteria on real reports ---------------------------------------------------


def settled(plane: K8sPlane, done: Callable[[list[dict[str, Any]]], bool]) -> list[dict[str, Any]]:
    """The reports (as IT-Bench reads them) once ``done`` says they are as expected,
    Kyverno rescanning meanwhile: a report keeps the results of a policy or rule gone
    (an earlier test's) until Kyverno next aggregates it."""
    deadline = time.monotonic() + plane.timeout
    while True:
        reports = plane.kyverno_reports()
        if done(reports):
            return reports
        assert time.monotonic() < deadline, f"the reports never settled: {reports}"
        plane.kyverno_rescan()
        time.sleep(3)


def results_on(reports: list[dict[str, Any]], name: str) -> list[tuple[str, str]]:
    return [
        (result["policy"], result["result"])
        for report in reports
        if report["scope"]["name"] == name
        for result in report["results"]
    ]


def test_the_criteria_on_the_real_reports(existing: Bench) -> None:
    plane = existing.plane
    expected = [("container-security-controls", "pass"), ("service-account-requirements", "pass")]
    reports = settled(
        plane,
        lambda reports: (
            results_on(reports, "test-untrusted-registry") == expected
            and ("container-security-controls", "fail") in results_on(reports, "nginx-deployment")
        ),
    )
    (pod,) = [r for r in reports if r["scope"]["name"] == "test-untrusted-registry"]
    # the fault Pod passes the existing policy: IT-Bench's update check fails
    assert not violation_check(reports).passed
    assert violation_check(reports, expected="pass").passed
    policies = [
        *json_items(plane, "policies", "-A"),
        *json_items(plane, "clusterpolicies"),
    ]
    assert rules_unchanged_check(policies, policies).passed
    # the existing Pod rules fail the Deployment (no securityContext): any generate
    # workdir would pass on this cluster
    assert generate_check(reports).passed
    assert not generate_check(reports, Resource("apps/v1", "Deployment", "paa", "none")).passed
    # a probe's results are taken out, counted out of the summary, and a report that had
    # nothing else goes
    (kept,) = without_policies([pod], "container-security")
    assert [r["policy"] for r in kept["results"]] == ["service-account-requirements"]
    assert kept["summary"]["pass"] == pod["summary"]["pass"] - 1
    assert without_policies([pod], "") == []


def json_items(plane: K8sPlane, *args: str) -> list[dict[str, Any]]:
    listed: dict[str, Any] = json.loads(plane.kubectl("get", *args, "-o", "json").stdout)
    return list(listed["items"])


def test_compare_dicts_as_itbench_has_it() -> None:
    rules = [{"name": "a", "validate": {"pattern": {"spec": {"x": "!default"}}}}]
    assert covers(rules, [{**rules[0], "added": True}])  # added keys are no change
    assert not covers(rules, [{"name": "a", "validate": {"pattern": {"spec": {"x": "y"}}}}])
    assert covers(rules, [])  # pairs as far as the shorter list goes: rules emptied pass
    assert covers(rules, [rules[0], {"name": "b"}])  # a rule added passes


def test_the_scope_matches_as_itbench_has_them() -> None:
    failing = {"summary": {"fail": 1}, "results": [{"policy": "p", "result": "fail"}]}
    no_namespace = {
        **failing,
        "scope": {"apiVersion": "apps/v1", "kind": "Deployment", "name": "nginx-deployment"},
    }
    # main.py compares the namespace only where the scope has one
    assert generate_check([no_namespace]).passed
    # evaluation.py takes a missing namespace as ""
    pod = {**failing, "scope": {"apiVersion": "v1", "kind": "Pod", "name": UPDATE_TARGET.name}}
    assert not violation_check([pod], policy="p").passed
    assert violation_check(
        [{**pod, "scope": {**pod["scope"], "namespace": "paa"}}], policy="p"
    ).passed
    assert GENERATE_TARGET.kubectl_type == "deployment.v1.apps"
    assert UPDATE_TARGET.kubectl_type == "pod"


# --- the agent's workdir -------------------------------------------------------------------


def test_only_the_workdirs_kyverno_policies_are_applied(tmp_path: Path) -> None:
    dumped = yaml.safe_load(HONEST)
    dumped["metadata"] |= {"resourceVersion": "42", "uid": "abc"}
    dumped["status"] = {"ready": True}
    folder = workdir(
        tmp_path,
        **{
            "old.yaml": EVERYTHING,
            # as `kubectl get clusterpolicies -o yaml` writes it: a List (JSON is YAML)
            "dump.yml": json.dumps({"apiVersion": "v1", "kind": "List", "items": [dumped]}),
            "deployment.yaml": FAULT,
            "notes.yaml": ": not yaml : [",
            "new.yaml": EVERYTHING.replace("cmbs-nowhere", "cmbs-elsewhere"),
        },
    )
    (folder / "linked.yaml").symlink_to(folder / "new.yaml")
    found = agent_policies(folder)
    # the kubeconfig and the Deployment are no policies; the later file's definition wins
    assert found.listed() == [
        {"kind": "ClusterPolicy", "name": "require-a-label-nobody-has", "file": "new.yaml"},
        {"kind": "ClusterPolicy", "name": "keep-off-host-network", "file": "dump.yml"},
    ]
    assert found.superseded == ("ClusterPolicy require-a-label-nobody-has of old.yaml",)
    assert set(found.unreadable) == {"notes.yaml", "linked.yaml"}
    dumped_policy = next(
        d for d in found.documents if d["metadata"]["name"] == "keep-off-host-network"
    )
    assert "resourceVersion" not in dumped_policy["metadata"] and "status" not in dumped_policy


def test_the_compliant_twins() -> None:
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "nginx-deployment", "namespace": "paa", "uid": "u"},
        "spec": {"template": {"spec": {"hostNetwork": True, "containers": []}}},
    }
    (twin,) = compliant_twin(Kind.KYVERNO_GENERATE, deployment, "elsewhere")
    assert twin["metadata"] == {"name": "nginx-deployment", "namespace": "elsewhere"}
    assert twin["spec"]["template"]["spec"]["hostNetwork"] is False
    assert deployment["spec"]["template"]["spec"]["hostNetwork"] is True  # a copy
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "p", "namespace": "paa"},
        "spec": {
            "nodeName": "n",
            "priority": 0,
            "serviceAccountName": "non-default-sa",
            "volumes": [{"name": "kube-api-access-x", "projected": {}}],
            "containers": [
                {
                    "name": "c",
                    "image": "untrusted-registry.com/test-image",
                    "volumeMounts": [{"name": "kube-api-access-x", "mountPath": "/var/run"}],
                    "securityContext": {"runAsUser": 1000},
                }
            ],
        },
    }
    account, twin = compliant_twin(Kind.KYVERNO_UPDATE, pod, "elsewhere")
    assert account["kind"] == "ServiceAccount" and account["metadata"]["name"] == "non-default-sa"
    assert twin["spec"] == {
        "serviceAccountName": "non-default-sa",
        "containers": [
            {
                "name": "c",
                "image": "trusted-registry.com/test-image",
                "securityContext": {
                    "runAsUser": 1000,
                    "runAsNonRoot": True,
                    "allowPrivilegeEscalation": False,
                },
            }
        ],
    }
