"""The local Kubernetes control plane (marker ``k8s``) holds IT-Bench's Kubernetes CISO
fault as a kind cluster would: the Deployment, its ReplicaSet and Pod, the fields a
policy reads, and Kyverno's report types, answered through kubectl."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from .helpers import live_group_members, live_pids
from .k8s_helpers import FAULT
from .k8s_plane import K8sPlane, k8s_tools

pytestmark = pytest.mark.k8s


def items(plane: K8sPlane, *args: str) -> list[dict[str, Any]]:
    """The objects ``kubectl get ARGS -o json`` lists."""
    listed: dict[str, Any] = json.loads(plane.kubectl("get", *args, "-o", "json").stdout)
    return list(listed["items"])


@pytest.fixture(scope="module")
def fault(k8s_plane: K8sPlane, tmp_path_factory: pytest.TempPathFactory) -> K8sPlane:
    """The plane with IT-Bench's fault injected as its playbooks do it (namespace ``paa``
    created, the manifest applied into it), once its Pod exists."""
    manifest = tmp_path_factory.mktemp("fault") / "application.yaml"
    manifest.write_text(FAULT)
    k8s_plane.kubectl("create", "namespace", "paa")
    k8s_plane.kubectl("apply", "-n", "paa", "-f", str(manifest))
    # status.replicas counts the Pods created: the ReplicaSet exists and made its Pod
    k8s_plane.kubectl(
        "wait",
        "-n",
        "paa",
        "deploy/nginx-deployment",
        "--for=jsonpath={.status.replicas}=1",
        "--timeout=120s",
    )
    return k8s_plane


def test_the_plane_serves_the_pinned_kubernetes(
    k8s_plane: K8sPlane, record_property: Callable[[str, object], None]
) -> None:
    print(k8s_plane.timings)
    record_property("k8s_plane_readyz_s", round(k8s_plane.readyz_seconds, 2))
    record_property("k8s_plane_started_s", round(k8s_plane.started_seconds, 2))
    assert 0 < k8s_plane.readyz_seconds <= k8s_plane.started_seconds
    version = json.loads(k8s_plane.kubectl("version", "-o", "json").stdout)
    assert version["serverVersion"]["gitVersion"] == "v1.36.3"
    assert version["clientVersion"]["gitVersion"] == "v1.36.3"


def test_the_fault_gets_its_replicaset_and_a_pending_pod(fault: K8sPlane) -> None:
    (replicaset,) = items(fault, "rs", "-n", "paa")
    owner = replicaset["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["name"]) == ("Deployment", "nginx-deployment")
    (pod,) = items(fault, "pods", "-n", "paa")
    assert pod["metadata"]["ownerReferences"][0]["name"] == replicaset["metadata"]["name"]
    assert pod["status"]["phase"] == "Pending"  # no scheduler, no kubelet


def test_host_network_reads_true_where_a_policy_looks(fault: K8sPlane) -> None:
    deployment = json.loads(
        fault.kubectl("get", "deploy", "-n", "paa", "nginx-deployment", "-o", "json").stdout
    )
    assert deployment["spec"]["template"]["spec"]["hostNetwork"] is True
    # the Pods a kubectl-opa script collects (`kubectl get pods -o json`: input.items)
    assert [p["spec"]["hostNetwork"] for p in items(fault, "pods", "-n", "paa")] == [True]


def test_kyverno_crds_install_and_no_report_exists_yet(k8s_plane: K8sPlane) -> None:
    installed = k8s_plane.install_kyverno_crds()
    assert set(installed) == {
        "policyreports.wgpolicyk8s.io",
        "clusterpolicyreports.wgpolicyk8s.io",
        "policies.kyverno.io",
        "clusterpolicies.kyverno.io",
    }
    # what IT-Bench's Kyverno evaluation reads, before any policy ran
    assert items(k8s_plane, "polr", "-A") == []
    assert items(k8s_plane, "cpolr") == []
    assert items(k8s_plane, "clusterpolicies") == []


def test_stopping_a_plane_leaves_nothing_running(
    record_property: Callable[[str, object], None],
) -> None:
    with K8sPlane(k8s_tools()) as plane:
        pids = list(plane.pids.values())
        assert sorted(plane.pids) == ["etcd", "kube-apiserver", "kube-controller-manager"]
        assert live_pids(pids) == pids
    print(plane.timings)
    record_property("k8s_plane_stopped_s", round(plane.stopped_seconds, 2))
    assert live_pids(pids) == []
    assert [m for pid in pids for m in live_group_members(pid)] == []
    assert not Path(plane.dir).exists()
