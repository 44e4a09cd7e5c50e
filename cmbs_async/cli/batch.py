"""``cmbs batch``: many scenarios times agents times repeats, resumable, locally or on Ray."""

from __future__ import annotations

import argparse
import signal
import sys
from typing import Any

import anyio

from ..agents import ScriptedAgent
from ..audit import SQLiteAuditStore, default_data_dir, load_or_create_key
from ..batch import (
    BatchError,
    BatchReport,
    Progress,
    ResultLog,
    plan,
    render_summary,
    run_batch,
    summarize,
    tune_gc_for_batches,
)
from .specs import SpecError, agent_factory, executor_from_spec

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
    batch.add_argument("--address", help="Ray cluster address (default: start a local one)")
    batch.add_argument("--shards", type=int, help="Ray shards (default: 2 per cluster CPU)")


def run_batch_command(args: argparse.Namespace) -> int:
    if args.concurrency < 1:
        raise BatchError("--concurrency must be at least 1")
    jobs = plan(args.scenarios, args.agent, args.repeat)
    tune_gc_for_batches()
    factories = {spec: agent_factory(spec) for spec in args.agent}
    log = ResultLog(args.out, resume=args.resume)
    try:
        progress = Progress(len(jobs), already=len([j for j in jobs if j.key in log.done]))
        if args.backend == "ray":
            if args.executor != "local":
                raise SpecError("--backend ray runs the local executor on its workers")
            if args.audit_db:
                raise SpecError("--audit-db is not available with --backend ray")
            from ..batch.ray_backend import run_batch_ray

            lines = {}
            for spec, make in factories.items():
                agent = make()
                if not isinstance(agent, ScriptedAgent):
                    raise SpecError(f"--agent {spec}: only script: agents run on Ray")
                lines[spec] = [str(message) for message in agent.messages]
            report = run_batch_ray(
                jobs,
                agent_lines=lines,
                concurrency=args.concurrency,
                address=args.address,
                shards=args.shards,
                log=log,
                progress=progress,
            )
        else:
            report = anyio.run(_local, args, jobs, factories, log, progress, backend=args.backend)
        progress.close()
        keys = {job.key for job in jobs}
        records = [r for r in log.records if r["key"] in keys]
    finally:
        log.close()
    print(render_summary(summarize(records)))
    print(
        f"\n{len(records)} of {len(jobs)} runs have results in {args.out}"
        + (f" ({report.skipped} from before)" if report.skipped else "")
    )
    if report.interrupted:
        print("interrupted: run the same command with --resume to finish", file=sys.stderr)
        return EXIT_INTERRUPTED
    earned = all(r.get("outcome") == "terminated" for r in records) and len(records) == len(jobs)
    return EXIT_ALL_EARNED if earned else EXIT_NOT_ALL_EARNED


async def _local(
    args: argparse.Namespace, jobs: Any, factories: Any, log: ResultLog, progress: Progress
) -> BatchReport:
    executor = executor_from_spec(args.executor)
    store = None
    if args.audit_db:
        store = SQLiteAuditStore(
            args.audit_db, key=load_or_create_key(default_data_dir() / "signing_key")
        )
    interrupted = False
    report = BatchReport()
    try:
        async with anyio.create_task_group() as tg:

            async def on_signal() -> None:
                nonlocal interrupted
                with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                    async for _ in signals:
                        interrupted = True
                        tg.cancel_scope.cancel()
                        return

            async def work() -> None:
                nonlocal report
                report = await run_batch(
                    jobs,
                    agents=lambda spec: factories[spec],
                    executor=executor,
                    concurrency=args.concurrency,
                    log=log,
                    progress=progress,
                    audit=store,
                )
                tg.cancel_scope.cancel()

            tg.start_soon(on_signal)
            tg.start_soon(work)
    finally:
        if store is not None:
            store.close()
        if hasattr(executor, "aclose"):
            await executor.aclose()
    report.interrupted = interrupted
    return report
