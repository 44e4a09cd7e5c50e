"""Shared pieces of the ``k8s`` tests: IT-Bench's faults, the host-network Kyverno policy,
the update kind's policies before and after an honest edit, and the helpers that drive
``cmbs itbench run``/``evaluate`` and read a run's evidence, with the real programs on a
given ``PATH``."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

from .helpers import CMBS

#: IT-Bench's fault, as in its scenarios/ciso/2.gen-cis-b-k8s-kubectl-opa/manifests/
#: application.yaml (the same for the Kyverno scenarios): applied into namespace ``paa``.
FAULT = """\
apiVersion: apps/v1
kind: Deployment
metadata:
  name: nginx-deployment
spec:
  selector:
    matchLabels:
      app: nginx
  replicas: 1
  template:
    metadata:
      labels:
        app: nginx
    spec:
      hostPID: false
      hostIPC: false
      hostNetwork: true
      containers:
      - name: nginx
        image: nginx:1.14.2
        ports:
        - containerPort: 80
"""

#: CIS 5.2.5 as a Kyverno policy, as the generate kind asks for it: Pods (and, by
#: Kyverno's autogen, their controllers) must keep off the host network.
HOST_NETWORK_POLICY = """\
apiVersion: kyverno.io/v1
kind: ClusterPolicy
metadata:
  name: keep-off-host-network
spec:
  validationFailureAction: Audit
  background: true
  rules:
    - name: host-network
      match:
        any:
        - resources:
            kinds: [Pod]
      validate:
        message: "Containers must not share the host's network namespace."
        pattern:
          spec:
            =(hostNetwork): "false"
"""

#: The update kind's fault: a Pod of a registry nobody trusts, in ``paa``.
UPDATE_FAULT = """\
apiVersion: v1
kind: ServiceAccount
metadata:
  name: non-default-sa
---
apiVersion: v1
kind: Pod
metadata:
  name: test-untrusted-registry
spec:
  serviceAccountName: non-default-sa
  containers:
    - name: test
      image: untrusted-registry.com/test-image
      securityContext:
        allowPrivilegeEscalation: false
        runAsUser: 1000
"""
SERVICE_ACCOUNT_POLICY = """\
apiVersion: kyverno.io/v1
kind: ClusterPolicy
metadata:
  name: service-account-requirements
spec:
  rules:
    - name: no-default-service-account
      match:
        resources:
          kinds: [Pod]
      validate:
        message: "Pods must name a service account other than default."
        pattern:
          spec:
            serviceAccountName: "!default"
"""
#: The update kind's policy to edit, as it starts (the fault Pod passes it).
CONTAINER_CONTROLS = """\
apiVersion: kyverno.io/v1
kind: ClusterPolicy
metadata:
  name: container-security-controls
spec:
  rules:
    - name: no-privilege-escalation
      match:
        resources:
          kinds: [Pod]
      validate:
        message: "Containers must not allow privilege escalation."
        pattern:
          spec:
            containers:
              - (name): "*"
                securityContext:
                  allowPrivilegeEscalation: false
"""
#: The policies the update kind starts from (the fault Pod passes both).
EXISTING = SERVICE_ACCOUNT_POLICY + "---\n" + CONTAINER_CONTROLS
#: The honest edit: one rule asking all three of every container.
FIX = """\
apiVersion: kyverno.io/v1
kind: ClusterPolicy
metadata:
  name: container-security-controls
spec:
  rules:
    - name: hardened-containers
      match:
        resources:
          kinds: [Pod]
      validate:
        message: "No privilege escalation, no root, images from trusted-registry.com only."
        pattern:
          spec:
            containers:
              - (name): "*"
                image: "trusted-registry.com/*"
                securityContext:
                  allowPrivilegeEscalation: false
                  runAsNonRoot: true
"""

Steps = list[tuple[str, dict[str, Any], str]]


def cmbs_on(path: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """``cmbs ARGS`` with ``PATH`` set to ``path``."""
    return subprocess.run(
        [*CMBS, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PATH": path},
        stdin=subprocess.DEVNULL,
    )


def steps(path: Path, *actions: tuple[str, dict[str, Any], str]) -> Path:
    """A scripted agent's steps file: each action with the posture its belief claims."""
    lines = []
    for action, payload, posture in actions:
        belief = {"affordances": {}, "posture": posture, "evidence": "none"}
        lines.append(json.dumps({"belief": belief, "action": {"type": action, "payload": payload}}))
    path.write_text("\n".join(lines) + "\n")
    return path


def scenario_data(folder: Path, kubeconfig: str, goal: str) -> Path:
    """IT-Bench's scenario data for ``goal`` on the cluster of ``kubeconfig`` (its text)."""
    path = folder / "scenario_data.json"
    path.write_text(json.dumps({"goal_template": goal, "vars": {"kubeconfig": kubeconfig}}))
    return path


def run_args(data: Path, workdir: Path, script: Path, *more: str) -> list[str]:
    """The arguments of ``cmbs itbench run`` of ``data`` in ``workdir`` with the
    scripted agent of ``script``."""
    return [
        "itbench",
        "run",
        str(data),
        "--workdir",
        str(workdir),
        "--agent",
        f"script:{script}",
        *more,
    ]


def itbench_run(
    path: str, data: Path, folder: Path, agent: Steps, *more: str
) -> tuple[Path, dict[str, Any]]:
    """``cmbs itbench run`` of ``data`` with a scripted agent: its DIR and its result
    (``--json``)."""
    workdir = folder / "agent"
    script = steps(folder / "steps.jsonl", *agent)
    done = cmbs_on(path, *run_args(data, workdir, script, "--json", *more))
    assert done.stdout, done.stderr
    return workdir, dict(json.loads(done.stdout))


def evaluate(path: str, kubeconfig: Path, workdir: Path, *more: str) -> tuple[int, dict[str, Any]]:
    """``cmbs itbench evaluate`` of ``workdir`` against the cluster of ``kubeconfig``: its
    exit status and what it printed (``--json``, the same as evaluation.json)."""
    done = cmbs_on(
        path,
        "itbench",
        "evaluate",
        str(workdir),
        "--kubeconfig",
        str(kubeconfig),
        "--json",
        *more,
    )
    assert done.stderr == "" and done.returncode in (0, 1), done.stderr
    evaluation = dict(json.loads(done.stdout))
    assert done.returncode == (0 if evaluation["pass"] else 1)
    return done.returncode, evaluation


def evidence(path: str, result: Any) -> list[dict[str, Any]]:
    """The provenance chains the run's audit trail recorded."""
    done = cmbs_on(path, "audit", "export", "--jsonl", result["audit_db"])
    assert done.returncode == 0, done.stderr
    records = [json.loads(line) for line in done.stdout.splitlines()]
    return [
        r["body"]["data"]
        for r in records
        if r["kind"] == "evidence" and r["session_id"] == result["session_id"]
    ]
