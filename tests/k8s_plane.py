"""A local Kubernetes control plane for the ``k8s`` tests: the real etcd, kube-apiserver
and kube-controller-manager built by ``tools/k8s/build.sh``, on loopback.

No scheduler and no kubelet: a Deployment gets its ReplicaSet and its Pods, and the
Pods stay Pending, which is all IT-Bench's Kubernetes CISO scenarios look at (objects,
their fields and the policy reports about them). Each plane has its own CA, serving
certificate, service-account key pair, admin token and etcd data in a temporary folder,
listens on free ports of 127.0.0.1, and is stopped (only its processes) when done.

``start_kyverno()`` adds Kyverno as IT-Bench's scenarios have it (there, its Helm chart
in a kind cluster): every Kyverno CRD, and Kyverno's own reports controller, run out of
cluster against the plane, whose background scan writes the ``wgpolicyk8s.io``
PolicyReports that ``kubectl get polr -A -o json`` shows IT-Bench's evaluation.
"""

from __future__ import annotations

import base64
import contextlib
import datetime
import ipaddress
import json
import os
import re
import secrets
import shutil
import signal
import ssl
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from .sshd import free_port

REPO = Path(__file__).resolve().parent.parent
BUILD = "bash tools/k8s/build.sh"
PLANE_PROGRAMS = ("etcd", "kube-apiserver", "kube-controller-manager", "kubectl")
#: the Kyverno CRDs a PolicyReport check needs: the reports IT-Bench reads, and the
#: policies that make them (paths under the module's ``config/crds``)
KYVERNO_CRDS = (
    "policyreport/wgpolicyk8s.io_policyreports.yaml",
    "policyreport/wgpolicyk8s.io_clusterpolicyreports.yaml",
    "kyverno/kyverno.io_policies.yaml",
    "kyverno/kyverno.io_clusterpolicies.yaml",
)
#: what says "Kyverno is installed" in a cluster: the report type IT-Bench reads and the
#: policy type an agent writes (``kubectl get crd NAMES`` exits 0 only when both are there)
KYVERNO_PRESENCE_CRDS = ("policyreports.wgpolicyk8s.io", "clusterpolicies.kyverno.io")
KYVERNO_NAMESPACE = "kyverno"
#: what the Helm chart's reports-controller Deployment sets (the pod name is ours)
KYVERNO_ENV = {
    "KYVERNO_NAMESPACE": KYVERNO_NAMESPACE,
    "KYVERNO_SERVICEACCOUNT_NAME": "kyverno-reports-controller",
    "KYVERNO_DEPLOYMENT": "kyverno-reports-controller",
    "KYVERNO_POD_NAME": "kyverno-reports-controller-cmbs",
    "INIT_CONFIG": "kyverno",
    "METRICS_CONFIG": "kyverno-metrics",
}
#: the chart's reports-controller flags at its default values (features.*), less the
#: registry credential helpers (no image is verified here)
KYVERNO_FLAGS = (
    "--admissionReports=true",
    "--aggregateReports=true",
    "--policyReports=true",
    "--validatingAdmissionPolicyReports=true",
    "--mutatingAdmissionPolicyReports=false",
    "--backgroundScan=true",
    "--backgroundScanWorkers=2",
    "--backgroundScanInterval=1h",
    "--skipResourceFilters=true",
    "--enableConfigMapCaching=true",
    "--enableDeferredLoading=true",
    "--omitEvents=PolicyApplied,PolicySkipped",
    "--enablePolicyException=false",
    "--openreportsEnabled=false",
    "--resyncPeriod=15m",
    "--loggingFormat=text",
    "--v=2",
)
#: the chart's ``kyverno`` ConfigMap, the keys at their defaults that are not empty
#: (its resourceFilters are skipped by the reports controller: --skipResourceFilters)
KYVERNO_CONFIG = {
    "enableDefaultRegistryMutation": "true",
    "defaultRegistry": "docker.io",
    "excludeGroups": "system:nodes",
    "generateSuccessEvents": "false",
}


def tools_dir() -> Path:
    """Where build.sh puts the programs: ``CMBS_K8S_TOOLS``, else ``$CMBS_TOOLS_DIR/bin``
    (build.sh's own setting), else ``~/.cache/cmbs-tools/bin``."""
    if os.environ.get("CMBS_K8S_TOOLS"):
        return Path(os.environ["CMBS_K8S_TOOLS"])
    root = os.environ.get("CMBS_TOOLS_DIR") or Path.home() / ".cache" / "cmbs-tools"
    return Path(root) / "bin"


def k8s_tools(*names: str) -> Path:
    """The tools directory, when it has every one of ``names`` (default: the plane's).
    Skips a test without them; in CI (``CI`` set) they must be there."""
    bin_dir = tools_dir()
    missing = [n for n in names or PLANE_PROGRAMS if not os.access(bin_dir / n, os.X_OK)]
    if missing:
        message = f"needs {', '.join(missing)} in {bin_dir}: run `{BUILD}`"
        if os.environ.get("CI"):
            pytest.fail(f"CI must have the Kubernetes programs ({message})")
        pytest.skip(message)
    return bin_dir


def kyverno_crds_dir() -> Path:
    """Kyverno's CRDs in the Go module cache, at the version build.sh pins (they are read
    from there, never copied into this repository)."""
    pinned = re.search(r"^KYVERNO_VERSION=(\S+)", (REPO / "tools/k8s/build.sh").read_text(), re.M)
    assert pinned is not None, "tools/k8s/build.sh pins no KYVERNO_VERSION"
    cache = os.environ.get("GOMODCACHE")
    if not cache and shutil.which("go"):
        cache = subprocess.run(
            ["go", "env", "GOMODCACHE"], capture_output=True, text=True, check=True
        ).stdout.strip()
    cache = cache or str(Path.home() / "go" / "pkg" / "mod")
    crds = Path(cache) / f"github.com/kyverno/kyverno@{pinned.group(1)}/config/crds"
    if not crds.is_dir():
        message = f"needs Kyverno's module in the Go module cache ({crds}): run `{BUILD}`"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return crds


def _certificates(folder: Path, token: str) -> None:
    """A CA, the API server's serving certificate for 127.0.0.1 signed by it, a
    service-account key pair, and the admin token (group ``system:masters``)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    def pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
        return key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )

    now = datetime.datetime.now(datetime.UTC)
    ca_key, key, sa_key = (ec.generate_private_key(ec.SECP256R1()) for _ in range(3))
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "cmbs-k8s-ca")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), False)
        .sign(ca_key, hashes.SHA256())
    )
    names = [
        x509.DNSName(n)
        for n in ("localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc")
    ]
    serving = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kube-apiserver")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [*names, x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .add_extension(
            x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False
        )
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), False
        )
        .sign(ca_key, hashes.SHA256())
    )
    (folder / "ca.crt").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    (folder / "apiserver.crt").write_bytes(serving.public_bytes(serialization.Encoding.PEM))
    (folder / "apiserver.key").write_bytes(pem_key(key))
    (folder / "sa.key").write_bytes(pem_key(sa_key))
    (folder / "sa.pub").write_bytes(
        sa_key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    (folder / "tokens.csv").write_text(f'{token},admin,admin,"system:masters"\n')
    for name in ("apiserver.key", "sa.key", "tokens.csv"):
        (folder / name).chmod(0o600)


class K8sPlane:
    """Start with ``start()``, stop with ``stop()`` (or use it as a context manager).

    ``kubeconfig`` is an admin's; ``readyz_seconds`` is how long ``/readyz`` took to
    answer ok after the start, ``started_seconds`` how long until a Deployment got its
    ReplicaSet (the controller manager working), ``stopped_seconds`` how long the stop
    took."""

    def __init__(self, bin_dir: Path, *, timeout: float = 120.0) -> None:
        self.bin = bin_dir
        self.timeout = timeout
        self.dir = Path(tempfile.mkdtemp(prefix="cmbs-k8s-"))
        self.port = free_port()
        self.token = secrets.token_hex(16)
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self.readyz_seconds = 0.0
        self.started_seconds = 0.0
        self.stopped_seconds = 0.0
        self.kyverno_crds_seconds = 0.0
        self.kyverno_started_seconds = 0.0

    @property
    def kubeconfig(self) -> Path:
        return self.dir / "kubeconfig.yaml"

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    @property
    def pids(self) -> dict[str, int]:
        """Each program's pid, which is also its process group."""
        return {name: p.pid for name, p in self.processes.items()}

    @property
    def timings(self) -> str:
        """The measured times, one line, for a test's output."""
        line = (
            f"k8s plane: /readyz {self.readyz_seconds:.1f}s, first ReplicaSet "
            f"{self.started_seconds:.1f}s"
        )
        if self.kyverno_started_seconds:
            line += (
                f", Kyverno CRDs {self.kyverno_crds_seconds:.1f}s, reports controller "
                f"leading {self.kyverno_started_seconds:.1f}s"
            )
        return f"{line}, stop {self.stopped_seconds:.1f}s" if self.stopped_seconds else line

    def kubectl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """``kubectl --kubeconfig KUBECONFIG ARGS``, its output captured as text."""
        done = subprocess.run(
            [str(self.bin / "kubectl"), "--kubeconfig", str(self.kubeconfig), *args],
            capture_output=True,
            text=True,
            timeout=self.timeout,
            stdin=subprocess.DEVNULL,
        )
        if check and done.returncode != 0:
            raise RuntimeError(f"kubectl {' '.join(args)}: {done.stderr.strip()}")
        return done

    def install_kyverno_crds(self, names: tuple[str, ...] = KYVERNO_CRDS) -> list[str]:
        """Applies Kyverno's CRDs (``names`` under its ``config/crds``) from the Go module
        cache and waits until they are served; the names of the CRDs."""
        crds = kyverno_crds_dir()
        files = [arg for name in names for arg in ("-f", str(crds / name))]
        # server-side: the policy CRDs are larger than client-side apply's annotation
        applied = self.kubectl("apply", "--server-side", "-o", "name", *files)
        installed = applied.stdout.split()
        self.kubectl(
            "wait", "--for=condition=Established", f"--timeout={self.timeout}s", *installed
        )
        return [n.split("/", 1)[1] for n in installed]

    def kyverno_installed(self) -> bool:
        """Whether the cluster itself says Kyverno is installed: ``kubectl get crd`` of
        ``KYVERNO_PRESENCE_CRDS`` answers both (it exits 1 when either is missing)."""
        asked = self.kubectl("get", "crd", *KYVERNO_PRESENCE_CRDS, "-o", "name", check=False)
        return asked.returncode == 0

    def start_kyverno(self) -> K8sPlane:
        """Kyverno's reports controller (``kyverno-reports-controller``, built by build.sh)
        against this plane, as the Helm chart runs it but out of cluster: every CRD of
        Kyverno's ``config/crds``, the ``kyverno`` namespace and ConfigMap, the chart's
        environment and flags, metrics on a free loopback port, the admin kubeconfig.
        Returns once it holds its leader lease (then its controllers start, ~3 s later);
        stopped with the plane, first (its own process group)."""
        crds = kyverno_crds_dir()
        begun = time.monotonic()
        self.install_kyverno_crds(tuple(str(p.relative_to(crds)) for p in crds.glob("*/*.yaml")))
        self.kyverno_crds_seconds = time.monotonic() - begun
        self.kubectl("create", "namespace", KYVERNO_NAMESPACE)
        literals = [f"--from-literal={key}={value}" for key, value in KYVERNO_CONFIG.items()]
        self.kubectl("create", "configmap", "kyverno", "-n", KYVERNO_NAMESPACE, *literals)
        begun = time.monotonic()
        self._spawn(
            "kyverno-reports-controller",
            f"--kubeconfig={self.kubeconfig}",
            *KYVERNO_FLAGS,
            "--disableLogColor=true",
            # its Prometheus server starts even with export disabled: loopback, free port
            "--disableMetrics=true",
            "--metricsHost=127.0.0.1",
            f"--metricsPort={free_port()}",
            env={**os.environ, **KYVERNO_ENV},
        )
        lease = (
            f"/apis/coordination.k8s.io/v1/namespaces/{KYVERNO_NAMESPACE}/leases/"
            "kyverno-reports-controller"
        )

        def leading(api: httpx.Client) -> bool:
            try:
                held = api.get(lease)
            except httpx.TransportError:
                return False
            holder = held.json().get("spec", {}).get("holderIdentity")
            return held.status_code == 200 and holder == KYVERNO_ENV["KYVERNO_POD_NAME"]

        with self._client() as api:
            self._wait("lease held by Kyverno's reports controller", lambda: leading(api), 0.2)
        self.kyverno_started_seconds = time.monotonic() - begun
        return self

    def kyverno_reports(self) -> list[dict[str, Any]]:
        """What IT-Bench's Kyverno evaluation reads: the items of ``kubectl get polr -A -o
        json`` followed by those of ``kubectl get cpolr -A -o json``."""
        return [
            report
            for kind in ("polr", "cpolr")
            for report in json.loads(self.kubectl("get", kind, "-A", "-o", "json").stdout)["items"]
        ]

    def kyverno_rescan(self) -> None:
        """Has Kyverno scan every resource it watches now, as any policy or exception
        change does: creates and deletes a PolicyException that excepts nothing (and that
        this controller ignores anyway: ``--enablePolicyException=false``). Without it a
        resource is first scanned 30 s after Kyverno starts watching its kind (a new
        policy's kinds), its report aggregated 10 s after a scan (Kyverno's constants)."""
        with self._client() as api:
            _rescan(api)

    def wait_for_kyverno_report(
        self,
        kind: str,
        namespace: str | None,
        name: str,
        *,
        policy: str,
        result: str | None = None,
        rescan: bool = True,
    ) -> dict[str, Any]:
        """The PolicyReport (ClusterPolicyReport when ``namespace`` is None) whose ``scope``
        is the resource ``kind`` ``namespace``/``name``, once it has a result of ``policy``
        (that is ``result`` if given: "fail", "pass", ... as after a policy's update);
        asked every 0.5 s, up to the plane's ``timeout``. With ``rescan``,
        ``kyverno_rescan()`` every 3 s meanwhile, so that it takes ~10-20 s, not ~40-50 s."""
        group = "/apis/wgpolicyk8s.io/v1alpha2"
        path = (
            f"{group}/namespaces/{namespace}/policyreports"
            if namespace
            else f"{group}/clusterpolicyreports"
        )
        found: list[dict[str, Any]] = []
        rescanned = 0.0

        def ready(api: httpx.Client) -> bool:
            nonlocal rescanned
            try:
                if rescan and time.monotonic() - rescanned >= 3.0:
                    _rescan(api)
                    rescanned = time.monotonic()
                listed = api.get(path)
            except httpx.TransportError:
                return False
            if listed.status_code != 200:
                return False
            found[:] = [
                report
                for report in listed.json()["items"]
                if _scope_is(report, kind, namespace, name)
                and any(
                    r.get("policy") == policy and result in (None, r.get("result"))
                    for r in report.get("results", [])
                )
            ]
            return bool(found)

        with self._client() as api:
            self._wait(
                f"Kyverno report on {kind} {namespace}/{name} from {policy}",
                lambda: ready(api),
                0.5,
            )
        return found[0]

    def start(self) -> K8sPlane:
        begun = time.monotonic()
        d = self.dir
        _certificates(d, self.token)
        client, peer = free_port(), free_port()
        self._spawn(
            "etcd",
            "--name=plane",
            f"--data-dir={d / 'etcd'}",
            f"--listen-client-urls=http://127.0.0.1:{client}",
            f"--advertise-client-urls=http://127.0.0.1:{client}",
            f"--listen-peer-urls=http://127.0.0.1:{peer}",
            f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
            f"--initial-cluster=plane=http://127.0.0.1:{peer}",
            "--unsafe-no-fsync",  # a throwaway store: no fsync wait on a loaded disk
        )
        self._spawn(
            "kube-apiserver",
            f"--etcd-servers=http://127.0.0.1:{client}",
            "--bind-address=127.0.0.1",
            "--advertise-address=127.0.0.1",
            # the "kubernetes" Service may not list a loopback address: left without one
            "--endpoint-reconciler-type=none",
            f"--secure-port={self.port}",
            f"--cert-dir={d}",
            f"--tls-cert-file={d / 'apiserver.crt'}",
            f"--tls-private-key-file={d / 'apiserver.key'}",
            f"--token-auth-file={d / 'tokens.csv'}",
            "--authorization-mode=RBAC",
            "--service-cluster-ip-range=10.96.0.0/16",
            "--service-account-issuer=https://kubernetes.default.svc",
            f"--service-account-key-file={d / 'sa.pub'}",
            f"--service-account-signing-key-file={d / 'sa.key'}",
            "--profiling=false",
        )
        ca = (d / "ca.crt").read_text()
        self.kubeconfig.write_text(self._kubeconfig(ca))
        context = ssl.create_default_context(cadata=ca)
        headers = {"Authorization": f"Bearer {self.token}"}
        with httpx.Client(base_url=self.server, verify=context, headers=headers) as api:
            self._wait("/readyz", lambda: _ok(api, "/readyz"))
            self.readyz_seconds = time.monotonic() - begun
            self._spawn(
                "kube-controller-manager",
                f"--kubeconfig={self.kubeconfig}",
                "--leader-elect=false",
                "--secure-port=0",  # nothing here asks its health endpoints
                f"--root-ca-file={d / 'ca.crt'}",
                f"--service-account-private-key-file={d / 'sa.key'}",
                "--use-service-account-credentials=false",
            )
            self._wait("a ReplicaSet for a Deployment", lambda: _probe(api))
            self.started_seconds = time.monotonic() - begun
            api.delete(
                "/apis/apps/v1/namespaces/default/deployments/cmbs-plane-probe",
                params={"propagationPolicy": "Background"},
            )
        return self

    def stop(self) -> None:
        """Every program's process group: TERM, 5 s, KILL; then the folder."""
        begun = time.monotonic()
        for process in reversed(self.processes.values()):
            _end_group(process)
        self.stopped_seconds = time.monotonic() - begun
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> K8sPlane:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _client(self) -> httpx.Client:
        """An admin's client of the API server."""
        context = ssl.create_default_context(cadata=(self.dir / "ca.crt").read_text())
        headers = {"Authorization": f"Bearer {self.token}"}
        return httpx.Client(base_url=self.server, verify=context, headers=headers, timeout=30)

    def _spawn(self, name: str, *args: str, env: dict[str, str] | None = None) -> None:
        with open(self.dir / f"{name}.log", "wb") as log:
            self.processes[name] = subprocess.Popen(
                [str(self.bin / name), *args],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=env,
            )

    def _wait(self, what: str, ready: Callable[[], bool], every: float = 0.1) -> None:
        """Until ``ready()``, asked every ``every`` s; fails with the logs' tails when a program
        exits or ``timeout`` passes first."""
        deadline = time.monotonic() + self.timeout
        while not ready():
            exited = [n for n, p in self.processes.items() if p.poll() is not None]
            if exited or time.monotonic() > deadline:
                why = f"{', '.join(exited)} exited" if exited else f"not within {self.timeout}s"
                raise RuntimeError(f"k8s plane: no {what}: {why}\n{self._log_tails()}")
            time.sleep(every)

    def _log_tails(self) -> str:
        tails = []
        for name in self.processes:
            lines = (self.dir / f"{name}.log").read_text(errors="replace").splitlines()
            tails.append(f"--- {name}.log\n" + "\n".join(lines[-15:]))
        return "\n".join(tails)

    def _kubeconfig(self, ca: str) -> str:
        return json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [
                    {
                        "name": "plane",
                        "cluster": {
                            "server": self.server,
                            "certificate-authority-data": base64.b64encode(ca.encode()).decode(),
                        },
                    }
                ],
                "users": [{"name": "admin", "user": {"token": self.token}}],
                "contexts": [{"name": "plane", "context": {"cluster": "plane", "user": "admin"}}],
                "current-context": "plane",
            },
            indent=2,
        )


#: a Deployment whose ReplicaSet shows the controller manager at work
_PROBE = {
    "apiVersion": "apps/v1",
    "kind": "Deployment",
    "metadata": {"name": "cmbs-plane-probe"},
    "spec": {
        "selector": {"matchLabels": {"app": "cmbs-plane-probe"}},
        "template": {
            "metadata": {"labels": {"app": "cmbs-plane-probe"}},
            "spec": {"containers": [{"name": "probe", "image": "probe"}]},
        },
    },
}


#: a PolicyException that excepts nothing: creating and deleting it has Kyverno rescan
_RESCAN: dict[str, Any] = {
    "apiVersion": "kyverno.io/v2",
    "kind": "PolicyException",
    "metadata": {"name": "cmbs-rescan", "namespace": KYVERNO_NAMESPACE},
    "spec": {
        "exceptions": [{"policyName": "cmbs-rescan-none", "ruleNames": ["none"]}],
        "match": {"any": [{"resources": {"kinds": ["ConfigMap"], "names": ["cmbs-none"]}}]},
    },
}


def _rescan(api: httpx.Client) -> None:
    """Creates and deletes ``_RESCAN`` (each an event Kyverno rescans on)."""
    path = f"/apis/kyverno.io/v2/namespaces/{KYVERNO_NAMESPACE}/policyexceptions"
    api.post(path, json=_RESCAN)
    api.delete(f"{path}/{_RESCAN['metadata']['name']}")


def _scope_is(report: dict[str, Any], kind: str, namespace: str | None, name: str) -> bool:
    """Whether a policy report is about that resource (its ``scope``)."""
    scope = report.get("scope") or {}
    return (scope.get("kind"), scope.get("namespace"), scope.get("name")) == (
        kind,
        namespace,
        name,
    )


def _ok(api: httpx.Client, path: str) -> bool:
    try:
        return api.get(path).status_code == 200
    except httpx.TransportError:
        return False


def _probe(api: httpx.Client) -> bool:
    """Whether the probe Deployment has a ReplicaSet (creating it first if need be)."""
    deployments = "/apis/apps/v1/namespaces/default/deployments"
    try:
        if api.get(f"{deployments}/cmbs-plane-probe").status_code == 404:
            api.post(deployments, json=_PROBE)
        sets = api.get(
            "/apis/apps/v1/namespaces/default/replicasets",
            params={"labelSelector": "app=cmbs-plane-probe"},
        )
    except httpx.TransportError:
        return False
    return sets.status_code == 200 and bool(sets.json()["items"])


def _end_group(process: subprocess.Popen[bytes], grace: float = 5.0) -> None:
    """TERM to the process's group, up to ``grace`` seconds for it to exit, then KILL to
    whatever of the group is left; reaped."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=grace)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()
