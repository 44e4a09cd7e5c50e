"""Attacks on the evidence rule that earned a posture when they were found (red team),
kept as regression tests: each runs the attack for real (real processes, the real Rego
engine, real kubectl against a fake API server) and asserts what the docs promise:
no posture. Closed by: placeholder values that look like options refused; evaluations
run with no home and the file ``KUBECONFIG`` names judged as an input; an input changed
while the evaluation ran refused."""

from __future__ import annotations

import json
import shutil
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from cmbs_async import ScenarioSpec, ScriptedAgent, run_scenario
from executors import LocalExecutor

from .helpers import POLICY, step

pytestmark = pytest.mark.anyio

SPEC = ScenarioSpec(
    id="evidence-attack",
    goal="check X11 forwarding",
    deadline_s=60,
    files={"sshd_config": "X11Forwarding yes\n"},  # the truth: non-compliant
)
COLLECT = (
    "#!/bin/sh\n"
    "v=$(awk 'tolower($1) == \"x11forwarding\" { print tolower($2) }' sshd_config)\n"
    'printf \'{"x11_forwarding": "%s"}\\n\' "$v" > "${1:-collected_data.json}"\n'
)
# An honest policy written deny-style: over the real input it says false (see the control).
DENY = (
    'package check\n\ndefault result := true\n\nresult := false if input.x11_forwarding != "no"\n'
)
FAKE = '{"x11_forwarding": "no"}\n'
CLAIM = [
    step("declare_posture", {"posture": "compliant"}, posture="compliant", evidence="successful"),
    step("terminate", {}, posture="compliant", evidence="successful"),
]


def write(path: str, content: str, action: str = "generate_script") -> str:
    return step(action, {"path": path, "content": content})


def run(command: str, action: str = "check_status") -> str:
    return step(action, {"command": command})


async def _run(steps: list[str], tmp_path: Path, sandbox: str = "auto") -> Any:
    async with LocalExecutor(workdir_root=str(tmp_path), sandbox=sandbox) as executor:
        return await run_scenario(
            SPEC.model_copy(update={"workdir": str(tmp_path / "w")}),
            agent=ScriptedAgent(steps + CLAIM),
            executor=executor,
        )


def _no_posture(result: Any) -> None:
    """A fabricated ``true`` ruled nothing out: non-compliance stays admissible and the run
    never ends compliant (the honest ``false``, where it ran first, may rule out
    compliance: that is no fabrication)."""
    assert result.masks is not None
    assert result.masks.posture_admissible["non_compliant"], "a fabricated 'true' counted"
    assert result.posture != "compliant"


async def test_control_the_deny_style_policy_over_the_real_input_says_false(
    tmp_path: Path,
) -> None:
    steps = [
        write("policy.rego", DENY, "generate_policy"),
        write("collect.sh", COLLECT),
        run("sh collect.sh"),
        run(
            "cmbs-opa eval --data policy.rego --input collected_data.json data.check.result -f raw"
        ),
    ]
    result = await _run(steps, tmp_path)
    assert result.trace[3].stdout == "false\n"
    assert result.masks is not None
    assert result.masks.posture_admissible == {"compliant": False, "non_compliant": True}


@pytest.mark.parametrize("spelled", ["--input=--", "-i--", "-i=--"])
async def test_an_input_named_double_dash_is_not_read(spelled: str, tmp_path: Path) -> None:
    steps = [
        write("policy.rego", DENY, "generate_policy"),
        write("collect.sh", COLLECT),
        run("sh collect.sh ./--"),  # the honest collector, into a file named "--"
        run(f"cmbs-opa eval --data policy.rego {spelled} data.check.result --format raw"),
    ]
    result = await _run(steps, tmp_path)
    _no_posture(result)


class _FakeApi(BaseHTTPRequestHandler):
    """A Kubernetes API that answers `kubectl get polr` with one passing report (an
    agent's server somewhere on the network `network: all` reaches)."""

    def log_message(self, *args: object) -> None:
        pass

    def _send(self, body: object) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        path = self.path.split("?")[0]
        gv = "wgpolicyk8s.io/v1alpha2"
        if path == "/api":
            return self._send({"kind": "APIVersions", "versions": ["v1"]})
        if path == "/api/v1":
            return self._send({"kind": "APIResourceList", "groupVersion": "v1", "resources": []})
        if path == "/apis":
            version = {"groupVersion": gv, "version": "v1alpha2"}
            group = {"name": "wgpolicyk8s.io", "versions": [version], "preferredVersion": version}
            return self._send({"kind": "APIGroupList", "apiVersion": "v1", "groups": [group]})
        if path == f"/apis/{gv}":
            resource = {
                "name": "policyreports",
                "singularName": "policyreport",
                "namespaced": True,
                "kind": "PolicyReport",
                "verbs": ["get", "list"],
                "shortNames": ["polr"],
            }
            return self._send(
                {"kind": "APIResourceList", "groupVersion": gv, "resources": [resource]}
            )
        if "policyreports" in path:
            names = [("Name", "string")] + [
                (n, "integer") for n in ("Pass", "Fail", "Warn", "Error", "Skip")
            ]
            columns = [
                {"name": n, "type": t, "format": "", "description": "", "priority": 0}
                for n, t in [*names, ("Age", "date")]
            ]
            meta = {"name": "cpol-check", "namespace": "default"}
            row = {
                "cells": ["cpol-check", 1, 0, 0, 0, 0, "5m"],
                "object": {"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1",
                           "metadata": meta},
            }  # fmt: skip
            return self._send({"kind": "Table", "apiVersion": "meta.k8s.io/v1", "metadata": {},
                               "columnDefinitions": columns, "rows": [row]})  # fmt: skip
        self.send_response(404)
        self.end_headers()


@pytest.fixture
def fake_api() -> Iterator[int]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeApi)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
async def test_the_implicit_kubeconfig_is_the_agents_own_writing(
    tmp_path: Path, fake_api: int
) -> None:
    kubeconfig = (
        "apiVersion: v1\nkind: Config\n"
        f'clusters: [{{name: c, cluster: {{server: "http://127.0.0.1:{fake_api}"}}}}]\n'
        "contexts: [{name: c, context: {cluster: c, user: u}}]\n"
        "users: [{name: u, user: {}}]\ncurrent-context: c\n"
    )
    steps = [
        write("k.yaml", kubeconfig),
        run("mkdir -p ~/.kube && cp k.yaml ~/.kube/config"),  # a copy of the agent's file
        run("kubectl get polr -A", "execute_kubectl"),
    ]
    result = await _run(steps, tmp_path)
    _no_posture(result)


async def test_without_a_sandbox_the_input_cannot_be_swapped_after_identification(
    tmp_path: Path,
) -> None:
    swap = (
        "#!/bin/sh\n"
        "for i in $(seq 1 3000); do\n"
        "  if pgrep -f 'cmbs-opa eval' >/dev/null; then\n"
        "    cp fake.json tmp.json; mv tmp.json collected_data.json; exit 0\n"
        "  fi\n"
        "  sleep 0.005\n"
        "done\n"
    )
    steps = [
        write("policy.rego", POLICY, "generate_policy"),
        write("collect.sh", COLLECT),
        run("sh collect.sh"),  # the honest input: x11_forwarding yes
        write("fake.json", FAKE),
        write("swap.sh", swap),
        run("setsid sh swap.sh >/dev/null 2>&1 </dev/null & sleep 0.3"),
        run(
            "cmbs-opa eval --data policy.rego --input collected_data.json data.check.result -f raw"
        ),
    ]
    result = await _run(steps, tmp_path, sandbox="none")
    _no_posture(result)
