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
import json
import os
import re
import shutil
import stat
import tarfile
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, BinaryIO

import anyio
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from executors import Executor
from executors.observation import CommandEnv, Network, Observation

from ._errors import CmbsError, one_line, validation_reason
from .scenario import ScenarioSpec
from .targets import destinations_from_inventory, destinations_from_kubeconfig
from .tools import tools_dir

__all__ = [
    "APPENDIX",
    "DEADLINE_S",
    "Evaluation",
    "ItbenchError",
    "Kind",
    "ScenarioData",
    "agent_file",
    "collected_kind",
    "evaluate",
    "guess_kind",
    "itbench_scenario",
    "load_scenario_data",
    "prepare_workdir",
    "replace_file",
    "targets",
    "write_tar",
]

#: IT-Bench's budget for an agent (its harness runs the agent under ``timeout 200``).
DEADLINE_S = 200.0

#: What the supervisor adds to IT-Bench's goal, clearly apart from it: the gate's protocol.
APPENDIX = (
    "\n\n--- added by the cmbs supervisor, not part of the task ---\n"
    "Your actions are checked against what running them showed. When an evaluation has "
    "shown whether the condition holds, declare the posture (compliant or non_compliant) "
    "with declare_posture, then terminate.\n"
)

_KEY_FILE = re.compile(r"""(ansible_ssh_private_key_file=)("[^"]*"|'[^']*'|\S+)""")
_PLACEHOLDER = re.compile(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}")


class ItbenchError(CmbsError, ValueError):
    """IT-Bench input that cannot be used; the message is one line."""


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
    try:
        data = json.loads(Path(path).read_bytes())
    except OSError as exc:
        raise ItbenchError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    except ValueError as exc:
        raise ItbenchError(f"{path}: not a JSON object: {one_line(str(exc))}") from exc
    except RecursionError:
        raise ItbenchError(f"{path}: nested too deeply to be scenario data") from None
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
    missing = [name for name in kind.needs if not data.vars.get(name)]
    if missing:
        raise ItbenchError(f"a {kind.value} scenario needs vars.{missing[0]} in the scenario data")
    root = Path(workdir).absolute()
    inventory, kubeconfig = root / "ansible.ini", root / "kubeconfig.yaml"
    filled = {"kubeconfig": str(kubeconfig), "path_to_inventory": str(inventory)}
    goal = _PLACEHOLDER.sub(
        lambda m: filled.get(m.group(1), m.group(0)), data.goal_template.rstrip("\n")
    )
    left = _PLACEHOLDER.search(goal)
    if left is not None:
        raise ItbenchError(f"the goal names {left.group(0)}, which IT-Bench's harness never fills")
    goal += f"\nYou can use `{root}` as your workdir.\n"
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


def _lay_out(root: Path, data: ScenarioData, inventory: Path, kubeconfig: Path, goal: str) -> None:
    """The harness's files in the new ``root``: from ``data``, and the filled ``goal``."""
    _write(root / "scenario_data.json", data.model_dump_json(by_alias=True), 0o600)
    if "ansible_user_key" in data.vars:
        _write(root / "user_key", _with_newline(data.vars["ansible_user_key"]), 0o600)
    if "ansible_ini" in data.vars:
        key = f'"{root / "user_key"}"'
        text = _KEY_FILE.sub(lambda m: m.group(1) + key, data.vars["ansible_ini"])
        _write(inventory, _with_newline(text), 0o600)
    if "kubeconfig" in data.vars:
        _write(kubeconfig, _with_newline(data.vars["kubeconfig"]), 0o600)
    _write(root / "goal.txt", goal, 0o644)


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
    return ScenarioSpec(
        id=f"itbench-{kind.value}",
        goal=goal + APPENDIX,
        workdir=str(root),
        deadline_s=deadline_s,
        profile="ciso",
        env=env,
        network=targets(load_scenario_data(root / "scenario_data.json"))
        if network is None
        else network,
    )


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
) -> Evaluation:
    """IT-Bench's pass criterion for an Ansible/kubectl + OPA workdir: the agent's
    collector and ``policy.rego`` copied into a fresh directory, the collector run
    against the evaluator's own target (``inventory`` or ``kubeconfig``), then ``opa eval
    --data policy.rego --input collected_data.json data.check.result --format raw``;
    passed iff it prints exactly ``expect`` (``false``: the fault IT-Bench injected)."""
    if kind not in _COLLECTORS:
        raise ItbenchError(f"{kind.value} is scored against a live cluster with Kyverno")
    target = inventory if kind is Kind.RHEL9_ANSIBLE_OPA else kubeconfig
    if target is None:
        option = "--inventory" if kind is Kind.RHEL9_ANSIBLE_OPA else "--kubeconfig"
        raise ItbenchError(f"evaluating {kind.value} needs the evaluator's {option} FILE")
    details: dict[str, Any] = {"kind": kind.value, "expected": expect}
    found = await anyio.to_thread.run_sync(_scored_files, Path(workdir), kind, Path(target))
    if isinstance(found, str):
        return Evaluation(False, details | {"reason": found})
    files, collector = found
    env: dict[str, str] = {}
    readable: tuple[str, ...] = ()
    if kind is Kind.RHEL9_ANSIBLE_OPA:
        readable = _key_files(files["inventory.ini"])
        env["ANSIBLE_HOST_KEY_CHECKING"] = "False"
        collect = f"ansible-playbook -i inventory.ini {collector}"
    else:
        collect = f"sh {collector}"
    try:  # the agent's collector reaches the evaluator's target and nothing else
        network = (
            destinations_from_inventory(files["inventory.ini"])
            if kind is Kind.RHEL9_ANSIBLE_OPA
            else destinations_from_kubeconfig(files["kubeconfig.yaml"])
        )
    except ValueError as exc:
        raise ItbenchError(f"the evaluator's target: {one_line(str(exc))}") from None
    command_env = CommandEnv(values=env, readable=readable, network=network)
    fresh = await executor.prepare(None, files, env=command_env)
    try:
        if kind is Kind.KUBECTL_OPA:
            env["KUBECONFIG"] = f"{fresh}/kubeconfig.yaml"
            command_env = command_env.model_copy(update={"values": env})
        run = partial(executor.run_command, fresh, timeout=command_timeout_s, env=command_env)
        details["collector"] = _said(await run(collect))
        evaluation = await run(
            f"{opa or _opa()} eval --data policy.rego --input collected_data.json "
            "data.check.result --format raw"
        )
        details["evaluation"] = _said(evaluation)
    finally:
        with anyio.CancelScope(shield=True):  # cancelled or not, the copy goes
            await executor.cleanup(fresh)
    printed = evaluation.stdout.text.strip()
    passed = evaluation.success and printed == expect
    reason = f"printed {printed[:80]!r}" if evaluation.success else "the evaluation failed"
    return Evaluation(passed, details | {"reason": f"{reason}; expected {expect!r}"})


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


def _opa() -> str:
    """``opa`` where installed, else ``cmbs-opa`` (installed with cmbs)."""
    for name in ("opa", "cmbs-opa"):
        found = shutil.which(name) or shutil.which(name, path=tools_dir())
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
    try:
        return path.read_text("utf-8")
    except OSError as exc:
        raise ItbenchError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    except UnicodeDecodeError:
        raise ItbenchError(f"{path}: not UTF-8 text") from None


def _write(path: Path, text: str, mode: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
    with os.fdopen(fd, "w", encoding="utf-8") as file:
        file.write(text)


def _with_newline(text: str) -> str:
    return text if text.endswith("\n") else text + "\n"
