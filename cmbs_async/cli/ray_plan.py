"""What ``cmbs batch --backend ray`` sends its workers: the command line as a
:class:`~cmbs_async.batch.ray_worker.WorkerPlan`.

Scripts, profiles, SSH keys and known hosts, and the variables given to agents travel
with the plan, in memory. An agent program (``stdio:``) and the files the batch names
(``--agent-readable``, an IT-Bench inventory or kubeconfig) do not: they must be
installed on every node at the same path with the same content, which each worker checks
before the first job.
"""

from __future__ import annotations

import argparse
import os
import shlex
from collections.abc import Callable

from executors import Executor, ExecutorError
from executors.sandbox import find_bwrap
from executors.ssh import SSHExecutor, SSHTarget

from ..agents import Agent, ScriptedAgent
from ..agents.base import AgentMessage
from ..agents.specs import AgentOptions
from ..batch.jobs import BatchError, shown
from ..batch.ray_worker import Scoring, Target, WorkerPlan, file_digest, named_files
from ..itbench import Kind
from ..profile import Profile

__all__ = ["worker_plan"]

#: The variable an ``openai:`` agent's key is read from.
API_KEY = "CMBS_AGENT_API_KEY"


def worker_plan(
    args: argparse.Namespace,
    *,
    executors: dict[Target, Executor],
    factories: dict[str, Callable[[Profile], Agent]],
    options: AgentOptions,
    profiles: dict[str, Profile],
    hidden: tuple[str, ...],
    audit: bool,
) -> WorkerPlan:
    """The plan of this batch's workers; :class:`BatchError` (one line) for a file it
    names that cannot be read here."""
    cwd = os.getcwd()
    agents: dict[str, list[AgentMessage] | None] = {}
    files: list[str] = []
    programs: list[str] = []
    endpoints: list[str] = []
    any_profile = next(iter(profiles.values()))
    for spec, make in factories.items():
        kind, _, rest = spec.partition(":")
        if kind == "script":
            agent = make(any_profile)  # a script's lines do not depend on the profile
            assert isinstance(agent, ScriptedAgent)
            agents[spec] = list(agent.messages)
            continue
        agents[spec] = None
        if kind == "stdio":  # its program found there (an interpreter may differ by node),
            words = shlex.split(rest)  # the files it is given the same there
            if words:
                program = words[0]
                programs.append(os.path.join(cwd, program) if "/" in program else program)
                files += named_files(shlex.join(words[1:]), cwd)
        elif kind == "openai":
            endpoints.append(rest.rpartition("@")[2].rstrip("/") + "/models")
    files += [os.path.abspath(p) for p in args.agent_readable if os.path.isfile(p)]
    scoring = _scoring(args)
    if scoring is not None:
        files += [p for p in (scoring.inventory, scoring.kubeconfig) if p is not None]
    env = {name: os.environ[name] for name in args.agent_env}
    if any(spec.startswith("openai:") for spec in factories) and API_KEY in os.environ:
        env[API_KEY] = os.environ[API_KEY]
    return WorkerPlan(
        agents=agents,
        options=AgentOptions(sandbox=options.sandbox, pass_env=options.pass_env, cwd=cwd),
        profiles=profiles,
        # what contains commands here contains them on every worker: "auto" resolved here
        sandbox="bwrap" if args.sandbox == "auto" and find_bwrap() else args.sandbox,
        hidden=hidden,
        user=args.sandbox_user,
        targets=_carried(executors),
        env=env,
        audit=audit,
        scoring=scoring,
        files=_digests(files),
        programs=tuple(dict.fromkeys(programs)),
        endpoints=tuple(dict.fromkeys(endpoints)),
        cwd=cwd,
    )


def _scoring(args: argparse.Namespace) -> Scoring | None:
    inventory, kubeconfig = args.itbench_inventory, args.itbench_kubeconfig
    if not (inventory or kubeconfig):
        return None
    return Scoring(
        kind=Kind.RHEL9_ANSIBLE_OPA if inventory else Kind.KUBECTL_OPA,
        inventory=os.path.abspath(inventory) if inventory else None,
        kubeconfig=os.path.abspath(kubeconfig) if kubeconfig else None,
        expect=args.itbench_expect,
    )


def _digests(paths: list[str]) -> dict[str, str]:
    digests = {}
    for path in dict.fromkeys(paths):
        found = file_digest(path)
        if found is None:
            raise BatchError(f"cannot read {shown(path)}, which the batch's workers need")
        digests[path] = found
    return digests


def _carried(executors: dict[Target, Executor]) -> dict[Target, tuple[SSHTarget, tuple[str, ...]]]:
    """Each SSH target with its keys in memory, and how its commands are contained."""
    carried: dict[Target, tuple[SSHTarget, tuple[str, ...]]] = {}
    for target, executor in executors.items():
        if isinstance(executor, SSHExecutor):
            try:
                carried[target] = (executor.target.carried(), executor.containments)
            except ExecutorError as exc:
                raise BatchError(f"{target[0]}: {exc}") from None
    return carried
