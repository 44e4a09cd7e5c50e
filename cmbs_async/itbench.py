"""IT-Bench CISO as it is: its scenario data in, a workdir as its agent harness leaves it,
and its pass criterion where it can run here.

IT-Bench hands an agent a *scenario data object* (``goal_template`` and ``vars``:
``ansible_ini``, ``ansible_user_key``, ``kubeconfig``); its harness writes those into a
fresh directory, fills the goal's ``{{ path_to_inventory }}`` and ``{{ kubeconfig }}``,
names the directory as the workdir, and after the agent (at most 200 s) tars the
directory as ``agent_data.tar``, which IT-Bench scores. Nothing of IT-Bench's own texts is
kept here: the goal comes from the user's IT-Bench at run time.
"""

from __future__ import annotations

import contextlib
import enum
import itertools
import json
import os
import re
import shutil
import socket
import stat
import tarfile
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, BinaryIO

import anyio
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from executors import Executor, LocalExecutor
from executors.observation import CommandEnv, Network, Observation
from executors.sandbox import TOOL_DIRS, command_env, default_hidden

from ._errors import CmbsError, one_line, validation_reason
from ._reading import ReadError, loads_json, read_json, read_text
from .scenario import ScenarioSpec
from .targets import destinations_from_inventory, destinations_from_kubeconfig
from .tools import tools_dir

__all__ = [
    "APPENDIX",
    "DEADLINE_S",
    "KYVERNO_CRDS",
    "CannotScore",
    "Evaluation",
    "Flip",
    "ItbenchError",
    "Kind",
    "ScenarioData",
    "agent_file",
    "check_strict",
    "cluster_problem",
    "collected_kind",
    "command_search",
    "evaluate",
    "guess_kind",
    "itbench_scenario",
    "load_scenario_data",
    "missing_program",
    "prepare_workdir",
    "program_hint",
    "replace_file",
    "targets",
    "with_key_file",
    "workdir_goal",
    "write_tar",
]

#: IT-Bench's budget for an agent (its harness runs the agent under ``timeout 200``).
DEADLINE_S = 200.0

#: The largest scenario data object, inventory or kubeconfig read from the operator.
DATA_MAX_BYTES = 8 * 1024 * 1024

#: What the supervisor adds to IT-Bench's goal, clearly apart from it: the gate's protocol.
APPENDIX = (
    "\n\n--- added by the cmbs supervisor, not part of the task ---\n"
    "Your actions are checked against what running them showed. When an evaluation has "
    "shown whether the condition holds, declare the posture (compliant or non_compliant) "
    "with declare_posture, then terminate.\n"
)

_KEY_FILE = re.compile(r"""(ansible_(?:ssh_)?private_key_file=)("[^"]*"|'[^']*'|\S+)""")
_LOCAL = re.compile(r"""\bansible_connection=["']?local\b""")
_PLACEHOLDER = re.compile(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}")


class ItbenchError(CmbsError, ValueError):
    """IT-Bench input that cannot be used; the message is one line."""


class CannotScore(ItbenchError):
    """The evaluator's programs are missing where its commands run: no verdict at all,
    never a fail (a missing tool is not the agent's failure); the message is one line."""


class Kind(enum.StrEnum):
    """The four IT-Bench CISO scenario kinds (named as the pack's folders)."""

    KYVERNO_GENERATE = "kyverno-generate"  # gen-cis-b-k8s-kyverno
    KUBECTL_OPA = "kubectl-opa"  # gen-cis-b-k8s-kubectl-opa
    RHEL9_ANSIBLE_OPA = "rhel9-ansible-opa"  # gen-cis-b-rhel9-ansible-opa
    KYVERNO_UPDATE = "kyverno-update"  # upd-cis-b-k8s-kyverno

    @property
    def needs(self) -> tuple[str, ...]:
        """The ``vars`` of the scenario data this kind cannot run without."""
        if self is Kind.RHEL9_ANSIBLE_OPA:
            return ("ansible_ini", "ansible_user_key")
        return ("kubeconfig",)

    @property
    def programs(self) -> tuple[tuple[str, ...], ...]:
        """The programs this kind's commands run (the agent's, and the evaluator's where it
        scores the kind), each as the names of which one must be found."""
        opa = ("opa", "cmbs-opa")
        if self is Kind.RHEL9_ANSIBLE_OPA:
            return (("ansible-playbook",), opa)
        if self is Kind.KUBECTL_OPA:
            return (("kubectl",), opa)
        return (("kubectl",),)


class ScenarioData(BaseModel):
    """The object IT-Bench's harness receives (``scenario_data.json``): the goal (as
    ``goal_template``, or ``goal`` as IT-Bench's goal playbooks write it) and ``vars``."""

    model_config = ConfigDict(extra="allow", frozen=True, populate_by_name=True)

    goal_template: str = Field(min_length=1)
    vars: dict[str, str] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _goal_alias(cls, data: Any) -> Any:
        if isinstance(data, dict) and "goal_template" not in data and "goal" in data:
            return {**data, "goal_template": data["goal"]}
        return data


def load_scenario_data(path: str | Path) -> ScenarioData:
    """Read a scenario data object; every problem is one :class:`ItbenchError` line."""
    try:  # capped in size and nesting: /dev/zero is one line, not the host's memory
        data = read_json(path, what="IT-Bench scenario data", max_bytes=DATA_MAX_BYTES)
    except ReadError as exc:
        raise ItbenchError(str(exc)) from None
    try:
        return ScenarioData.model_validate(data)
    except ValidationError as exc:
        raise ItbenchError(f"{path}: {validation_reason(exc)}") from exc


def guess_kind(goal: str) -> Kind | None:
    """The kind a goal describes, from the tools it names, if it says clearly."""
    words = goal.lower()
    if "ansible" in words:
        return Kind.RHEL9_ANSIBLE_OPA
    if "kyverno" in words:
        editing = ("existing" in words or "edit" in words) and "policies" in words
        return Kind.KYVERNO_UPDATE if editing else Kind.KYVERNO_GENERATE
    if "kubectl" in words and ("opa" in words or "rego" in words):
        return Kind.KUBECTL_OPA
    return None


def prepare_workdir(
    data: ScenarioData,
    workdir: str | Path,
    *,
    kind: Kind,
    owner: tuple[int, int] | None = None,
) -> str:
    """Lay out ``workdir`` as IT-Bench's harness does and return the goal it would hand
    the agent. ``workdir`` must be new or empty: nothing there is overwritten. ``owner``
    (uid, gid) is given the directory and its files: who the agent's commands run as."""
    goal = workdir_goal(data, workdir, kind=kind)
    root = Path(workdir).absolute()
    inventory, kubeconfig = root / "ansible.ini", root / "kubeconfig.yaml"
    if root.exists() and (not root.is_dir() or any(root.iterdir())):
        raise ItbenchError(f"{root} exists and is not an empty directory: name a new one")
    # the top-most directory this makes, if any: all under it is ours
    created = next((p for p in (*reversed(root.parents), root) if not p.exists()), None)
    try:
        root.mkdir(parents=True, exist_ok=True)
        _lay_out(root, data, inventory, kubeconfig, goal)
        if owner is not None:
            for path in (root, *root.iterdir()):
                os.chown(path, *owner, follow_symlinks=False)
    except OSError as exc:  # a full disk, a path that cannot be made: leave nothing behind
        if created is not None:
            shutil.rmtree(created, ignore_errors=True)
        else:  # it was empty: all it holds is ours
            for child in root.iterdir() if root.is_dir() else ():
                child.unlink(missing_ok=True)
        raise ItbenchError(f"cannot prepare {root}: {exc.strerror or exc}") from exc
    return goal


def workdir_goal(data: ScenarioData, workdir: str | Path, *, kind: Kind) -> str:
    """The goal IT-Bench's harness hands the agent in ``workdir``, made nowhere yet:
    :class:`ItbenchError` (one line) for scenario data that lacks what ``kind`` needs,
    a placeholder the harness never fills, or a workdir whose name would read as one."""
    missing = [name for name in kind.needs if not data.vars.get(name)]
    if missing:
        raise ItbenchError(f"a {kind.value} scenario needs vars.{missing[0]} in the scenario data")
    root = Path(workdir).absolute()
    mark = next((m for m in ("{{", "{%", "{#") if m in str(root)), None)
    if mark is not None:  # the goal, env and inventory would hold a template's placeholder
        raise ItbenchError(
            f"workdir {str(workdir)!r}: {mark!r} in its path would read as a template "
            "placeholder: name another"
        )
    inventory, kubeconfig = root / "ansible.ini", root / "kubeconfig.yaml"
    filled = {"kubeconfig": str(kubeconfig), "path_to_inventory": str(inventory)}
    goal = _PLACEHOLDER.sub(
        lambda m: filled.get(m.group(1), m.group(0)), data.goal_template.rstrip("\n")
    )
    left = _PLACEHOLDER.search(goal)
    if left is not None:
        raise ItbenchError(f"the goal names {left.group(0)}, which IT-Bench's harness never fills")
    return goal + f"\nYou can use `{root}` as your workdir.\n"


def _lay_out(root: Path, data: ScenarioData, inventory: Path, kubeconfig: Path, goal: str) -> None:
    """The harness's files in the new ``root``: from ``data``, and the filled ``goal``."""
    _write(root / "scenario_data.json", data.model_dump_json(by_alias=True), 0o600)
    if "ansible_user_key" in data.vars:
        _write(root / "user_key", _with_newline(data.vars["ansible_user_key"]), 0o600)
    if "ansible_ini" in data.vars:
        text = data.vars["ansible_ini"]
        if "ansible_user_key" in data.vars:  # the key the harness wrote, on every host
            text = with_key_file(text, str(root / "user_key"))
        _write(inventory, _with_newline(text), 0o600)
    if "kubeconfig" in data.vars:
        _write(kubeconfig, _with_newline(data.vars["kubeconfig"]), 0o600)
    _write(root / "goal.txt", goal, 0o644)


def with_key_file(inventory: str, key: str) -> str:
    """An Ansible INI inventory whose hosts use the private key ``key``, as IT-Bench's
    harness points them at ``user_key``: every ``ansible_ssh_private_key_file`` (or
    ``ansible_private_key_file``) names it, and a host line that names none gets one
    (after the host, before any comment); hosts on ``ansible_connection=local`` need none."""
    quoted = f'"{key}"'
    lines = _KEY_FILE.sub(lambda m: m.group(1) + quoted, inventory).splitlines(keepends=True)
    hosts = True  # before any section: ungrouped hosts
    for number, line in enumerate(lines):
        stripped = line.strip()
        if not stripped or stripped[0] in "#;":
            continue
        if stripped.startswith("[") and stripped.endswith("]"):
            hosts = stripped[1:-1].partition(":")[2].strip() in ("", "hosts")
            continue
        if not hosts or _KEY_FILE.search(line) or _LOCAL.search(line):
            continue
        host = re.match(r"\s*\S+", line)
        if host is not None:
            end = host.end()
            lines[number] = f"{line[:end]} ansible_ssh_private_key_file={quoted}{line[end:]}"
    return "".join(lines)


def command_search(executor: Executor) -> str | None:
    """The ``PATH`` a local executor's commands find programs on (the operator's
    absolute entries; sandboxed, without what the sandbox hides or empties: the home,
    ``/tmp``, ``/dev/shm``, unless they hold the tools), or ``None`` for another executor
    (its commands run elsewhere)."""
    if not isinstance(executor, LocalExecutor):
        return None
    entries = command_env(CommandEnv(), home=None)["PATH"].split(os.pathsep)
    if executor.containment == "bwrap":
        hidden = [os.path.realpath(p) for p in (*default_hidden(), "/tmp", "/dev/shm")]
        entries = [
            entry
            for entry in entries
            if not _under(os.path.realpath(entry), hidden)
            or _under(os.path.realpath(entry), TOOL_DIRS)
        ]
    return os.pathsep.join(entries)


def _under(path: str, folders: Sequence[str]) -> bool:
    return any(Path(path).is_relative_to(folder) for folder in folders)


def missing_program(kind: Kind, search: str, *, opa: str | None = None) -> str | None:
    """The first program ``kind``'s commands run that is not on ``search`` (a ``PATH``,
    as :func:`command_search` gives it), as it is said (``opa or cmbs-opa``); ``None`` if
    all are there. ``opa`` is the evaluator's own (``--opa``): that one, or none."""
    for names in kind.programs:
        where = search
        if "opa" in names:  # cmbs-opa is found where cmbs was installed, as _opa finds it
            names, where = (opa,) if opa is not None else names, search + os.pathsep + tools_dir()
        found = [
            name
            for name in names
            if (os.access(name, os.X_OK) if "/" in name else shutil.which(name, path=where))
        ]
        if not found:
            return " or ".join(names)
    return None


def program_hint(missing: str, search: str) -> str:
    """Why a program :func:`missing_program` named (``opa or cmbs-opa``) is not found
    although the operator's ``PATH`` has it: its directory is one sandboxed commands
    cannot see (the home, ``/tmp``; ``search`` is what they search), said as a clause
    to add to the message (``""`` if not so)."""
    for name in missing.split(" or "):
        found = None if "/" in name else shutil.which(name)
        if found is None or shutil.which(name, path=search) is not None:
            continue
        hidden = [os.path.realpath(p) for p in (*default_hidden(), "/tmp", "/dev/shm")]
        place = next((h for h in hidden if _under(os.path.realpath(found), [h])), None)
        unseen = f"under {place}, which" if place is not None else "where"
        return (
            f" ({found} is on your PATH but {unseen} sandboxed commands do not see: put it "
            "in a directory outside the home and /tmp, or run with --sandbox none)"
        )
    return ""


def itbench_scenario(
    goal: str,
    workdir: str | Path,
    *,
    kind: Kind,
    deadline_s: float = DEADLINE_S,
    network: Network | None = None,
) -> ScenarioSpec:
    """The scenario a prepared workdir runs as: IT-Bench's goal with :data:`APPENDIX`, its
    budget, the CISO profile; commands reach the kubeconfig by ``KUBECONFIG`` and new
    hosts without a known host key, as in IT-Bench's agent container. Their network is
    ``network``, by default only the targets its scenario data (``scenario_data.json`` in
    DIR) names."""
    root = Path(workdir).absolute()
    env = {"ANSIBLE_HOST_KEY_CHECKING": "False"}
    if (root / "kubeconfig.yaml").exists():
        env["KUBECONFIG"] = str(root / "kubeconfig.yaml")
    if network is None:
        network = targets(load_scenario_data(root / "scenario_data.json"))
    try:
        return ScenarioSpec(
            id=f"itbench-{kind.value}",
            goal=goal + APPENDIX,
            workdir=str(root),
            deadline_s=deadline_s,
            profile="ciso",
            env=env,
            network=network,
        )
    except ValidationError as exc:  # one line, as every refusal here
        raise ItbenchError(f"the scenario for {root}: {validation_reason(exc)}") from None


def targets(data: ScenarioData) -> tuple[str, ...]:
    """What the agent's commands may reach: the hosts of the scenario data's inventory and
    the servers of its kubeconfig, and nothing else; :class:`ItbenchError` (one line) if
    they cannot be read."""
    found: list[str] = []
    try:
        if data.vars.get("ansible_ini"):
            found += destinations_from_inventory(data.vars["ansible_ini"])
        if data.vars.get("kubeconfig"):
            found += destinations_from_kubeconfig(data.vars["kubeconfig"])
    except ValueError as exc:
        raise ItbenchError(f"the scenario data: {one_line(str(exc))}") from None
    return tuple(dict.fromkeys(found))


#: What a Kyverno kind needs in its cluster, as CRDs: the reports IT-Bench scores, and the
#: policies the agent deploys (or edits); without them no Kyverno is installed there.
KYVERNO_CRDS = ("policyreports.wgpolicyk8s.io", "clusterpolicies.kyverno.io")
#: How long kubectl waits for the cluster when cmbs asks it (``--request-timeout``).
_CLUSTER_WAIT_S = 20


async def cluster_problem(
    executor: Executor, kind: Kind, kubeconfig: str, *, command_timeout_s: float = 60.0
) -> str | None:
    """Why the cluster that ``kubeconfig`` (a kubeconfig's text) names cannot serve a
    ``kind`` scenario, said to follow "the cluster of ...": its server does not answer
    (``kubectl version``), or, for the Kyverno kinds, it has no Kyverno (one of
    :data:`KYVERNO_CRDS` absent); ``None`` if it can. Asked with kubectl in a fresh
    directory of ``executor``, as the scenario's commands run (sandboxed, reaching only
    the kubeconfig's servers: a credential plugin it names runs there too), and removed.
    :class:`ItbenchError` (one line) for a kubeconfig that names no server."""
    try:
        network = destinations_from_kubeconfig(kubeconfig)
    except ValueError as exc:
        raise ItbenchError(f"the kubeconfig: {one_line(str(exc))}") from None
    if isinstance(executor, LocalExecutor):  # its commands connect from here: say why not
        for destination in network:
            refused = await _unreachable(destination)
            if refused is not None:
                return f"does not answer: cannot connect to {destination} ({refused})"
    env = CommandEnv(network=network)
    fresh = await executor.prepare(None, {"kubeconfig.yaml": kubeconfig}, env=env)
    try:
        env = env.model_copy(update={"values": {"KUBECONFIG": f"{fresh}/kubeconfig.yaml"}})
        run = partial(executor.run_command, fresh, timeout=command_timeout_s, env=env)
        wait = f"--request-timeout={_CLUSTER_WAIT_S}s"
        version = await run(f"kubectl version --output=json {wait}")
        if version.program_found is False:
            return "cannot be asked: kubectl not found where commands run"
        if not version.success:
            return f"does not answer: {_last_line(version)}"
        if kind not in (Kind.KYVERNO_GENERATE, Kind.KYVERNO_UPDATE):
            return None
        crds = await run(
            f"kubectl get customresourcedefinitions {' '.join(KYVERNO_CRDS)} --output=name {wait}"
        )
    finally:
        with anyio.CancelScope(shield=True):
            await executor.cleanup(fresh)
    listed = {line.rpartition("/")[2] for line in crds.stdout.text.split()}
    absent = [name for name in KYVERNO_CRDS if name not in listed]
    if absent and (crds.success or "(NotFound)" in crds.stderr.text):
        return f"has no Kyverno (no CRD {absent[0]}): a {kind.value} scenario needs it installed"
    if not crds.success:
        return f"cannot be asked for Kyverno's CRDs: {_last_line(crds)}"
    return None


async def _unreachable(destination: str, timeout_s: float = 10.0) -> str | None:
    """Why no TCP connection to ``destination`` (``HOST:PORT``, ``[V6]:PORT``) can be
    made from here within ``timeout_s``, or ``None`` if one can."""
    host, _, port = destination.rpartition(":")
    connect = partial(socket.create_connection, (host.strip("[]"), int(port)), timeout_s)
    try:
        connected = await anyio.to_thread.run_sync(connect)
    except TimeoutError:
        return f"no answer within {timeout_s:g} s"
    except OSError as exc:
        return one_line(exc.strerror or str(exc))
    connected.close()
    return None


def _last_line(observation: Observation) -> str:
    """What a failed command said last (stderr, else stdout), on one line, capped."""
    for stream in (observation.stderr.text, observation.stdout.text):
        lines = [line for line in stream.splitlines() if line.strip()]
        if lines:
            return one_line(lines[-1])[:300]
    return observation.summary()[:300]


def write_tar(workdir: str | Path, tar_path: str | Path) -> None:
    """``tar -C WORKDIR -cf TAR .``, as the harness writes ``agent_data.tar``: links kept as
    links, the file made anew (never written through a link the agent left)."""
    with _replacing(Path(tar_path).absolute()) as (file, temporary):
        with tarfile.open(fileobj=file, mode="w") as tar:
            omit = os.path.basename(temporary)  # the tar itself, where it lies in the workdir
            tar.add(workdir, arcname=".", filter=lambda i: None if _is(i, omit) else i)


def _is(info: tarfile.TarInfo, name: str) -> bool:
    return info.name.endswith("/" + name)


@dataclass(frozen=True, slots=True)
class Evaluation:
    """IT-Bench's verdict on a workdir: ``passed`` and what it rests on."""

    passed: bool
    details: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps({"pass": self.passed, "details": self.details}, indent=2) + "\n"


#: What the evaluator runs its copy of the agent's collector with, per kind.
_COLLECTORS = {
    Kind.RHEL9_ANSIBLE_OPA: ("playbook.yml",),
    Kind.KUBECTL_OPA: ("fetcher.sh", "script.sh"),
}


#: What IT-Bench's evaluator runs on the collected input (``{opa}``: the program).
_EVALUATE = (
    "{opa} eval --data policy.rego --input collected_data.json data.check.result --format raw"
)
#: The file a kind's target is copied to, beside the collector.
_OWN = {Kind.RHEL9_ANSIBLE_OPA: "inventory.ini", Kind.KUBECTL_OPA: "kubeconfig.yaml"}
#: A verdict's opposite: what the policy must print where the checked setting is reversed.
_OPPOSITE = {"false": "true", "true": "false"}


@dataclass(frozen=True, slots=True)
class Flip:
    """One change of ``--flip POINTER=VALUE``: in the opposite state, the collected input
    holds ``value`` (JSON, else the text as a string) at ``pointer`` (a JSON Pointer, RFC
    6901, where a ``*`` segment stands for every member of an object or array). The
    operator's knowledge of the check: which setting it reads, and its other value."""

    pointer: str
    value: Any

    @classmethod
    def parse(cls, text: str) -> Flip:
        """``/x11_forwarding=no`` (split at the first ``=``); :class:`ItbenchError` (one
        line) if it is not of that form."""
        pointer, equals, value = text.partition("=")
        if not equals or not pointer.startswith("/"):
            raise ItbenchError(
                f"--flip {text!r}: give POINTER=VALUE, POINTER a JSON Pointer "
                "(/x11_forwarding=no, say)"
            )
        try:
            parsed: Any = json.loads(value)
        except ValueError:  # not JSON: the text itself (no, disabled, ...)
            parsed = value
        except RecursionError:
            raise ItbenchError(f"--flip {pointer}: the value is nested too deeply") from None
        return cls(pointer, parsed)


def check_strict(
    kind: Kind,
    *,
    strict: bool,
    fixed_inventory: str | None = None,
    fixed_kubeconfig: str | None = None,
    flips: tuple[Flip, ...] = (),
) -> str | None:
    """The opposite-state options of ``evaluate``, checked: the fixed target's file (if
    one is given), or :class:`ItbenchError` (one line) if they do not go together."""
    named = [
        option
        for option, given in (
            ("--fixed-inventory", fixed_inventory),
            ("--fixed-kubeconfig", fixed_kubeconfig),
            ("--flip", flips),
        )
        if given
    ]
    if named and not strict:
        raise ItbenchError(f"{named[0]} is for --strict scoring: give --strict too")
    if len(named) > 1:
        raise ItbenchError(f"give {named[0]} or {named[1]}, not both: one opposite state")
    wrong = fixed_kubeconfig if kind is Kind.RHEL9_ANSIBLE_OPA else fixed_inventory
    if wrong is not None:
        right = "--fixed-inventory" if kind is Kind.RHEL9_ANSIBLE_OPA else "--fixed-kubeconfig"
        raise ItbenchError(f"a {kind.value} workdir's fixed target is given as {right} FILE")
    return fixed_inventory or fixed_kubeconfig


async def evaluate(
    workdir: str | Path,
    *,
    executor: Executor,
    kind: Kind,
    inventory: str | None = None,
    kubeconfig: str | None = None,
    expect: str = "false",
    opa: str | None = None,
    command_timeout_s: float = 300.0,
    strict: bool = False,
    fixed_inventory: str | None = None,
    fixed_kubeconfig: str | None = None,
    flips: tuple[Flip, ...] = (),
) -> Evaluation:
    """IT-Bench's pass criterion for an Ansible/kubectl + OPA workdir: the agent's
    collector and ``policy.rego`` copied into a fresh directory, the collector run
    against the evaluator's own target (``inventory`` or ``kubeconfig``), then ``opa eval
    --data policy.rego --input collected_data.json data.check.result --format raw``;
    passed iff it prints exactly ``expect`` (``false``: the fault IT-Bench injected).

    ``strict`` also asks for the opposite verdict on the opposite state, so that a policy
    that prints ``expect`` whatever it is given cannot pass: the same collector and policy
    against a target known to be fixed (``fixed_inventory``/``fixed_kubeconfig``), else
    the policy on the collected input (read here: the executor's workdirs are on this
    machine) with ``flips`` applied, else with one setting turned to its opposite
    (:func:`_mutations`). The details record both verdicts (``verdicts``) and how the
    opposite state was made (``strict``).

    :class:`CannotScore` (no verdict) where the evaluator's programs (``ansible-playbook``
    or ``kubectl``, and ``opa``) are missing where its commands run: checked on a local
    executor's ``PATH`` before anything runs, and on any executor from what ran; and where
    the cluster of ``kubeconfig`` (or ``fixed_kubeconfig``) does not answer
    (:func:`cluster_problem`), asked before the agent's collector runs."""
    if kind not in _COLLECTORS:
        raise ItbenchError(
            f"{kind.value} is scored against a live cluster with Kyverno: "
            "cmbs_async.kyverno.evaluate_kyverno"
        )
    target = inventory if kind is Kind.RHEL9_ANSIBLE_OPA else kubeconfig
    if target is None:
        option = "--inventory" if kind is Kind.RHEL9_ANSIBLE_OPA else "--kubeconfig"
        raise ItbenchError(f"evaluating {kind.value} needs the evaluator's {option} FILE")
    fixed = check_strict(
        kind,
        strict=strict,
        fixed_inventory=fixed_inventory,
        fixed_kubeconfig=fixed_kubeconfig,
        flips=flips,
    )
    details: dict[str, Any] = {"kind": kind.value, "expected": expect}
    found = await anyio.to_thread.run_sync(_scored_files, Path(workdir), kind, Path(target))
    fixed_text = None if fixed is None else await anyio.to_thread.run_sync(_read, Path(fixed))
    if fixed_text is not None:  # a target that cannot be read or reached: before anything runs
        _network(kind, fixed_text, "fixed")
    if isinstance(found, str):
        return Evaluation(False, details | {"reason": found})
    search = command_search(executor)
    missing = None if search is None else missing_program(kind, search, opa=opa)
    if missing is not None:  # before anything runs: no verdict, not the agent's failure
        raise CannotScore(
            f"{missing} not found on the PATH the evaluator's commands run with"
            + program_hint(missing, search or "")
        )
    files, collector = found
    # a cluster that does not answer is no verdict either: asked before anything runs
    for option, path, text in (
        ("--kubeconfig", target, files.get("kubeconfig.yaml")),
        ("--fixed-kubeconfig", fixed, fixed_text),
    ):
        if kind is Kind.KUBECTL_OPA and text is not None:
            problem = await cluster_problem(
                executor, kind, text, command_timeout_s=command_timeout_s
            )
            if problem is not None:
                raise CannotScore(f"the cluster of {option} {path} {problem}")
    opa = opa or _opa(search)
    run = partial(_collect_and_evaluate, executor, kind, collector, opa, command_timeout_s)
    real = await run(files, keep_input=strict and fixed_text is None)
    details |= real.details
    passed = real.printed == expect
    if not strict:
        return Evaluation(
            passed, details | {"reason": f"{_shown(real.printed)}; expected {expect!r}"}
        )
    opposite = _OPPOSITE[expect]
    if fixed_text is not None:
        other = await run(files | {_OWN[kind]: fixed_text}, keep_input=False)
        check: dict[str, Any] = {"against": "the fixed target", **other.details}
        printed, problem = other.printed, None
    else:
        check, printed, problem = await _opposite_input(
            executor,
            files["policy.rego"],
            real.collected,
            flips,
            expect=expect,
            opa=opa,
            command_timeout_s=command_timeout_s,
        )
    details["verdicts"] = {"target": real.printed, "opposite": printed}
    details["strict"] = {"expected": opposite, **check}
    reason = (
        f"{_shown(real.printed)} on the target, {_shown(printed)} on {check['against']}; "
        f"expected {expect!r} and {opposite!r}"
    )
    if problem is not None:
        reason = f"{_shown(real.printed)} on the target; {problem}"
    passed = passed and problem is None and printed == opposite
    return Evaluation(passed, details | {"reason": reason})


@dataclass(frozen=True, slots=True)
class _Verdict:
    """One run of the agent's collector and policy: what they said, what the policy
    printed (``None`` if the evaluation failed), the collected input where kept."""

    details: dict[str, Any]
    printed: str | None
    collected: str | None = None


async def _collect_and_evaluate(
    executor: Executor,
    kind: Kind,
    collector: str,
    opa: str,
    command_timeout_s: float,
    files: dict[str, str],
    *,
    keep_input: bool,
) -> _Verdict:
    """The collector run against the target in ``files`` (and nothing else), then the
    policy on what it collected, in a fresh copy removed afterwards."""
    own = files[_OWN[kind]]
    env: dict[str, str] = {}
    readable: tuple[str, ...] = ()
    if kind is Kind.RHEL9_ANSIBLE_OPA:
        readable = _key_files(own)
        env["ANSIBLE_HOST_KEY_CHECKING"] = "False"
        collect = f"ansible-playbook -i inventory.ini {collector}"
    else:
        collect = f"bash {collector}"  # as IT-Bench runs it
    # the agent's collector reaches the evaluator's target and nothing else
    command_env = CommandEnv(values=env, readable=readable, network=_network(kind, own))
    fresh = await executor.prepare(None, files, env=command_env)
    collected: str | None = None
    try:
        if kind is Kind.KUBECTL_OPA:
            env["KUBECONFIG"] = f"{fresh}/kubeconfig.yaml"
            command_env = command_env.model_copy(update={"values": env})
        run = partial(executor.run_command, fresh, timeout=command_timeout_s, env=command_env)
        collected_by = await run(collect)
        if kind is Kind.RHEL9_ANSIBLE_OPA and collected_by.program_found is False:
            raise CannotScore("ansible-playbook not found where the evaluator's commands run")
        said = {"collector": _said(collected_by)}
        evaluation = await run(_EVALUATE.format(opa=opa))
        if evaluation.program_found is False:  # the evaluator's own program, not the agent's
            raise CannotScore(f"{opa} not found where the evaluator's commands run")
        said["evaluation"] = _said(evaluation)
        if keep_input:
            collected = await anyio.to_thread.run_sync(
                agent_file, Path(fresh, "collected_data.json")
            )
    finally:
        with anyio.CancelScope(shield=True):  # cancelled or not, the copy goes
            await executor.cleanup(fresh)
    printed = evaluation.stdout.text.strip() if evaluation.success else None
    return _Verdict(said, printed, collected)


def _network(kind: Kind, target: str, whose: str = "evaluator's") -> tuple[str, ...]:
    """The destinations a target file names, or :class:`ItbenchError` (one line)."""
    try:
        if kind is Kind.RHEL9_ANSIBLE_OPA:
            return destinations_from_inventory(target)
        return destinations_from_kubeconfig(target)
    except ValueError as exc:
        raise ItbenchError(f"the {whose} target: {one_line(str(exc))}") from None


def _shown(printed: str | None) -> str:
    return "the evaluation failed" if printed is None else f"printed {printed[:80]!r}"


#: The most changed inputs the mutated opposite tries (one ``opa eval`` each).
_MUTATIONS_TRIED = 64


async def _opposite_input(
    executor: Executor,
    policy: str,
    collected: str | None,
    flips: tuple[Flip, ...],
    *,
    expect: str,
    opa: str,
    command_timeout_s: float,
) -> tuple[dict[str, Any], str | None, str | None]:
    """The policy on the collected input changed to the opposite state (``flips``, else
    each of :func:`_mutations` until one turns the verdict), in a fresh directory with no
    network; first on the input unchanged, which must print ``expect`` again (the input
    is what the collector left, read once). Returns what it did, the opposite verdict,
    and why there is none (or ``None``)."""
    against = "the collected input with " + ("--flip applied" if flips else "a setting reversed")
    check: dict[str, Any] = {"against": against}
    if collected is None:
        return check, None, "the collector left no regular collected_data.json of at most 4 MiB"
    try:  # nested at most 64 deep: what changes it never recurses too deeply
        document = loads_json(collected, origin="collected_data.json")
    except ReadError:
        return check, None, "the collected input is not JSON that can be changed"
    if flips:
        changed = _flipped(document, flips)
        if isinstance(changed, str):
            return check, None, changed
        candidates: Iterator[tuple[_Changes, str]] = iter([changed])
    else:
        candidates = _mutations(document)
        first = next(candidates, None)
        if first is None:
            return (
                check,
                None,
                (
                    "no setting of the collected input has an opposite cmbs knows: "
                    "give --flip POINTER=VALUE or a fixed target"
                ),
            )
        candidates = itertools.chain([first], candidates)
    files = {"policy.rego": policy, "collected_data.json": collected}
    fresh = await executor.prepare(None, files, env=CommandEnv(network="none"))
    try:
        run = partial(
            executor.run_command, fresh, _EVALUATE.format(opa=opa), timeout=command_timeout_s
        )
        baseline = await run()
        check["unchanged"] = _said(baseline)
        if not baseline.success or baseline.stdout.text.strip() != expect:
            again = _shown(baseline.stdout.text.strip() if baseline.success else None)
            return check, None, f"the collected input, evaluated again, {again}"
        printed: str | None = None
        # one changed input at a time: at most 4 MiB held
        for tried, (changes, text) in enumerate(candidates, 1):
            written = await executor.write_artifact(fresh, "collected_data.json", text)
            if not written.success:
                return check, None, f"cannot write the changed input: {written.error}"
            evaluation = await run()
            printed = evaluation.stdout.text.strip() if evaluation.success else None
            check |= {
                "changed": changes[:_CHANGES_KEPT],
                "places": len(changes),
                "evaluation": _said(evaluation),
                "tried": tried,
            }
            if printed == _OPPOSITE[expect]:
                break
    finally:
        with anyio.CancelScope(shield=True):
            await executor.cleanup(fresh)
    return check, printed, None


_Changes = list[dict[str, Any]]
#: The most changed places ``evaluation.json`` lists of one change (``places``: all).
_CHANGES_KEPT = 50


def _flipped(document: Any, flips: tuple[Flip, ...]) -> tuple[_Changes, str] | str:
    """``document`` with every ``flips`` applied (as JSON text) and what changed, or why
    it cannot be: a pointer that names nothing there, or no value that changes."""
    changes: _Changes = []
    for flip in flips:
        places = _places(document, flip.pointer)
        if not places:
            return f"the collected input has nothing at {flip.pointer}"
        for where, parent, key in places:
            if parent[key] != flip.value:
                changes.append({"path": where, "from": parent[key], "to": flip.value})
                parent[key] = flip.value
    if not changes:
        return "--flip changes nothing: the collected input holds those values already"
    return changes, json.dumps(document)


def _places(document: Any, pointer: str) -> list[tuple[str, Any, Any]]:
    """Where a JSON Pointer (``*``: every member) points in ``document``: each place as
    (its pointer, its container, its key or index)."""
    parts = [p.replace("~1", "/").replace("~0", "~") for p in pointer.split("/")[1:]]
    found: list[tuple[str, Any, Any]] = []
    level: list[tuple[str, Any]] = [("", document)]
    for depth, part in enumerate(parts):
        following: list[tuple[str, Any]] = []
        for where, node in level:
            keys: list[Any]
            if isinstance(node, dict):
                keys = list(node) if part == "*" else [part] if part in node else []
            elif isinstance(node, list):
                index = int(part) if part.isdigit() and int(part) < len(node) else None
                keys = list(range(len(node))) if part == "*" else [] if index is None else [index]
            else:
                keys = []
            for key in keys:
                place = f"{where}/{str(key).replace('~', '~0').replace('/', '~1')}"
                if depth == len(parts) - 1:
                    found.append((place, node, key))
                else:
                    following.append((place, node[key]))
        level = following
    return found


#: Opposite values of a setting, in the words configurations use (no check's knowledge).
_WORDS = {
    "yes": "no",
    "true": "false",
    "on": "off",
    "enabled": "disabled",
    "enable": "disable",
    "allow": "deny",
    "allowed": "denied",
    "1": "0",
}
_WORDS |= {b: a for a, b in _WORDS.items()}


def _reversed(value: Any) -> Any:
    """The opposite of a setting's value (a boolean, 0 or 1, a word of :data:`_WORDS`
    in the same case), or ``_NONE`` where there is none."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int) and value in (0, 1):
        return 1 - value
    if isinstance(value, str) and value.lower() in _WORDS:
        word = _WORDS[value.lower()]
        return (
            word.upper() if value.isupper() else word.capitalize() if value[:1].isupper() else word
        )
    return _NONE


_NONE = object()


def _mutations(document: Any) -> Iterator[tuple[_Changes, str]]:
    """The collected input with one setting reversed, for each setting that has an
    opposite (:func:`_reversed`): a setting is a key and its value, reversed wherever that
    key holds that value (every pod's ``hostNetwork: true`` at once), in the order first
    found; at most :data:`_MUTATIONS_TRIED`."""
    groups: dict[tuple[str, str], list[tuple[str, Any, Any]]] = {}
    root: dict[str, Any] = {"": document}  # a container for the document itself
    stack: list[tuple[str, str, Any, Any]] = [("", "", root, "")]
    while stack:  # depth first, in document order, without recursion
        where, name, parent, key = stack.pop()
        node = parent[key]
        members: list[tuple[str, str, Any, Any]]
        if isinstance(node, dict):
            members = [(f"{where}/{_escaped(k)}", k, node, k) for k in node]
        elif isinstance(node, list):
            members = [(f"{where}/{i}", name, node, i) for i in range(len(node))]
        else:
            if _reversed(node) is not _NONE:
                groups.setdefault((name, json.dumps(node)), []).append((where, parent, key))
            continue
        stack.extend(reversed(members))
    for (_, value), places in list(groups.items())[:_MUTATIONS_TRIED]:
        old = json.loads(value)
        new = _reversed(old)
        for _, parent, key in places:
            parent[key] = new
        changes = [{"path": where, "from": old, "to": new} for where, _, _ in places]
        text = json.dumps(root[""])
        for _, parent, key in places:
            parent[key] = old
        yield changes, text


def _escaped(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


def collected_kind(root: Path) -> Kind | None:
    """The kind whose collector ``root`` holds (a playbook, a kubectl script), if any."""
    for kind, names in _COLLECTORS.items():
        if any(os.path.lexists(root / name) for name in names):
            return kind
    return None


def _scored_files(root: Path, kind: Kind, target: Path) -> tuple[dict[str, str], str] | str:
    """What the evaluator copies (the agent's collector and policy, its own target file)
    and the collector's name, or why there is nothing to score."""
    collector = next((n for n in _COLLECTORS[kind] if os.path.lexists(root / n)), None)
    if collector is None or not os.path.lexists(root / "policy.rego"):
        missing = "policy.rego" if collector else " or ".join(_COLLECTORS[kind])
        return f"no {missing} in {root}: nothing to score"
    files: dict[str, str] = {}
    for name in (collector, "policy.rego"):
        text = agent_file(root / name)
        if text is None:
            return f"{name} is not a regular UTF-8 file of at most {_AGENT_FILE_CAP} bytes"
        files[name] = text
    own = "inventory.ini" if kind is Kind.RHEL9_ANSIBLE_OPA else "kubeconfig.yaml"
    files[own] = _read(target)
    return files, collector


def _said(observation: Observation) -> dict[str, Any]:
    return {
        "command": observation.command,
        "exit_status": observation.exit_status,
        "stdout": observation.stdout.text[-4000:],
        "stderr": observation.stderr.text[-4000:],
    }


def _opa(search: str | None) -> str:
    """``opa`` where installed, else ``cmbs-opa`` (installed with cmbs), as the
    evaluator's commands find them (``search``: their ``PATH``, as
    :func:`command_search` gives it; ``None``: this process's)."""
    for name in ("opa", "cmbs-opa"):
        found = shutil.which(name, path=search) or shutil.which(name, path=tools_dir())
        if found:
            return found
    return "opa"


def _key_files(inventory: str) -> tuple[str, ...]:
    """The private keys an inventory names: a sandboxed ansible must read them."""
    return tuple(os.path.expanduser(m.group(2).strip("\"'")) for m in _KEY_FILE.finditer(inventory))


#: The most of an agent's file the evaluator reads (a policy, a playbook, scenario data).
_AGENT_FILE_CAP = 4 * 1024 * 1024


def agent_file(path: Path) -> str | None:
    """The text of a file the agent may have replaced: a regular file, never through a
    symbolic link, capped (a link to ``/dev/zero`` or to the operator's key is refused);
    ``None`` if it is none of that."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as file:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        data = file.read(_AGENT_FILE_CAP + 1)
    if len(data) > _AGENT_FILE_CAP:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def replace_file(folder: Path, name: str, text: str) -> None:
    """Write ``folder/name`` anew, replacing whatever the agent left there (a symbolic
    link included: never written through)."""
    with _replacing(folder / name) as (file, _):
        file.write(text.encode("utf-8"))


@contextlib.contextmanager
def _replacing(target: Path) -> Iterator[tuple[BinaryIO, str]]:
    """A new file beside ``target``, renamed over it once written (a link there is
    replaced, never followed), removed if writing fails; with its temporary path."""
    fd, temporary = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    try:
        with os.fdopen(fd, "wb") as file:
            yield file, temporary
        os.replace(temporary, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


def _read(path: Path) -> str:
    """An operator's file (an inventory, a kubeconfig), capped as scenario data is."""
    try:
        return read_text(path, what="an inventory or kubeconfig", max_bytes=DATA_MAX_BYTES)
    except ReadError as exc:
        raise ItbenchError(str(exc)) from None


def _write(path: Path, text: str, mode: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
    with os.fdopen(fd, "w", encoding="utf-8") as file:
        file.write(text)


def _with_newline(text: str) -> str:
    return text if text.endswith("\n") else text + "\n"
