"""IT-Bench's two Kyverno CISO kinds, scored as IT-Bench scores them, from the policy
reports of a live cluster running Kyverno.

IT-Bench (``scenarios/ciso/`` of its repository) injects a fault into a kind cluster with
Kyverno installed by Helm, lets the agent deploy or edit Kyverno policies there, and then
reads what Kyverno reported:

- **kyverno-generate** (``1.gen-cis-b-k8s-kyverno``): ``playbooks/evaluate.yml`` saves
  ``kubectl get polr -A -o json`` and ``kubectl get cpolr -A -o json`` and runs
  ``evaluation/main.py``, which passes iff some report (PolicyReports, then
  ClusterPolicyReports) whose ``scope`` is the fault of ``manifests/application.yaml``
  (``apps/v1`` Deployment ``nginx-deployment`` in ``paa``; the namespace compared only where
  the scope has one) has ``summary.fail > 0``. Its ``tasks`` (a top-level ``*.yaml``/
  ``*.yml`` of the agent's output that is one document of kind Policy or ClusterPolicy)
  are recorded, never scored.
- **kyverno-update** (``4.upd-cis-b-k8s-kyverno``): ``playbooks/evaluate.yml`` saves the
  policies (``kubectl get policy -A``, ``clusterpolicy``) and the reports (``policyreport
  -A``, ``clusterpolicyreport``) and runs ``evaluation.py`` with ``eval_config.yaml``: the
  first result of policy ``container-security-controls`` in a report scoped to the
  ``v1`` Pod ``paa/test-untrusted-registry`` must be ``fail`` (Kyverno sorts a report's
  results by policy, then rule: that is the rule first in name order), and the rules of
  ``service-account-requirements`` must still hold everything they held in
  ``manifests/existing-policy.yaml`` (``compare_dicts``: every key of the old present and
  equal in the new, lists compared pairwise as far as the shorter goes).

IT-Bench applies nothing: the agent deployed its policies into the cluster IT-Bench then
reads. Here the evaluator's own cluster (its kubeconfig, holding IT-Bench's fault) gets
the Kyverno policies the agent left in its workdir, applied with kubectl as the agent
would, and is put back afterwards; :func:`evaluate_kyverno` with ``apply=False`` reads the
cluster as it is instead, as IT-Bench does (``cmbs itbench evaluate``'s default; it applies
with ``--apply-policies``). Nothing of IT-Bench's texts is kept here.
"""

from __future__ import annotations

import json
import os
import secrets
import shlex
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import yaml

from executors import Executor
from executors.observation import CommandEnv, Observation

from ._errors import one_line
from ._reading import ReadError, _check_yaml_events, _SafeLoader, read_json, read_text
from .itbench import (
    DATA_MAX_BYTES,
    CannotScore,
    Evaluation,
    ItbenchError,
    Kind,
    agent_file,
    cluster_problem,
    command_search,
    missing_program,
    program_hint,
)
from .targets import destinations_from_kubeconfig

__all__ = [
    "GENERATE_TARGET",
    "POLICY_KINDS",
    "REPORT_WAIT_S",
    "UNCHANGED_POLICY",
    "UPDATE_POLICY",
    "UPDATE_TARGET",
    "AgentPolicies",
    "Check",
    "Resource",
    "agent_policies",
    "compliant_twin",
    "covers",
    "evaluate_kyverno",
    "failing_policies",
    "generate_check",
    "generate_tasks",
    "probe_seen",
    "rules_unchanged_check",
    "scanned_reports",
    "update_checks",
    "violation_check",
    "without_policies",
]


@dataclass(frozen=True, slots=True)
class Resource:
    """A Kubernetes object as a policy report's ``scope`` names it."""

    api_version: str
    kind: str
    namespace: str  # "" for a cluster-scoped object
    name: str

    def __str__(self) -> str:
        return f"{self.kind} {self.namespace}/{self.name}" if self.namespace else self.name

    @property
    def kubectl_type(self) -> str:
        """Its type as kubectl names it exactly (``deployment.v1.apps``, ``pod``)."""
        group, _, version = self.api_version.rpartition("/")
        return f"{self.kind.lower()}.{version}.{group}" if group else self.kind.lower()


#: The fault of the generate kind (its ``manifests/application.yaml``, into ``paa``).
GENERATE_TARGET = Resource("apps/v1", "Deployment", "paa", "nginx-deployment")
#: The resource, policy and unchanged policy of the update kind's ``eval_config.yaml``.
UPDATE_TARGET = Resource("v1", "Pod", "paa", "test-untrusted-registry")
UPDATE_POLICY = "container-security-controls"
UNCHANGED_POLICY = "service-account-requirements"
#: What the evaluator applies from a workdir: Kyverno's policies (``kyverno.io``), the
#: kinds IT-Bench's ``main.py`` counts as the agent's policy; nothing else reaches the
#: cluster (a kubeconfig, a Deployment, a cleanup policy the agent wrote stay out).
POLICY_KINDS = ("ClusterPolicy", "Policy")
#: How long the evaluator waits for Kyverno to report on the target with the policies
#: applied: its first scan of a kind comes up to 30 s after a policy asks for it, and a
#: report is aggregated ~10 s after a scan.
REPORT_WAIT_S = 120.0


@dataclass(frozen=True, slots=True)
class Check:
    """One of IT-Bench's checks (or one of ``--strict``'s): passed, and why, in words."""

    name: str
    passed: bool
    message: str

    def as_dict(self) -> dict[str, Any]:
        return {"check": self.name, "pass": self.passed, "message": self.message}


# --- IT-Bench's criteria, over the parsed report and policy JSON -------------------------


def _scope(report: Mapping[str, Any]) -> Mapping[str, Any]:
    scope = report.get("scope")
    return scope if isinstance(scope, Mapping) else {}


def _results(report: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    results = report.get("results")
    return [r for r in results if isinstance(r, Mapping)] if isinstance(results, list) else []


def _about_generate(report: Mapping[str, Any], target: Resource) -> bool:
    """Whether ``report`` is about ``target`` as ``evaluation/main.py`` matches it: the
    namespace is compared only where the scope has one."""
    scope = _scope(report)
    return (
        scope.get("apiVersion") == target.api_version
        and scope.get("kind") == target.kind
        and (scope["namespace"] == target.namespace if "namespace" in scope else True)
        and scope.get("name") == target.name
    )


def _about_update(report: Mapping[str, Any], target: Resource) -> bool:
    """Whether ``report`` is about ``target`` as ``evaluation.py``'s ``is_scoped`` matches
    it: a scope without a namespace has the namespace ``""``."""
    scope = _scope(report)
    return (
        scope.get("namespace", "") == target.namespace
        and scope.get("name") == target.name
        and scope.get("kind") == target.kind
        and scope.get("apiVersion") == target.api_version
    )


def _fail_count(report: Mapping[str, Any]) -> int:
    summary = report.get("summary")
    fail = summary.get("fail", 0) if isinstance(summary, Mapping) else 0
    return fail if isinstance(fail, int) else 0


def generate_check(
    reports: Sequence[Mapping[str, Any]], target: Resource = GENERATE_TARGET
) -> Check:
    """The generate kind's criterion (``evaluation/main.py``): some report about
    ``target`` has ``summary.fail > 0``. ``reports``: the items of ``kubectl get polr -A -o
    json`` followed by those of ``kubectl get cpolr -A -o json``."""
    about = [r for r in reports if _about_generate(r, target)]
    failing = [r for r in about if _fail_count(r) > 0]
    if failing:
        message = f"a report on {target} has summary.fail {_fail_count(failing[0])}"
    elif about:
        message = f"{len(about)} report(s) on {target}, none with summary.fail > 0"
    else:
        message = f"no report on {target}"
    return Check("generate_assessment_posture", bool(failing), message)


def violation_check(
    reports: Sequence[Mapping[str, Any]],
    *,
    policy: str = UPDATE_POLICY,
    target: Resource = UPDATE_TARGET,
    expected: str = "fail",
) -> Check:
    """``evaluation.py``'s ``check_violation_in_policy_reports`` (without its
    ``strict_check``, which ``eval_config.yaml`` leaves off): the first result of
    ``policy`` in the reports about ``target``, in their order, decides."""
    scoped = [r for r in reports if _about_update(r, target)]
    name = f"violation of {policy}"
    for report in scoped:
        for result in _results(report):
            if result.get("policy") != policy:
                continue
            if result.get("result") == expected:
                said = f"detected expected result {expected!r} in policy {policy!r}"
                return Check(name, True, f"{said} for {target}")
            return Check(
                name,
                False,
                f"detected result {result.get('result')!r} (rule {result.get('rule')!r}) in "
                f"policy {policy!r} for {target}, expected {expected!r}",
            )
    # as evaluation.py has it: it asks the reports, not their results, for the policy
    if expected == "pass" and not any(r.get("policy") == policy for r in scoped):
        return Check(name, True, f"no result of {policy!r} for {target}, as expected")
    return Check(name, False, f"no result of policy {policy!r} in a report on {target}")


def covers(expected: Any, actual: Any) -> bool:
    """``evaluation.py``'s ``compare_dicts``: every key of ``expected`` is in ``actual``
    with a value it covers; lists are compared pairwise as far as the shorter goes (an
    empty list covers any and is covered by any); anything else must be equal."""
    if isinstance(expected, dict) and isinstance(actual, dict):
        return all(key in actual and covers(value, actual[key]) for key, value in expected.items())
    if isinstance(expected, list) and isinstance(actual, list):
        return all(covers(e, a) for e, a in zip(expected, actual, strict=False))
    return bool(expected == actual)


def _named(policies: Sequence[Mapping[str, Any]], name: str) -> Mapping[str, Any] | None:
    for policy in policies:
        metadata = policy.get("metadata")
        if isinstance(metadata, Mapping) and metadata.get("name") == name:
            return policy
    return None


def _rules(policy: Mapping[str, Any]) -> Any:
    spec = policy.get("spec")
    return spec.get("rules", []) if isinstance(spec, Mapping) else []


def rules_unchanged_check(
    existing: Sequence[Mapping[str, Any]],
    current: Sequence[Mapping[str, Any]],
    *,
    policy: str = UNCHANGED_POLICY,
) -> Check:
    """``evaluation.py``'s ``check_policy_rules_unchanged``: the first policy named
    ``policy`` in ``current`` (the items of ``kubectl get policy -A`` followed by those of
    ``kubectl get clusterpolicy``) has rules that :func:`covers` those of the first so
    named in ``existing`` (the policies before the agent)."""
    name = f"rules of {policy} unchanged"
    before, now = _named(existing, policy), _named(current, policy)
    if before is None:
        return Check(name, False, f"policy {policy!r} is not among the existing policies")
    if now is None:
        return Check(name, False, f"policy {policy!r} is not among the current policies")
    if not covers(_rules(before), _rules(now)):
        return Check(name, False, f"rules mismatch in policy {policy!r}")
    return Check(name, True, f"no modification detected in the rules of policy {policy!r}")


def update_checks(
    reports: Sequence[Mapping[str, Any]],
    existing: Sequence[Mapping[str, Any]],
    current: Sequence[Mapping[str, Any]],
) -> tuple[Check, ...]:
    """The update kind's checks as ``eval_config.yaml`` configures them; it passes iff all
    do."""
    return (violation_check(reports), rules_unchanged_check(existing, current))


def generate_tasks(files: Mapping[str, str | None]) -> dict[str, bool]:
    """``evaluation/main.py``'s ``tasks`` (recorded, never scored) of the agent's output:
    ``files`` maps each top-level ``*.yaml``/``*.yml`` name to its text (``None`` where it
    cannot be read); ``generate_policy`` is whether one is a single YAML document of kind
    Policy or ClusterPolicy (a file of several documents does not count, as there)."""
    found = False
    for text in files.values():
        try:
            document = _load_all(text or "", "the agent's file")
        except ReadError:
            continue
        if len(document) == 1 and isinstance(document[0], dict):
            found = found or document[0].get("kind") in POLICY_KINDS
    return {"generate_policy": found, "evidence_available": True}


# --- what --strict adds ------------------------------------------------------------------


def failing_policies(
    reports: Sequence[Mapping[str, Any]], target: Resource, result: str | None = "fail"
) -> set[str]:
    """The policies with a ``result`` (``None``: any) in a report about ``target``."""
    return {
        str(found.get("policy"))
        for report in reports
        if _about_update(report, target)
        for found in _results(report)
        if result is None or found.get("result") == result
    }


def without_policies(reports: Sequence[Mapping[str, Any]], prefix: str) -> list[dict[str, Any]]:
    """``reports`` as they would be without the policies whose names start with
    ``prefix`` (the evaluator's probe): their results gone, the summary counted down, a
    report left with no result gone (Kyverno keeps none)."""
    kept: list[dict[str, Any]] = []
    for report in reports:
        results = _results(report)
        dropped = [r for r in results if str(r.get("policy", "")).startswith(prefix)]
        if not dropped:
            kept.append(dict(report))
            continue
        if len(dropped) == len(results):
            continue
        summary = dict(report.get("summary") or {})
        for result in dropped:
            outcome = result.get("result")
            if isinstance(outcome, str) and isinstance(summary.get(outcome), int):
                summary[outcome] -= 1
        remaining = [r for r in results if r not in dropped]
        kept.append({**report, "results": remaining, "summary": summary})
    return kept


def _probed(report: Mapping[str, Any], probe: str, rules: Sequence[str]) -> bool:
    return any(r.get("policy") == probe and r.get("rule") in rules for r in _results(report))


def probe_seen(
    reports: Sequence[Mapping[str, Any]], target: Resource, probe: str, rules: Sequence[str]
) -> bool:
    """Whether a report about ``target`` has a result of policy ``probe`` from one of
    ``rules``: Kyverno scanned it with that version of the probe, so with every policy
    applied before it."""
    return any(_probed(report, probe, rules) for report in reports if _about_update(report, target))


def scanned_reports(
    reports: Sequence[Mapping[str, Any]], probe: str, rules: Sequence[str]
) -> list[dict[str, Any]]:
    """The ``reports`` Kyverno wrote during the evaluation: those with a result of the
    evaluator's ``probe`` from one of ``rules``, names chosen as it ran. A report made
    by anyone else, before (an agent's ``kubectl apply`` of one, say), has none."""
    return [dict(report) for report in reports if _probed(report, probe, rules)]


#: A Pod's fields the API server sets, which a new Pod may not (or need not) carry.
_SERVER_SET = ("nodeName", "priority")


def compliant_twin(kind: Kind, live: Mapping[str, Any], namespace: str) -> list[dict[str, Any]]:
    """The objects of IT-Bench's fault turned compliant, for ``namespace`` (new, made by
    the evaluator): the opposite state ``--strict`` asks the agent's policy to pass.
    ``live`` is the fault as the cluster holds it. For kyverno-generate the Deployment
    with ``hostNetwork: false`` (the host network is what its goal is about); for
    kyverno-update the Pod with every container's image from ``trusted-registry.com`` and
    ``runAsNonRoot: true`` (what its goal asks beyond the existing policies), and the
    ServiceAccount it names. This is knowledge of the two scenarios, not of the agent."""
    metadata = live.get("metadata") or {}
    new_meta: dict[str, Any] = {"name": metadata.get("name"), "namespace": namespace}
    if metadata.get("labels"):
        new_meta["labels"] = metadata["labels"]
    spec = json.loads(json.dumps(live.get("spec") or {}))
    twin = {"apiVersion": live.get("apiVersion"), "kind": live.get("kind"), "metadata": new_meta}
    if kind is Kind.KYVERNO_GENERATE:
        spec.setdefault("template", {}).setdefault("spec", {})["hostNetwork"] = False
        return [{**twin, "spec": spec}]
    for name in _SERVER_SET:
        spec.pop(name, None)
    # the token volume the ServiceAccount admission added: it adds its own to the twin
    volumes = spec.pop("volumes", [])
    tokens = {v.get("name") for v in volumes if str(v.get("name", "")).startswith("kube-api-")}
    if any(v.get("name") not in tokens for v in volumes):
        spec["volumes"] = [v for v in volumes if v.get("name") not in tokens]
    for container in spec.get("containers", []):
        mounts = [m for m in container.pop("volumeMounts", []) if m.get("name") not in tokens]
        if mounts:
            container["volumeMounts"] = mounts
        image = str(container.get("image", "image"))
        first, _, rest = image.partition("/")
        registry = "." in first or ":" in first or first == "localhost"
        container["image"] = "trusted-registry.com/" + (rest if registry and rest else image)
        container.setdefault("securityContext", {})["runAsNonRoot"] = True
        container["securityContext"]["allowPrivilegeEscalation"] = False
    objects: list[dict[str, Any]] = []
    account = spec.get("serviceAccountName")
    if account and account != "default":
        objects.append(
            {
                "apiVersion": "v1",
                "kind": "ServiceAccount",
                "metadata": {"name": account, "namespace": namespace},
            }
        )
    return [*objects, {**twin, "spec": spec}]


# --- the agent's policies ----------------------------------------------------------------


def _load_all(text: str, origin: str) -> list[Any]:
    """Every YAML document of ``text`` (safe tags; nesting and aliases capped as
    :func:`~cmbs_async._reading.loads_yaml` caps one); :class:`ReadError` if not YAML."""
    try:
        _check_yaml_events(text, origin, 64, 1_000_000)
        return [d for d in yaml.load_all(text, Loader=_SafeLoader) if d is not None]  # noqa: S506
    except yaml.YAMLError as exc:
        raise ReadError(f"{origin}: not valid YAML: {one_line(str(exc))}") from None
    except RecursionError:
        raise ReadError(f"{origin}: nested too deeply") from None


#: What the API server sets in an object: meaningless in another cluster (a
#: ``resourceVersion`` from the agent's cluster would make the apply conflict).
_SERVER_METADATA = ("resourceVersion", "uid", "creationTimestamp", "generation", "managedFields")


def _identity(document: Mapping[str, Any]) -> tuple[str, str, str, str]:
    metadata = document.get("metadata") or {}
    group = str(document.get("apiVersion", "")).rpartition("/")[0]
    return (
        group,
        str(document.get("kind")),
        str(metadata.get("namespace", "")),
        str(metadata.get("name")),
    )


def _is_policy(document: Any) -> bool:
    return (
        isinstance(document, dict)
        and document.get("kind") in POLICY_KINDS
        and str(document.get("apiVersion", "")).startswith("kyverno.io/")
        and isinstance(document.get("metadata"), dict)
    )


def _cleaned(document: Mapping[str, Any]) -> dict[str, Any]:
    metadata = {k: v for k, v in document["metadata"].items() if k not in _SERVER_METADATA}
    return {**{k: v for k, v in document.items() if k != "status"}, "metadata": metadata}


@dataclass(frozen=True, slots=True)
class AgentPolicies:
    """The Kyverno policies a workdir holds, as the evaluator applies them: one per
    policy (a later file's definition replaces an earlier one's), with the file each
    came from; what was passed over, and the files as IT-Bench's ``tasks`` read them."""

    documents: tuple[dict[str, Any], ...] = ()
    sources: tuple[str, ...] = ()
    superseded: tuple[str, ...] = ()
    unreadable: tuple[str, ...] = ()
    files: Mapping[str, str | None] = field(default_factory=dict)

    @property
    def names(self) -> set[str]:
        return {str(d["metadata"].get("name")) for d in self.documents}

    def listed(self) -> list[dict[str, str]]:
        return [
            {"kind": d["kind"], "name": str(d["metadata"].get("name")), "file": source}
            for d, source in zip(self.documents, self.sources, strict=True)
        ]


def agent_policies(workdir: str | Path) -> AgentPolicies:
    """The Policy and ClusterPolicy documents (``kyverno.io``) of the top-level ``*.yaml``
    and ``*.yml`` files of ``workdir`` (IT-Bench's agent output is looked at there), each
    file read as :func:`~cmbs_async.itbench.agent_file` reads it (regular, capped, never
    through a link), ``kind: List`` items included. Files are taken oldest first (by
    modification time, then name), so the policy last written is the one applied; the
    server's fields (``resourceVersion``, ``status``, ...) are dropped."""
    root = Path(workdir)
    try:
        names = sorted(
            p.name for p in root.iterdir() if p.suffix in (".yaml", ".yml") and p.name[:1] != "."
        )
    except OSError as exc:
        raise ItbenchError(f"cannot read {root}: {exc.strerror or exc}") from None
    files: dict[str, str | None] = {name: agent_file(root / name) for name in names}

    def written(name: str) -> tuple[float, str]:
        try:
            return os.lstat(root / name).st_mtime, name
        except OSError:
            return 0.0, name

    chosen: dict[tuple[str, str, str, str], tuple[dict[str, Any], str]] = {}
    superseded: list[str] = []
    unreadable: list[str] = []
    for name in sorted(names, key=written):
        text = files[name]
        try:
            documents = _load_all(text, name) if text is not None else None
        except ReadError:
            documents = None
        if documents is None:
            unreadable.append(name)
            continue
        items = [
            item
            for document in documents
            for item in (
                document.get("items", [])
                if isinstance(document, dict) and document.get("kind") == "List"
                else [document]
            )
        ]
        for document in filter(_is_policy, items):
            key = _identity(document)
            if key in chosen:
                superseded.append(f"{key[1]} {key[3]} of {chosen[key][1]}")
            chosen[key] = (_cleaned(document), name)
    return AgentPolicies(
        documents=tuple(d for d, _ in chosen.values()),
        sources=tuple(s for _, s in chosen.values()),
        superseded=tuple(superseded),
        unreadable=tuple(unreadable),
        files=files,
    )


# --- evaluate_kyverno --------------------------------------------------------------------


#: The largest report or policy listing read back from kubectl.
_LISTING_MAX_BYTES = 64 * 1024 * 1024
#: How often the evaluator asks for reports, and changes its probe (each change has
#: Kyverno rescan: without one, a kind's first scan waits 30 s).
_POLL_S, _TOUCH_S = 2.0, 5.0
#: The probe policy's name starts so; its results are taken out of what is scored.
_PROBE = "cmbs-evaluation-probe-"
#: kubectl's words when it never reached the cluster (not the agent's failure).
_UNREACHED = (
    "Unable to connect to the server",
    "connection refused",
    "i/o timeout",
    "TLS handshake timeout",
    "the server is currently unable",
    "net/http: request canceled",
)


def _probe(name: str, rule: str, targets: Sequence[Resource]) -> dict[str, Any]:
    """A ClusterPolicy that every target passes (its rule ``rule``) and that nothing else
    matches: once Kyverno reports it on a target, it scanned that target after the
    policies applied before it."""
    return {
        "apiVersion": "kyverno.io/v1",
        "kind": "ClusterPolicy",
        "metadata": {
            "name": name,
            "annotations": {"pod-policies.kyverno.io/autogen-controllers": "none"},
        },
        "spec": {
            "background": True,
            "validationFailureAction": "Audit",
            "rules": [
                {
                    "name": rule,
                    "match": {
                        "any": [
                            {
                                "resources": {
                                    "kinds": [f"{t.api_version}/{t.kind}"],
                                    "namespaces": [t.namespace],
                                    "names": [t.name],
                                }
                            }
                            for t in targets
                        ]
                    },
                    "validate": {
                        "message": "the cmbs evaluator's probe: passes what it matches",
                        "pattern": {"metadata": {"name": "?*"}},
                    },
                }
            ],
        },
    }


def _last_line(observation: Observation) -> str:
    for stream in (observation.stderr.text, observation.stdout.text):
        lines = [
            line for line in stream.splitlines() if line.strip() and "is deprecated" not in line
        ]
        if lines:
            return one_line(lines[-1])[:300]
    return observation.summary()[:300]


def _unreached(observation: Observation) -> bool:
    return any(words in observation.stderr.text for words in _UNREACHED)


def _said(observation: Observation) -> dict[str, Any]:
    return {
        "command": observation.command,
        "exit_status": observation.exit_status,
        "stderr": observation.stderr.text[-2000:],
    }


def _listing(document: Any) -> list[dict[str, Any]]:
    """The objects of kubectl's ``-o json``: a List's items, one object, or none."""
    if isinstance(document, dict) and isinstance(document.get("items"), list):
        return [i for i in document["items"] if isinstance(i, dict)]
    return [document] if isinstance(document, dict) else []


class _Cluster:
    """kubectl against the evaluator's cluster, in a fresh directory of the executor
    (sandboxed, reaching only the kubeconfig's servers), its output read back from files
    there (the executor's directories are on this machine, as for ``evaluate``)."""

    def __init__(self, executor: Executor, fresh: str, env: CommandEnv, timeout: float) -> None:
        self.executor, self.fresh = executor, fresh
        self.run = partial(executor.run_command, fresh, timeout=timeout, env=env)

    async def write(self, name: str, content: Any) -> None:
        written = await self.executor.write_artifact(self.fresh, name, json.dumps(content))
        if not written.success:
            raise CannotScore(f"cannot write {name} for kubectl: {written.error}")

    async def must(self, command: str, what: str) -> Observation:
        """``command``, which must succeed: else no verdict (the evaluator's own step)."""
        done = await self.run(command)
        if not done.success:
            raise CannotScore(f"{what}: {_last_line(done)}")
        return done

    def read(self, name: str) -> Any:
        """The JSON kubectl wrote to ``name`` (nothing: ``None``)."""
        path = Path(self.fresh, name)
        try:
            if os.path.getsize(path) == 0:
                return None
            return read_json(path, what="kubectl's output", max_bytes=_LISTING_MAX_BYTES)
        except (OSError, ReadError) as exc:
            raise CannotScore(f"cannot read kubectl's {name}: {exc}") from None

    async def listing(self, args: str, name: str, what: str) -> list[dict[str, Any]]:
        await self.must(f"kubectl get {args} -o json > {name}", what)
        return _listing(await anyio.to_thread.run_sync(self.read, name))


async def evaluate_kyverno(
    workdir: str | Path,
    *,
    executor: Executor,
    kind: Kind,
    kubeconfig: str | Path,
    strict: bool = False,
    apply: bool = True,
    existing: str | Path | None = None,
    wait_s: float = REPORT_WAIT_S,
    command_timeout_s: float = 60.0,
) -> Evaluation:
    """IT-Bench's verdict on a Kyverno workdir, from the live cluster of ``kubeconfig``
    (the evaluator's, a path: it holds IT-Bench's fault and runs Kyverno): the workdir's
    policies (:func:`agent_policies`) applied with ``kubectl apply``, Kyverno's reports
    awaited (at most ``wait_s``), read as IT-Bench reads them and scored with
    :func:`generate_check` or :func:`update_checks`; then the cluster is put back (what the
    workdir created deleted, what it changed replaced by what was there). ``apply=False``
    scores the cluster as the agent left it, IT-Bench's own way; the update kind then needs
    ``existing`` (IT-Bench's ``manifests/existing-policy.yaml``), which otherwise is what
    the cluster held before the apply.

    Kyverno says nothing of when it has scanned, so the evaluator adds a probe policy of
    its own that passes only the targets and renames its rule every few seconds (each
    change has Kyverno rescan), and waits for a report with a name given after the apply;
    the probe's results are not scored. ``strict`` also fails a policy that matches
    nothing or everything: the fault's failures must include one from a workdir policy,
    and a compliant twin of the fault (:func:`compliant_twin`, in a namespace of its own)
    must get no ``fail`` from one.

    :class:`CannotScore` (one line, no verdict, never a fail): kubectl missing, a cluster
    that does not answer or has no Kyverno (before anything is applied), no fault there,
    no report within ``wait_s``. Run one evaluation at a time per cluster: workdirs'
    policies share names."""
    if kind not in (Kind.KYVERNO_GENERATE, Kind.KYVERNO_UPDATE):
        raise ItbenchError(f"{kind.value} is not a Kyverno kind: it is scored by evaluate")
    if kind is Kind.KYVERNO_UPDATE and not apply and existing is None:
        raise ItbenchError(
            "scoring a kyverno-update cluster as it is needs the policies before the agent "
            "(IT-Bench's manifests/existing-policy.yaml)"
        )
    details: dict[str, Any] = {"kind": kind.value, "apply": apply}
    found = await anyio.to_thread.run_sync(agent_policies, Path(workdir))
    details["policies"] = found.listed()
    if found.superseded:
        details["superseded"] = list(found.superseded)
    if found.unreadable:
        details["unreadable"] = list(found.unreadable)
    if kind is Kind.KYVERNO_GENERATE:
        details["tasks"] = generate_tasks(found.files)
    if apply and not found.documents:
        reason = f"no Kyverno Policy or ClusterPolicy in a *.yaml or *.yml of {workdir}"
        return Evaluation(False, details | {"reason": reason + ": nothing to score"})
    before = None if existing is None else await anyio.to_thread.run_sync(_existing, existing)
    search = command_search(executor)
    missing = None if search is None else missing_program(kind, search)
    if missing is not None:  # before anything runs: no verdict, not the agent's failure
        raise CannotScore(
            f"{missing} not found on the PATH the evaluator's commands run with"
            + program_hint(missing, search or "")
        )
    config = await anyio.to_thread.run_sync(_kubeconfig, Path(kubeconfig))
    problem = await cluster_problem(executor, kind, config, command_timeout_s=command_timeout_s)
    if problem is not None:  # no Kyverno, no answer: one line before anything is applied
        raise CannotScore(f"the cluster of --kubeconfig {kubeconfig} {problem}")
    network = destinations_from_kubeconfig(config)
    env = CommandEnv(network=network)
    fresh = await executor.prepare(None, {"kubeconfig.yaml": config}, env=env)
    try:
        env = env.model_copy(update={"values": {"KUBECONFIG": f"{fresh}/kubeconfig.yaml"}})
        cluster = _Cluster(executor, fresh, env, command_timeout_s)
        scored = _Scoring(cluster, kind, found, strict=strict, apply=apply, existing=before)
        try:
            evaluation = await scored.evaluate(details, wait_s)
        except CannotScore as exc:  # the cluster put back all the same, or said why not
            with anyio.CancelScope(shield=True):
                failed = [s for s in await scored.restore() if s.startswith("could not")]
            if failed:
                raise CannotScore(f"{exc}; and {failed[0]}") from None
            raise
        except BaseException:
            with anyio.CancelScope(shield=True):
                await scored.restore()
            raise
        with anyio.CancelScope(shield=True):
            restored = await scored.restore()
        return Evaluation(evaluation.passed, evaluation.details | {"restored": restored})
    finally:
        with anyio.CancelScope(shield=True):
            await executor.cleanup(fresh)


def _kubeconfig(path: Path) -> str:
    try:
        text = read_text(path, what="a kubeconfig", max_bytes=DATA_MAX_BYTES)
        destinations_from_kubeconfig(text)
    except ReadError as exc:
        raise ItbenchError(str(exc)) from None
    except ValueError as exc:
        raise ItbenchError(f"the evaluator's kubeconfig: {one_line(str(exc))}") from None
    return text


def _existing(path: str | Path) -> list[dict[str, Any]]:
    """The policies before the agent, as IT-Bench's ``manifests/existing-policy.yaml``
    holds them (YAML documents)."""
    try:
        text = read_text(path, what="the existing policies", max_bytes=DATA_MAX_BYTES)
        documents = _load_all(text, str(path))
    except ReadError as exc:
        raise ItbenchError(str(exc)) from None
    return [i for d in documents for i in _listing(d)]


class _Scoring:
    """One evaluation's steps in the cluster, and what it changed there, to put back."""

    def __init__(
        self,
        cluster: _Cluster,
        kind: Kind,
        found: AgentPolicies,
        *,
        strict: bool,
        apply: bool,
        existing: list[dict[str, Any]] | None,
    ) -> None:
        self.cluster, self.kind, self.found = cluster, kind, found
        self.strict, self.apply, self.existing = strict, apply, existing
        self.target = GENERATE_TARGET if kind is Kind.KYVERNO_GENERATE else UPDATE_TARGET
        token = secrets.token_hex(4)
        self.probe = f"{_PROBE}{token}"
        self.twin_namespace = f"cmbs-compliant-{token}"
        self.twin: Resource | None = None
        self.probed = False
        #: the probe's rule names so far (each one chosen as the evaluation runs)
        self.rules: list[str] = []
        #: per workdir policy: what the cluster held before (None: nothing), once asked
        self.before: list[dict[str, Any] | None] | None = None

    async def evaluate(self, details: dict[str, Any], wait_s: float) -> Evaluation:
        cluster, target = self.cluster, self.target
        live = await cluster.listing(
            f"{target.kubectl_type} {shlex.quote(target.name)} -n {shlex.quote(target.namespace)}"
            " --ignore-not-found",
            "target.json",
            f"cannot ask for {target}",
        )
        if not live:
            raise CannotScore(f"the cluster has no {target}: IT-Bench's fault is not there")
        details["target"] = str(target)
        if self.existing is None and self.kind is Kind.KYVERNO_UPDATE:
            self.existing = await self._policies("existing.json")
        if self.strict:
            await self._make_twin(live[0])
            details["twin"] = str(self.twin)
        if self.apply:
            refused = await self._apply()
            if refused is not None:
                return Evaluation(False, details | refused)
        begun = time.monotonic()
        await self._await_reports(wait_s)
        details["waited_s"] = round(time.monotonic() - begun, 1)
        listed = [
            *await cluster.listing("policyreports.wgpolicyk8s.io -A", "polr.json", "polr"),
            *await cluster.listing("clusterpolicyreports.wgpolicyk8s.io", "cpolr.json", "cpolr"),
        ]
        reports = without_policies(listed, _PROBE)
        if self.kind is Kind.KYVERNO_GENERATE:
            checks: tuple[Check, ...] = (generate_check(reports),)
        else:
            current = await self._policies("policies.json")
            checks = update_checks(reports, self.existing or [], current)
        passed = all(c.passed for c in checks)
        details["itbench"] = {"pass": passed, "checks": [c.as_dict() for c in checks]}
        if self.strict:  # only what Kyverno wrote as the evaluation ran
            scanned = without_policies(scanned_reports(listed, self.probe, self.rules), _PROBE)
            more = self._strict_checks(reports, scanned)
            details["strict"] = [c.as_dict() for c in more]
            checks = (*checks, *more)
        failed = [c for c in checks if not c.passed]
        reason = "; ".join(c.message for c in failed or checks)
        return Evaluation(not failed, details | {"reason": reason})

    async def _policies(self, name: str) -> list[dict[str, Any]]:
        """The items of ``kubectl get policy -A`` then ``clusterpolicy``, as IT-Bench
        lists them."""
        policies = await self.cluster.listing("policies.kyverno.io -A", name, "policies")
        return policies + await self.cluster.listing(
            "clusterpolicies.kyverno.io", f"c{name}", "cluster policies"
        )

    async def _make_twin(self, live: dict[str, Any]) -> None:
        objects = compliant_twin(self.kind, live, self.twin_namespace)
        made = objects[-1]
        self.twin = Resource(
            str(made["apiVersion"]), str(made["kind"]), self.twin_namespace, str(self.target.name)
        )
        await self.cluster.write(
            "twin.json", {"apiVersion": "v1", "kind": "List", "items": objects}
        )
        await self.cluster.must(
            f"kubectl create namespace {self.twin_namespace} && kubectl create -f twin.json",
            "cannot make the compliant twin",
        )

    def _files(self) -> Iterator[tuple[int, str]]:
        return ((i, f"policy-{i}.json") for i in range(len(self.found.documents)))

    async def _snapshot(self, suffix: str) -> list[dict[str, Any] | None]:
        """What the cluster holds of each workdir policy now (``None``: nothing)."""
        command = "; ".join(
            f"kubectl get -f {name} -o json --ignore-not-found > {name}.{suffix}"
            for _, name in self._files()
        )
        done = await self.cluster.run(command)
        if _unreached(done):
            raise CannotScore(f"cannot ask for the workdir's policies: {_last_line(done)}")
        held: list[dict[str, Any] | None] = []
        for _, name in self._files():
            try:
                objects = _listing(
                    await anyio.to_thread.run_sync(self.cluster.read, f"{name}.{suffix}")
                )
            except CannotScore:  # kubectl did not write it: a kind the cluster lacks
                objects = []
            held.append(objects[0] if objects else None)
        return held

    async def _apply(self) -> dict[str, Any] | None:
        """``kubectl apply`` of the workdir's policies; what to add to the details if the
        cluster refused them (the agent's failure: an invalid policy is never deployed)."""
        for index, name in self._files():
            await self.cluster.write(name, self.found.documents[index])
        self.before = await self._snapshot("before")
        names = " ".join(f"-f {name}" for _, name in self._files())
        done = await self.cluster.run(f"kubectl apply {names}")
        if done.success:
            return None
        if _unreached(done):
            raise CannotScore(f"cannot apply the workdir's policies: {_last_line(done)}")
        return {
            "apply": _said(done),
            "reason": f"kubectl apply refused the workdir's policies: {_last_line(done)}",
        }

    async def _await_reports(self, wait_s: float) -> None:
        """Until Kyverno reports the probe, in a version made after the apply, on the target
        (and the twin): :class:`CannotScore` after ``wait_s``, saying what it waited for."""
        targets = [self.target, *([self.twin] if self.twin else [])]
        rules = self.rules
        rules.append(f"probe-{secrets.token_hex(4)}")
        await self.cluster.write("probe.json", _probe(self.probe, rules[0], targets))
        self.probed = True  # deleted afterwards, whether this apply made it or not
        await self.cluster.must("kubectl apply -f probe.json", "cannot apply the probe policy")
        namespaces = sorted({t.namespace for t in targets})
        deadline = time.monotonic() + wait_s
        touched = time.monotonic()
        while True:
            reports = [
                report
                for namespace in namespaces
                for report in await self.cluster.listing(
                    f"policyreports.wgpolicyk8s.io -n {shlex.quote(namespace)}",
                    "seen.json",
                    "cannot ask for policy reports",
                )
            ]
            if all(probe_seen(reports, t, self.probe, rules) for t in targets):
                return
            now = time.monotonic()
            if now >= deadline:
                missing = [str(t) for t in targets if not probe_seen(reports, t, self.probe, rules)]
                raise CannotScore(
                    f"no Kyverno policy report on {' and '.join(missing)} showed the "
                    f"evaluator's probe policy {self.probe} within {wait_s:g} s: is Kyverno's "
                    "reports controller running, with background scans?"
                )
            if now - touched >= _TOUCH_S:  # a new rule name: Kyverno rescans now
                rule = f"probe-{secrets.token_hex(4)}"
                patch = json.dumps([{"op": "replace", "path": "/spec/rules/0/name", "value": rule}])
                await self.cluster.must(
                    f"kubectl patch clusterpolicy.kyverno.io {self.probe} --type=json "
                    f"-p {shlex.quote(patch)}",
                    "cannot change the probe policy",
                )
                rules.append(rule)
                touched = time.monotonic()
            await anyio.sleep(min(_POLL_S, max(deadline - time.monotonic(), 0.0)))

    def _strict_checks(
        self, reports: list[dict[str, Any]], scanned: list[dict[str, Any]]
    ) -> tuple[Check, ...]:
        """The fault fails a workdir policy and the twin none, in the ``scanned``
        reports (Kyverno's, written as the evaluation ran) of all ``reports``."""
        ours = self.found.names | ({UPDATE_POLICY} if self.kind is Kind.KYVERNO_UPDATE else set())
        failing = failing_policies(scanned, self.target)
        own = sorted(failing & ours)
        aside = sorted((failing_policies(reports, self.target) & ours) - failing)
        first = Check(
            "the fault's failure is the workdir's",
            bool(own),
            f"{self.target} fails {', '.join(own)}"
            if own
            else f"no policy of the workdir fails {self.target}"
            + (f" (it fails {', '.join(sorted(failing))})" if failing else "")
            + (
                f" (a report Kyverno did not write as the evaluation ran says it fails "
                f"{', '.join(aside)}: set aside)"
                if aside
                else ""
            ),
        )
        assert self.twin is not None
        wrong = sorted(failing_policies(scanned, self.twin) & ours)
        judged = sorted(failing_policies(scanned, self.twin, None) & ours)
        second = Check(
            "a compliant twin passes",
            not wrong,
            f"the compliant twin {self.twin} fails {', '.join(wrong)} too"
            if wrong
            else f"the compliant twin {self.twin} passes {', '.join(judged)}"
            if judged
            else f"no policy of the workdir has a result on the compliant twin {self.twin}",
        )
        return first, second

    async def restore(self) -> list[str]:
        """The cluster as it was: the probe and the twin deleted, each workdir policy
        deleted where it was new and replaced by what was there where it changed one.
        What it did, in words (a step that failed says so)."""
        steps: list[tuple[str, str]] = []
        if self.probed:
            steps.append(
                (
                    f"kubectl delete clusterpolicy.kyverno.io {self.probe} --ignore-not-found",
                    f"deleted the probe {self.probe}",
                )
            )
        if self.twin is not None:
            steps.append(
                (
                    f"kubectl delete namespace {self.twin_namespace} --ignore-not-found "
                    "--wait=false",
                    f"deleted the twin's namespace {self.twin_namespace}",
                )
            )
        done: list[str] = []
        for (index, name), old in zip(self._files(), self.before or [], strict=False):
            policy = self.found.documents[index]
            said = f"{policy['kind']} {policy['metadata'].get('name')}"
            if old is None:  # new, if the apply made it at all
                steps.append((f"kubectl delete -f {name} --ignore-not-found", f"removed {said}"))
                continue
            try:
                await self.cluster.write(f"{name}.restore", _cleaned(old))
            except CannotScore as exc:
                done.append(f"could not: put back {said} ({exc})")
                continue
            steps.append((f"kubectl replace -f {name}.restore", f"put back {said}"))
        self.probed, self.twin, self.before = False, None, None  # put back once
        for command, what in steps:
            ran = await self.cluster.run(command)
            done.append(what if ran.success else f"could not: {what} ({_last_line(ran)})")
        return done
