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

from .._text import escape_controls
from ..agents import Agent, ScriptedAgent
from ..audit import default_data_dir
from ..batch import (
    BatchError,
    BatchReport,
    Job,
    Progress,
    ResultLog,
    is_error,
    judged,
    plan,
    render_evaluation,
    render_summary,
    run_batch,
    select,
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
    audit_store,
    canonical_agents,
    containment_options,
    executor_from_spec,
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
    batch.add_argument(
        "--retry-errors",
        action="store_true",
        help="with --resume: also run again what ended in an error outcome (agent_error, "
        "executor_error, audit_error, runner_error)",
    )
    batch.add_argument(
        "-k",
        dest="keyword",
        metavar="PATTERN",
        help="only the scenarios whose id or file name contains PATTERN's words, as "
        "pytest's -k: 'sshd', 'kyverno and not update', 'a or (b and not c)'",
    )
    batch.add_argument(
        "--maxfail",
        type=int,
        metavar="N",
        help="start no new run after N runs ended in an error outcome (those running finish)",
    )
    batch.add_argument(
        "-x", "--exitfirst", action="store_const", const=1, dest="maxfail", help="--maxfail 1"
    )
    batch.add_argument("--executor", default="local", help="local (the only one on Ray)")
    batch.add_argument(
        "--audit-db",
        help=f"record every run in this SQLite audit database "
        f"(default {default_data_dir() / 'audit.db'})",
    )
    batch.add_argument("--no-audit", action="store_true", help="record nothing")
    batch.add_argument(
        "--signing-key",
        help="Ed25519 key file, made 0600 on first use "
        f"(default {default_data_dir() / 'signing_key'})",
    )
    batch.add_argument("--head-out", help="write a signed checkpoint of the audit log at the end")
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
    if args.retry_errors and not args.resume:
        raise BatchError("--retry-errors needs --resume (it runs again what a results file holds)")
    if args.maxfail is not None and args.maxfail < 1:
        raise BatchError("--maxfail must be at least 1")
    if args.backend == "ray":
        for given, option in (
            (args.audit_db, "--audit-db"),
            (args.head_out, "--head-out"),
            (args.signing_key, "--signing-key"),
            (args.maxfail, "--maxfail"),
        ):
            if given is not None:
                raise BatchError(f"{option} is not available with --backend ray")
    if args.itbench_inventory and args.itbench_kubeconfig:
        raise BatchError("score with --itbench-inventory or --itbench-kubeconfig, not both")
    scoring = args.itbench_inventory or args.itbench_kubeconfig
    if scoring and (args.backend == "ray" or args.executor != "local"):
        raise BatchError("IT-Bench scoring reads each run's workdir: the local executor only")
    if scoring and not os.path.isfile(scoring):
        raise BatchError(f"no such file: {scoring}")
    agents = canonical_agents(args.agent)
    skipped: list[str] = []
    jobs = plan(args.scenarios, agents, args.repeat, skipped=skipped)
    if args.keyword is not None:
        jobs = select(jobs, args.keyword)
    for note in skipped:
        print(f"cmbs batch: note: {escape_controls(note)}", file=sys.stderr)
    if args.backend == "ray" and not args.no_audit:
        print("cmbs batch: note: --backend ray records no audit trail", file=sys.stderr)
    tune_gc_for_batches()
    containment = containment_options(args)
    hidden = containment["hidden"]
    executor = executor_from_spec(args.executor, **containment)
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
    log = ResultLog(args.out, resume=args.resume, retry_errors=args.retry_errors)
    keys = {job.key: number for number, job in enumerate(jobs)}  # in the batch's order
    retrying = sorted((r for r in log.retrying if r["key"] in keys), key=lambda r: keys[r["key"]])
    if retrying:
        print(_retrying(retrying), file=sys.stderr)
    stopped: Interrupted | None = None
    try:
        progress = Progress(
            len(jobs),
            already=len([j for j in jobs if j.key in log.done]),
            retried={r["key"] for r in retrying},
        )
        if args.backend == "ray":
            if args.executor != "local":
                raise SpecError("--backend ray runs the local executor on its workers")
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
        expected = {job.key: job.spec.expected for job in jobs}  # as the files say now
        records = [judged(r, expected[r["key"]]) for r in log.records if r["key"] in keys]
    finally:
        log.close()
    of_file = {job.scenario_file: profiles[job.spec.profile] for job in jobs}
    print(render_summary(summarize(records, profiles=of_file)))
    evaluation = render_evaluation(records)
    if evaluation:
        print(f"\n{evaluation}")
    print(
        f"\n{len(records)} of {len(jobs)} runs have results in {args.out}"
        + (f" ({report.skipped} from before)" if report.skipped else "")
        + (f" ({len(retrying)} retried)" if retrying else "")
    )
    if report.stopped_early:
        errors = sum(is_error(r) for r in report.records)
        print(
            f"stopped early: {errors} run{'s' if errors != 1 else ''} ended in an error "
            f"outcome (--maxfail {args.maxfail}); {report.not_started} not started: run the "
            "same command with --resume to finish"
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

    store = audit_store(args)

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
        errors = 0
        for name, profile in profiles.items():
            these = [job for job in jobs if job.spec.profile == name]
            if report.stopped_early:  # --maxfail reached under an earlier profile
                report.not_started += len([job for job in these if job.key not in log.done])
                continue
            makers = {spec: partial(make, profile) for spec, make in factories.items()}
            part = await run_batch(
                these,
                agents=makers.__getitem__,
                executor=executor,
                concurrency=args.concurrency,
                log=log,
                progress=progress,
                audit=store,
                score=itbench_pass if args.itbench_inventory or args.itbench_kubeconfig else None,
                maxfail=None if args.maxfail is None else args.maxfail - errors,
            )
            report.records += part.records
            report.skipped += part.skipped
            report.not_started += part.not_started
            report.stopped_early |= part.stopped_early
            errors += sum(is_error(record) for record in part.records)
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


def _retrying(records: list[dict[str, Any]], shown: int = 10) -> str:
    """The note naming the runs ``--retry-errors`` runs again, escaped, on one line."""
    names = [
        f"{r.get('scenario_id')} {r.get('agent')} #{r.get('repeat')} ({r.get('outcome')})"
        for r in records[:shown]
    ]
    more = f" and {len(records) - shown} more" if len(records) > shown else ""
    return escape_controls(
        f"cmbs batch: retrying {len(records)} run{'s' if len(records) != 1 else ''} that "
        f"ended in an error: {'; '.join(names)}{more}"
    )
