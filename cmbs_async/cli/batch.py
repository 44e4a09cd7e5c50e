"""``cmbs batch``: many scenarios times agents times repeats, resumable, locally or on Ray."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from functools import partial
from typing import Any

import anyio

from executors import Executor, ExecutorError, LocalExecutor

from ..agents import Agent, ScriptedAgent
from ..audit import SQLiteAuditStore, default_data_dir, load_or_create_key
from ..batch import (
    BatchError,
    BatchReport,
    Job,
    Progress,
    ResultLog,
    plan,
    render_summary,
    run_batch,
    summarize,
    tune_gc_for_batches,
)
from ..batch.ray_backend import run_batch_ray
from ..itbench import Kind, evaluate
from ..profile import Profile, load_profile
from ..result import Outcome
from .audit import write_checkpoint
from .itbench import add_expect_option
from .signals import Interrupted, cancel_on_signals
from .specs import (
    SpecError,
    add_agent_options,
    add_sandbox_option,
    agent_factory,
    agent_options,
    canonical_agents,
    executor_from_spec,
    secrets_of,
)

__all__ = ["add_batch_command", "run_batch_command"]

EXIT_ALL_EARNED = 0
EXIT_NOT_ALL_EARNED = 3
EXIT_INTERRUPTED = 130


def add_batch_command(sub: Any, common: argparse.ArgumentParser) -> None:
    """``common`` carries ``--backend asyncio|trio|ray``: one event loop here, or Ray."""
    batch = sub.add_parser(
        "batch",
        parents=[common],
        help="run many scenarios with one or more agents, resumably",
    )
    batch.add_argument("scenarios", nargs="+", help="scenario files, directories or globs")
    batch.add_argument(
        "--agent",
        action="append",
        required=True,
        help="repeatable: script:F | stdio:CMD | openai:M@URL",
    )
    batch.add_argument("--repeat", type=int, default=1, help="runs per scenario and agent")
    batch.add_argument("--concurrency", type=int, default=8, help="scenarios in flight")
    batch.add_argument("--out", default="cmbs-batch.jsonl", help="results, one JSON line a run")
    batch.add_argument("--resume", action="store_true", help="run only what has no result yet")
    batch.add_argument("--executor", default="local", help="local (the only one on Ray)")
    batch.add_argument("--audit-db", help="also record every run in this audit database")
    batch.add_argument(
        "--head-out", help="with --audit-db: write a signed checkpoint of its log at the end"
    )
    add_sandbox_option(batch)
    add_agent_options(batch)
    batch.add_argument(
        "--itbench-inventory",
        help="score each run as IT-Bench does (RHEL9): its playbook re-run with this "
        "inventory, its policy evaluated; the summary shows pass@1",
    )
    batch.add_argument(
        "--itbench-kubeconfig", help="the same for kubectl + OPA runs, with this kubeconfig"
    )
    add_expect_option(batch, "--itbench-expect")
    batch.add_argument("--address", help="Ray cluster address (default: start a local one)")
    batch.add_argument("--shards", type=int, help="Ray shards (default: 2 per cluster CPU)")


def run_batch_command(args: argparse.Namespace) -> int:
    if args.concurrency < 1:
        raise BatchError("--concurrency must be at least 1")
    if args.head_out and not args.audit_db:
        raise BatchError("--head-out needs --audit-db")
    if args.itbench_inventory and args.itbench_kubeconfig:
        raise BatchError("score with --itbench-inventory or --itbench-kubeconfig, not both")
    scoring = args.itbench_inventory or args.itbench_kubeconfig
    if scoring and (args.backend == "ray" or args.executor != "local"):
        raise BatchError("IT-Bench scoring reads each run's workdir: the local executor only")
    if scoring and not os.path.isfile(scoring):
        raise BatchError(f"no such file: {scoring}")
    agents = canonical_agents(args.agent)
    jobs = plan(args.scenarios, agents, args.repeat)
    tune_gc_for_batches()
    key_path = default_data_dir() / "signing_key"
    hidden = secrets_of(key_path, args.audit_db)
    executor = executor_from_spec(
        args.executor,
        sandbox=args.sandbox,
        hidden=hidden,
        workdir_root=args.workdir_root,
        user=args.sandbox_user,
        command="batch",
    )
    try:
        return _run_batch(args, executor, jobs, agents, hidden)
    finally:
        anyio.run(executor.aclose)  # what this process made (its workdir root) goes


def _run_batch(
    args: argparse.Namespace,
    executor: Executor,
    jobs: list[Job],
    agents: list[str],
    hidden: tuple[str, ...],
) -> int:
    root = executor.workdir_root if isinstance(executor, LocalExecutor) else None
    for job in jobs:  # a workdir elsewhere is refused before anything runs
        if job.spec.workdir is not None and isinstance(executor, LocalExecutor):
            try:
                executor.check_workdir(job.spec.workdir)
            except ExecutorError as exc:
                raise BatchError(f"{job.scenario_file}: {exc}") from None
    options = agent_options(args, hidden=hidden, workdir_root=root)
    factories = {spec: agent_factory(spec, options) for spec in agents}
    profiles = {name: load_profile(name) for name in dict.fromkeys(j.spec.profile for j in jobs)}
    log = ResultLog(args.out, resume=args.resume)
    stopped: Interrupted | None = None
    try:
        progress = Progress(len(jobs), already=len([j for j in jobs if j.key in log.done]))
        if args.backend == "ray":
            if args.executor != "local":
                raise SpecError("--backend ray runs the local executor on its workers")
            if args.audit_db:
                raise SpecError("--audit-db is not available with --backend ray")
            lines = {}
            for spec, make in factories.items():
                agent = make(profiles[jobs[0].spec.profile])  # a script ignores its profile
                if not isinstance(agent, ScriptedAgent):
                    raise SpecError(f"--agent {spec}: only script: agents run on Ray")
                lines[spec] = [str(message) for message in agent.messages]
            report = run_batch_ray(
                jobs,
                agent_lines=lines,
                concurrency=args.concurrency,
                address=args.address,
                shards=args.shards,
                sandbox=args.sandbox,
                log=log,
                progress=progress,
            )
        else:
            try:
                report = anyio.run(
                    _local,
                    args,
                    executor,
                    jobs,
                    factories,
                    profiles,
                    log,
                    progress,
                    backend=args.backend,
                )
            except Interrupted as exc:
                report, stopped = BatchReport(interrupted=True), exc
        progress.close()
        keys = {job.key for job in jobs}
        records = [r for r in log.records if r["key"] in keys]
    finally:
        log.close()
    of_file = {job.scenario_file: profiles[job.spec.profile] for job in jobs}
    print(render_summary(summarize(records, profiles=of_file)))
    print(
        f"\n{len(records)} of {len(jobs)} runs have results in {args.out}"
        + (f" ({report.skipped} from before)" if report.skipped else "")
    )
    if report.interrupted:
        print("interrupted: run the same command with --resume to finish", file=sys.stderr)
        return stopped.exit_status if stopped is not None else EXIT_INTERRUPTED
    earned = len(records) == len(jobs) and all(
        r.get("outcome") == Outcome.TERMINATED for r in records
    )
    return EXIT_ALL_EARNED if earned else EXIT_NOT_ALL_EARNED


async def _local(
    args: argparse.Namespace,
    executor: Executor,
    jobs: list[Job],
    factories: dict[str, Callable[[Profile], Agent]],
    profiles: dict[str, Profile],
    log: ResultLog,
    progress: Progress,
) -> BatchReport:
    key_path = default_data_dir() / "signing_key"
    store = None
    if args.audit_db:
        store = SQLiteAuditStore(args.audit_db, key=load_or_create_key(key_path))

    async def itbench_pass(workdir: str) -> bool:
        scored = await evaluate(
            workdir,
            executor=executor,
            kind=Kind.RHEL9_ANSIBLE_OPA if args.itbench_inventory else Kind.KUBECTL_OPA,
            inventory=args.itbench_inventory,
            kubeconfig=args.itbench_kubeconfig,
            expect=args.itbench_expect,
        )
        return scored.passed

    async def by_profile() -> BatchReport:
        """The jobs of each profile in turn, each agent made for its scenario's profile."""
        report = BatchReport()
        for name, profile in profiles.items():
            makers = {spec: partial(make, profile) for spec, make in factories.items()}
            part = await run_batch(
                [job for job in jobs if job.spec.profile == name],
                agents=makers.__getitem__,
                executor=executor,
                concurrency=args.concurrency,
                log=log,
                progress=progress,
                audit=store,
                score=itbench_pass if args.itbench_inventory or args.itbench_kubeconfig else None,
            )
            report.records += part.records
            report.skipped += part.skipped
        return report

    try:
        report = await cancel_on_signals(by_profile)
        if store is not None and args.head_out:
            write_checkpoint(store, args.head_out)
        return report
    finally:
        if store is not None:
            store.close()
        await executor.aclose()
