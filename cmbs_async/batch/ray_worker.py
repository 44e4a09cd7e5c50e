"""What runs on a batch's Ray worker: one actor per worker slot that runs jobs one call
each, contained as on the driver's machine, and hands back each run's result line and its
audit records for the driver to check and sign.

Nothing here signs or decides what counts: the driver does (see :mod:`.ray_backend`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shlex
import shutil
from dataclasses import dataclass, field
from typing import Any

from executors import Executor, ExecutorError, LocalExecutor
from executors.sandbox import SandboxMode
from executors.ssh import SSHExecutor, SSHTarget

from .. import __version__
from ..agents import Agent, ScriptedAgent
from ..agents.base import AgentMessage
from ..agents.specs import AgentOptions, agent_factory
from ..audit.memory import MemoryAuditStore
from ..config import RunConfig
from ..itbench import Kind, evaluate
from ..profile import Profile
from .jobs import Job
from .runner import run_job

__all__ = ["BatchWorker", "Scoring", "WorkerPlan", "file_digest", "named_files"]

#: Where a group of jobs runs: ``local``, or an ``ssh://`` target and its pinned host key.
Target = tuple[str, str | None]


@dataclass(frozen=True)
class Scoring:
    """IT-Bench's pass criterion, applied to each run's workdir where it ran."""

    kind: Kind
    inventory: str | None
    kubeconfig: str | None
    expect: str


@dataclass(frozen=True)
class WorkerPlan:
    """Everything a worker needs to run the batch's jobs, sent once to each worker.

    ``agents``: each agent spec, with a script's lines read on the driver (``None`` for
    ``stdio:`` and ``openai:``, made on the worker from ``options``); ``profiles`` by name;
    ``sandbox``, ``hidden`` and ``user``: the local executor's containment; ``targets``: the
    SSH targets with their keys carried in memory (:meth:`SSHTarget.carried`) and their
    containments; ``env``: the operator's variables the agents are given (a model key);
    ``files``: the files the batch names, by path, with the SHA-256 the driver read, which
    each worker must find the same; ``programs``: the agent programs to find (a name on
    ``PATH``, or a path: an interpreter may differ from node to node, its script not);
    ``endpoints``: the model URLs each worker must reach; ``version``: the driver's
    cmbs-async, which each worker must have.
    """

    agents: dict[str, list[AgentMessage] | None]
    options: AgentOptions
    profiles: dict[str, Profile]
    sandbox: SandboxMode = "auto"
    hidden: tuple[str, ...] = ()
    user: str | None = None
    targets: dict[Target, tuple[SSHTarget, tuple[str, ...]]] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict, repr=False)
    audit: bool = True
    scoring: Scoring | None = None
    files: dict[str, str] = field(default_factory=dict)
    programs: tuple[str, ...] = ()
    endpoints: tuple[str, ...] = ()
    cwd: str | None = None
    version: str = __version__


def file_digest(path: str) -> str | None:
    """The SHA-256 of the file at ``path``, or ``None`` if it cannot be read."""
    try:
        with open(path, "rb") as file:
            return hashlib.file_digest(file, "sha256").hexdigest()
    except OSError:
        return None


def named_files(command: str, cwd: str) -> list[str]:
    """The files a ``stdio:`` command's words name (a script, its data), as absolute paths."""
    try:
        words = shlex.split(command)
    except ValueError:
        return []
    paths = (os.path.abspath(os.path.join(cwd, word)) for word in words)
    return [path for path in paths if os.path.isfile(path)]


def _problems(plan: WorkerPlan) -> list[str]:
    """What this worker lacks of what the plan names; each problem in a few words."""
    problems = []
    if plan.version != __version__:
        problems.append(f"cmbs-async {__version__} is installed, the driver's is {plan.version}")
    for path, digest in plan.files.items():
        found = file_digest(path)
        if found is None:
            problems.append(f"{path} is missing")
        elif found != digest:
            problems.append(f"{path} differs from the driver's")
    for program in plan.programs:
        if shutil.which(program) is None:
            problems.append(f"no program {program}" + ("" if "/" in program else " on PATH"))
    for url in plan.endpoints:
        problems += _unreachable(url)
    if plan.cwd is not None and not os.path.isdir(plan.cwd):
        problems.append(f"no directory {plan.cwd} (the agents' working directory)")
    return problems


def _unreachable(url: str) -> list[str]:
    """``[why]`` if nothing answers HTTP at ``url``, else ``[]`` (any status is an answer)."""
    import httpx

    try:
        httpx.get(url, timeout=10.0)
    except httpx.HTTPError as exc:
        return [f"cannot reach {url}: {type(exc).__name__}: {exc}"]
    return []


class BatchWorker:
    """A Ray actor: :meth:`start` once, :meth:`run` per job (many at once), :meth:`close`."""

    def __init__(self) -> None:
        self._plan: WorkerPlan | None = None
        self._local: LocalExecutor | None = None
        self._remote: dict[Target, Executor] = {}
        self._factories: dict[str, Any] = {}

    async def start(
        self,
        plan: WorkerPlan,
        secrets: tuple[dict[str, str], dict[Target, tuple[SSHTarget, tuple[str, ...]]]] = ({}, {}),
    ) -> tuple[str, list[str]]:
        """Check the plan against this worker and make its executors; this worker's node
        and what it lacks (the batch does not start on a worker that lacks anything).
        ``secrets`` (the plan's ``env`` and ``targets``) may come apart from the plan."""
        import ray

        node = ray.get_runtime_context().get_node_id()
        if secrets != ({}, {}):
            plan = dataclasses.replace(plan, env=secrets[0], targets=secrets[1])
        problems = _problems(plan)
        if problems:
            return node, problems
        os.environ.update(plan.env)  # this actor's process is the batch's own
        try:
            self._local = LocalExecutor(sandbox=plan.sandbox, hidden=plan.hidden, user=plan.user)
        except (ExecutorError, OSError, ValueError) as exc:  # no bubblewrap, no such user
            return node, [f"its local executor: {exc}"]
        sandbox = dataclasses.replace(plan.options.sandbox, workdir_root=self._local.workdir_root)
        options = dataclasses.replace(plan.options, sandbox=sandbox)
        self._factories = {
            spec: _scripted(spec, lines) if lines is not None else agent_factory(spec, options)
            for spec, lines in plan.agents.items()
        }
        self._plan = plan
        return node, []

    async def run(self, planned: Job, session_id: str) -> dict[str, Any]:
        """Run one job; its result line, and its records if the batch is audited."""
        assert self._plan is not None and self._local is not None, "start() first"
        profile = self._plan.profiles[planned.spec.profile]
        store = MemoryAuditStore() if self._plan.audit else None
        config = RunConfig(profile=profile, audit=store, keep_workdir=bool(self._plan.scoring))
        record = await run_job(
            planned,
            agent=self._agent(planned.agent, profile),
            executor=self._executor(planned),
            config=config,
            score=self._score if self._plan.scoring else None,
            session_id=session_id,
        )
        entries = store.entries(session_id) if store is not None else []
        return {"record": record, "audit": [tuple(e) for e in entries]}

    async def close(self) -> None:
        """Close every executor: no workdir, sandbox or connection outlives the batch."""
        for executor in [*self._remote.values(), *([self._local] if self._local else [])]:
            await executor.aclose()
        self._remote.clear()

    def _agent(self, spec: str, profile: Profile) -> Agent:
        agent: Agent = self._factories[spec](profile)
        return agent

    def _executor(self, job: Job) -> Executor:
        assert self._plan is not None and self._local is not None
        if job.where == "local":
            return self._local
        where: Target = (job.where, job.spec.host_key)
        if where not in self._remote:
            target, containments = self._plan.targets[where]
            self._remote[where] = SSHExecutor(target, containments=containments)
        return self._remote[where]

    async def _score(self, workdir: str) -> bool:
        assert self._plan is not None and self._plan.scoring is not None
        assert self._local is not None
        scoring = self._plan.scoring
        scored = await evaluate(
            workdir,
            executor=self._local,
            kind=scoring.kind,
            inventory=scoring.inventory,
            kubeconfig=scoring.kubeconfig,
            expect=scoring.expect,
        )
        return scored.passed


def _scripted(spec: str, lines: list[AgentMessage]) -> Any:
    return lambda profile: ScriptedAgent(lines, label=spec)
