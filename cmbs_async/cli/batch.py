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
from ..agents import Agent
from ..agents.specs import AgentOptions
from ..audit import default_data_dir, load_or_create_key
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
from ..batch.jobs import shown
from ..batch.ray_backend import run_batch_ray
from ..batch.ray_worker import Target
from ..batch.results import stale_note
from ..itbench import Kind, evaluate
from ..profile import Profile, load_profile
from ..result import Outcome
from .audit import write_checkpoint
from .itbench import add_expect_option
from .ray_plan import worker_plan
from .signals import Interrupted, cancel_on_signals, interrupting
from .specs import (
    add_agent_options,
    add_sandbox_option,
    agent_factory,
    agent_options,
    canonical_agents,
)
from .wiring import (
    add_record_options,
    add_ssh_options,
    audit_path,
    audit_store,
    build_executor,
    containment_options,
    named_secrets,
    run_config,
    same_file,
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
    batch.add_argument(
        "--concurrency", type=int, default=8, help="scenarios in flight (on Ray: per worker)"
    )
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
    batch.add_argument(
        "--executor",
        help="local or ssh://USER@HOST[:PORT] for every scenario (default: each scenario's "
        "host, else local)",
    )
    add_ssh_options(batch)
    add_record_options(batch)
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
    batch.add_argument(
        "--workers",
        type=int,
        help="Ray workers, each running up to --concurrency scenarios (default: one per "
        "cluster CPU)",
    )


def run_batch_command(args: argparse.Namespace) -> int:
    if args.concurrency < 1:
        raise BatchError("--concurrency must be at least 1")
    if args.retry_errors and not args.resume:
        raise BatchError("--retry-errors needs --resume (it runs again what a results file holds)")
    if args.maxfail is not None and args.maxfail < 1:
        raise BatchError("--maxfail must be at least 1")
    if args.backend == "ray":
        for given, option in (
            (args.otel_endpoint or (True if args.otel else None), "--otel"),
            (args.workdir_root, "--workdir-root (each Ray worker makes its own)"),
        ):
            if given is not None:
                raise BatchError(f"{option} is not available with --backend ray")
        if args.address is not None and os.environ.get("RAY_AUTH_MODE") != "token":
            raise BatchError(
                "--address needs RAY_AUTH_MODE=token (and the cluster's token): a Ray cluster "
                "that takes calls without one runs any code a scenario's command sends it, "
                "outside every sandbox"
            )
    elif args.workers is not None:
        raise BatchError("--workers is for --backend ray")
    if args.workers is not None and args.workers < 1:
        raise BatchError("--workers must be at least 1")
    if args.itbench_inventory and args.itbench_kubeconfig:
        raise BatchError("score with --itbench-inventory or --itbench-kubeconfig, not both")
    scoring = args.itbench_inventory or args.itbench_kubeconfig
    if scoring and not os.path.isfile(scoring):
        raise BatchError(f"no such file: {shown(scoring)}")
    _out_of_its_own(args)
    agents = canonical_agents(args.agent)
    skipped: list[str] = []
    jobs = plan(args.scenarios, agents, args.repeat, skipped=skipped, executor=args.executor)
    if args.keyword is not None:
        jobs = select(jobs, args.keyword)
    remote = next((job for job in jobs if job.where != "local"), None)
    if remote is not None and scoring:
        why = "IT-Bench scoring reads each run's workdir: the local executor only"
        raise BatchError(escape_controls(f"{remote.scenario_file} runs on {remote.where}: {why}"))
    for note in skipped:
        print(f"cmbs batch: note: {escape_controls(note)}", file=sys.stderr)
    tune_gc_for_batches()
    executors: dict[Target, Executor] = {}
    try:
        for job in jobs:  # one executor per place the jobs run, each made before any runs
            target = _target(job)
            if target not in executors:
                executors[target] = build_executor(
                    args,
                    where=job.where,
                    host_key=target[1],
                    source="--executor" if args.executor else f"{job.scenario_file}: host:",
                )
        return _run_batch(args, executors, jobs, agents, containment_options(args)["hidden"])
    finally:
        for executor in executors.values():  # what this process made (a workdir root) goes
            anyio.run(executor.aclose)


def _out_of_its_own(args: argparse.Namespace) -> None:
    """Refuse an ``--out`` that is (however spelt: a link, another hard link) the audit
    database or one of its journal files, the signing key or ``--head-out``: results
    appended there are lost, or destroy what is there."""
    key = args.signing_key or default_data_dir() / "signing_key"
    others = named_secrets(key, audit_path(args))
    if args.head_out:
        others.append((args.head_out, "--head-out"))
    for other, what in others:
        if same_file(args.out, (other,)):
            raise BatchError(
                f"--out {shown(args.out)} is {what} ({shown(other)}): "
                "the results need a file of their own"
            )


def _target(job: Job) -> Target:
    """Where ``job`` runs: its executor and, over SSH, the host key its scenario pins."""
    return (job.where, job.spec.host_key if job.where != "local" else None)


def _run_batch(
    args: argparse.Namespace,
    executors: dict[Target, Executor],
    jobs: list[Job],
    agents: list[str],
    hidden: tuple[str, ...],
) -> int:
    local = executors.get(("local", None))
    root = local.workdir_root if isinstance(local, LocalExecutor) else None
    for job in jobs:  # a workdir elsewhere is refused before anything runs
        if (
            job.spec.workdir is not None
            and isinstance(local, LocalExecutor)
            and job.where == "local"
        ):
            try:
                local.check_workdir(job.spec.workdir)
            except ExecutorError as exc:
                raise BatchError(f"{job.scenario_file}: {exc}") from None
    options = agent_options(args, hidden=hidden, workdir_root=root)
    factories = {spec: agent_factory(spec, options) for spec in agents}
    profiles = {name: load_profile(name) for name in dict.fromkeys(j.spec.profile for j in jobs)}
    key = load_or_create_key(args.signing_key or default_data_dir() / "signing_key")
    log = ResultLog(
        args.out,
        resume=args.resume,
        retry_errors=args.retry_errors,
        key=key,
        audit_db=audit_path(args),
    )  # the file locked from now on: a second batch on it is refused
    stopped: Interrupted | None = None
    try:
        for note in (log.refused_note(jobs), stale_note(log.previous, jobs)):
            if note is not None:
                print(f"cmbs batch: note: {escape_controls(note)}", file=sys.stderr)
        keys = {job.key: number for number, job in enumerate(jobs)}  # in the batch's order
        retrying = sorted(
            (r for r in log.retrying if r["key"] in keys), key=lambda r: keys[r["key"]]
        )
        if retrying:
            print(_retrying(retrying), file=sys.stderr)
        progress = Progress(
            len(jobs),
            already=len([j for j in jobs if j.key in log.done]),
            retried={r["key"] for r in retrying},
        )
        if args.backend == "ray":
            caught: list[int] = []
            with interrupting(caught):
                report = _on_ray(
                    args, executors, jobs, factories, options, profiles, hidden, log, progress
                )
            stopped = Interrupted(caught[0]) if caught else None
        else:
            try:
                report = anyio.run(
                    _local,
                    args,
                    executors,
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
    for note in _unwritten(log):
        print(f"cmbs batch: note: {note}", file=sys.stderr)
    of_file = {job.scenario_file: profiles[job.spec.profile] for job in jobs}
    print(render_summary(summarize(records, profiles=of_file)))
    evaluation = render_evaluation(records)
    if evaluation:
        print(f"\n{evaluation}")
    print(
        f"\n{len(records)} of {len(jobs)} runs have results in {shown(args.out)}"
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
    if report.lost_workers:
        print(
            f"{report.lost_workers} Ray worker{'s were' if report.lost_workers != 1 else ' was'} "
            f"lost: the {report.rerun} run{'s' if report.rerun != 1 else ''} in flight there "
            "ran again",
            file=sys.stderr,
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
    executors: dict[Target, Executor],
    jobs: list[Job],
    factories: dict[str, Callable[[Profile], Agent]],
    profiles: dict[str, Profile],
    log: ResultLog,
    progress: Progress,
) -> BatchReport:

    store = audit_store(args)
    config = run_config(args, store=store)

    first = next(iter(executors.values()))  # scoring: the only one, the local executor

    async def itbench_pass(workdir: str) -> bool:
        scored = await evaluate(
            workdir,
            executor=first,
            kind=Kind.RHEL9_ANSIBLE_OPA if args.itbench_inventory else Kind.KUBECTL_OPA,
            inventory=args.itbench_inventory,
            kubeconfig=args.itbench_kubeconfig,
            expect=args.itbench_expect,
        )
        return scored.passed

    async def by_profile() -> BatchReport:
        """The jobs of each profile in turn, each agent made for its scenario's profile,
        each job's commands run where its scenario says (``host:``)."""
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
                executor=first,
                executors=lambda job: executors[_target(job)],
                concurrency=args.concurrency,
                log=log,
                progress=progress,
                config=config,
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
        for executor in executors.values():  # in this event loop: an SSH link's own
            await executor.aclose()


def _on_ray(
    args: argparse.Namespace,
    executors: dict[Target, Executor],
    jobs: list[Job],
    factories: dict[str, Callable[[Profile], Agent]],
    options: AgentOptions,
    profiles: dict[str, Profile],
    hidden: tuple[str, ...],
    log: ResultLog,
    progress: Progress,
) -> BatchReport:
    """The batch on Ray: its runs recorded into this machine's audit database, by this
    process alone (see :mod:`cmbs_async.batch.ray_backend`)."""
    store = audit_store(args)
    try:
        plan = worker_plan(
            args,
            executors=executors,
            factories=factories,
            options=options,
            profiles=profiles,
            hidden=hidden,
            audit=store is not None,
        )
        report = run_batch_ray(
            jobs,
            plan=plan,
            concurrency=args.concurrency,
            address=args.address,
            workers=args.workers,
            log=log,
            progress=progress,
            store=store,
            maxfail=args.maxfail,
        )
        if store is not None and args.head_out:
            write_checkpoint(store, args.head_out)
        return report
    finally:
        if store is not None:
            store.close()


def _unwritten(log: ResultLog) -> list[str]:
    """One line each for the results written as ``runner_error`` lines in their stead and
    the results not written at all, with the first reason; none if every one was."""
    notes = []
    if log.replaced:
        count = len(log.replaced)
        notes.append(
            f"{count} result{'s' if count != 1 else ''} could not be written as "
            f"{'it was' if count == 1 else 'they were'}: a runner_error line stands for "
            f"{'it' if count == 1 else 'each'} ({log.replaced[0]})"
        )
    if log.lost:
        count = len(log.lost)
        notes.append(
            f"{count} result{'s' if count != 1 else ''} could not be written at all "
            f"({log.lost[0]}): run the same command with --resume to run "
            f"{'it' if count == 1 else 'them'} again"
        )
    return [escape_controls(note) for note in notes]


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
