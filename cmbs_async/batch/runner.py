"""The local batch runner: every job of a batch, at most ``concurrency`` at a time, in one
event loop. A run that fails, hangs or crashes its agent never stops the others."""

from __future__ import annotations

import gc
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio

from executors import Executor

from ..agents import Agent
from ..config import RunConfig
from ..runtime import run_scenario
from .jobs import Job
from .progress import Progress
from .results import ResultLog, error_record, is_error, result_record

__all__ = ["BatchReport", "run_batch", "run_job", "tune_gc_for_batches"]


def tune_gc_for_batches() -> None:
    """Collect garbage less often: with thousands of scenarios alive, every full collection
    walks all of them, and the default thresholds run one every few hundred steps.

    A process-wide setting, so the library never applies it by itself; ``cmbs batch`` does.
    """
    gc.freeze()
    gc.set_threshold(50_000, 50, 100)


@dataclass
class BatchReport:
    """What a batch did: ``records`` of the runs it ran, ``skipped`` the jobs with a result
    from before, ``not_started`` the jobs left when ``--maxfail`` stopped it
    (``stopped_early``); on Ray, ``lost_workers`` the workers lost on the way and
    ``rerun`` the runs they had in flight, run again."""

    records: list[dict[str, Any]] = field(default_factory=list)
    skipped: int = 0
    interrupted: bool = False
    stopped_early: bool = False
    not_started: int = 0
    lost_workers: int = 0
    rerun: int = 0


async def run_batch(
    jobs: Sequence[Job],
    *,
    agents: Callable[[str], Callable[[], Agent]],
    executor: Executor,
    concurrency: int,
    log: ResultLog | None = None,
    progress: Progress | None = None,
    config: RunConfig | None = None,
    score: Callable[[str], Awaitable[bool]] | None = None,
    maxfail: int | None = None,
    executors: Callable[[Job], Executor] | None = None,
) -> BatchReport:
    """Run the jobs ``log`` has no result for yet; each result is written as it finishes.

    ``agents(spec)`` gives a factory of fresh agents for an agent spec; ``config`` says how
    every run is supervised (:class:`~cmbs_async.RunConfig`). ``executors(job)``, if
    given, is each job's executor (its scenario's ``host``, say), else ``executor``.
    ``score(workdir)``, if given, judges what each run left in its workdir (IT-Bench's
    pass criterion, say) before the workdir is removed; the record keeps it as
    ``itbench_pass``. After ``maxfail`` runs ended in an error outcome, no new run starts
    (those in flight finish) and the report says ``stopped_early``. A result ``log``
    cannot write as it is never stops the batch: :meth:`ResultLog.keep` writes a
    ``runner_error`` line in its stead (the report holds that one) and notes why.
    """
    report = BatchReport()
    errors = 0
    todo = [job for job in jobs if log is None or job.key not in log.done]
    report.skipped = len(jobs) - len(todo)
    limiter = anyio.CapacityLimiter(max(concurrency, 1))
    factories = {spec: agents(spec) for spec in {job.agent for job in todo}}
    config = config or RunConfig()
    if score is not None:  # the score reads each workdir before it goes
        config = config.replace(keep_workdir=True)

    async def one(job: Job) -> None:
        nonlocal errors
        async with limiter:
            if report.stopped_early:
                report.not_started += 1
                return
            if progress:
                progress.start()
            where = executor if executors is None else executors(job)
            record = await run_job(
                job, agent=factories[job.agent](), executor=where, config=config, score=score
            )
            if log is not None:  # never raises: a result not written as it is is said
                record = log.keep(record) or record
            report.records.append(record)
            if progress:
                progress.finish(record)
            if is_error(record):
                errors += 1
                report.stopped_early |= maxfail is not None and errors >= maxfail

    async with anyio.create_task_group() as tg:
        for job in todo:
            tg.start_soon(one, job)
    return report


async def run_job(
    job: Job,
    *,
    agent: Agent,
    executor: Executor,
    config: RunConfig,
    score: Callable[[str], Awaitable[bool]] | None = None,
    session_id: str | None = None,
) -> dict[str, Any]:
    """Run ``job`` and give its result line (an ``error_record`` if the runner itself
    failed); with ``score``, ``config`` must keep the workdir (see :func:`run_batch`)."""
    started = time.time()
    try:
        result = await run_scenario(
            job.spec, agent=agent, executor=executor, config=config, session_id=session_id
        )
        record = result_record(job, result, started, time.time())
        if score is not None and result.workdir is not None:
            record["itbench_pass"] = await _scored(score, executor, job, result.workdir)
    except Exception as exc:  # a bug or a broken job: record it, go on
        record = error_record(job, f"{type(exc).__name__}: {exc}", started, time.time())
    return record


async def _scored(
    score: Callable[[str], Awaitable[bool]], executor: Executor, job: Job, workdir: str
) -> bool:
    """The score of a run's workdir, which is then removed unless the scenario named it."""
    try:
        return await score(workdir)
    finally:
        if job.spec.workdir is None:
            with anyio.CancelScope(shield=True):
                await executor.cleanup(workdir)
