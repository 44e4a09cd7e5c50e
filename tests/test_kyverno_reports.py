"""Kyverno's own reports controller (marker ``k8s``), run against the local control plane,
writes the PolicyReports IT-Bench's Kyverno evaluation reads (``kubectl get polr -A -o
json``): one per resource, its ``scope`` the resource, its ``summary.fail`` counting the
failed rules; none for a policy that matches nothing; a pass for a compliant resource."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from .helpers import live_group_members, live_pids
from .k8s_helpers import FAULT
from .k8s_plane import PLANE_PROGRAMS, K8sPlane, k8s_tools

pytestmark = pytest.mark.k8s

POLICY = "disallow-host-network"
NOWHERE = "disallow-host-network-nowhere"
#: CIS 5.2.5 as IT-Bench's Kyverno kinds ask for it, in the style of Kyverno's
#: disallow-host-namespaces sample; and the same rule matching only a namespace that
#: does not exist
POLICIES = f"""\
apiVersion: kyverno.io/v1
kind: ClusterPolicy
metadata:
  name: {POLICY}
  annotations:
    policies.kyverno.io/title: Disallow Host Network
    policies.kyverno.io/category: Pod Security Standards (Baseline)
    policies.kyverno.io/severity: medium
    policies.kyverno.io/subject: Pod
    policies.kyverno.io/description: >-
      CIS 5.2.5: containers should not share the host's network namespace. This policy
      ensures spec.hostNetwork is unset or set to `false`.
spec:
  validationFailureAction: Audit
  background: true
  rules:
    - name: host-network
      match:
        any:
        - resources:
            kinds:
              - Pod
      validate:
        message: >-
          Sharing the host network namespace is disallowed. The field spec.hostNetwork
          must be unset or set to `false`.
        pattern:
          spec:
            =(hostNetwork): "false"
---
apiVersion: kyverno.io/v1
kind: ClusterPolicy
metadata:
  name: {NOWHERE}
spec:
  validationFailureAction: Audit
  background: true
  rules:
    - name: host-network
      match:
        any:
        - resources:
            kinds:
              - Pod
            namespaces:
              - no-such-namespace
      validate:
        message: "spec.hostNetwork must be unset or set to `false`."
        pattern:
          spec:
            =(hostNetwork): "false"
"""
#: the fault with hostNetwork false, applied into another namespace under the same name
COMPLIANT = FAULT.replace("hostNetwork: true", "hostNetwork: false")
assert COMPLIANT != FAULT


@dataclass
class Scan:
    plane: K8sPlane
    installed_before: bool
    #: from the controller's start to the fault Deployment's report
    first_report_seconds: float


@pytest.fixture(scope="module")
def scan(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scan]:
    """A plane of its own (the session's has no Kyverno controller, and its tests expect no
    report) with Kyverno started, IT-Bench's fault in ``paa``, a compliant twin in
    ``compliant`` and both policies applied, once Kyverno reported on both Deployments."""
    folder = tmp_path_factory.mktemp("kyverno")
    for name, text in (("fault", FAULT), ("compliant", COMPLIANT), ("policies", POLICIES)):
        (folder / f"{name}.yaml").write_text(text)
    with K8sPlane(k8s_tools(*PLANE_PROGRAMS, "kyverno-reports-controller")) as plane:
        installed_before = plane.kyverno_installed()
        plane.start_kyverno()
        started = time.monotonic()
        for namespace, manifest in (("paa", "fault"), ("compliant", "compliant")):
            plane.kubectl("create", "namespace", namespace)
            plane.kubectl("apply", "-n", namespace, "-f", str(folder / f"{manifest}.yaml"))
        plane.kubectl("apply", "-f", str(folder / "policies.yaml"))
        plane.wait_for_kyverno_report("Deployment", "paa", "nginx-deployment", policy=POLICY)
        first = plane.kyverno_started_seconds + time.monotonic() - started
        plane.wait_for_kyverno_report("Deployment", "compliant", "nginx-deployment", policy=POLICY)
        controller = plane.pids["kyverno-reports-controller"]
        yield Scan(plane, installed_before, first)
    print(plane.timings)
    assert live_pids([controller]) == []
    assert live_group_members(controller) == []
    assert not Path(plane.dir).exists()


def about(
    reports: list[dict[str, Any]], kind: str, namespace: str, name: str
) -> list[dict[str, Any]]:
    """The reports whose scope is that resource, matched as IT-Bench's evaluation/main.py
    does (apiVersion, kind, namespace when the scope has one, name)."""
    api_version = "v1" if kind == "Pod" else "apps/v1"
    return [
        r
        for r in reports
        if (r["scope"]["apiVersion"], r["scope"]["kind"], r["scope"]["name"])
        == (api_version, kind, name)
        and r["scope"].get("namespace", namespace) == namespace
    ]


def test_kyverno_is_installed_once_its_crds_are(scan: Scan) -> None:
    assert scan.installed_before is False
    assert scan.plane.kyverno_installed() is True


def test_the_fault_deployment_gets_a_failing_report(
    scan: Scan, record_property: Callable[[str, object], None]
) -> None:
    print(scan.plane.timings, f"first report {scan.first_report_seconds:.1f}s")
    record_property("kyverno_started_s", round(scan.plane.kyverno_started_seconds, 2))
    record_property("kyverno_first_report_s", round(scan.first_report_seconds, 2))
    reports = scan.plane.kyverno_reports()  # kubectl get polr -A / cpolr -A, as IT-Bench
    (report,) = about(reports, "Deployment", "paa", "nginx-deployment")
    assert report["apiVersion"] == "wgpolicyk8s.io/v1alpha2"
    assert report["kind"] == "PolicyReport"
    assert report["metadata"]["namespace"] == "paa"
    assert report["summary"]["fail"] > 0  # IT-Bench's pass condition
    (result,) = report["results"]
    assert (result["policy"], result["rule"], result["result"]) == (
        POLICY,
        "autogen-host-network",  # Kyverno's rule for Pod controllers, made from the Pod rule
        "fail",
    )
    assert "/spec/template/spec/hostNetwork/" in result["message"]


def test_a_policy_matching_nothing_reports_nothing(scan: Scan) -> None:
    reports = scan.plane.kyverno_reports()
    assert [r for r in reports for x in r["results"] if x["policy"] == NOWHERE] == []
    # so with it alone, the fault Deployment would have no failing report: its failures
    # are all the matching policy's
    (report,) = about(reports, "Deployment", "paa", "nginx-deployment")
    assert {x["policy"] for x in report["results"] if x["result"] == "fail"} == {POLICY}


def test_a_compliant_deployment_gets_a_pass(scan: Scan) -> None:
    (report,) = about(scan.plane.kyverno_reports(), "Deployment", "compliant", "nginx-deployment")
    assert report["summary"]["fail"] == 0
    assert report["summary"]["pass"] > 0
    assert [(x["policy"], x["result"]) for x in report["results"]] == [(POLICY, "pass")]
