"""Beyond one machine: a batch's jobs run on Ray workers, each result and its audit records
coming back run by run to the driver, which alone signs.

Each worker is a Ray actor (:class:`~.ray_worker.BatchWorker`, one per cluster CPU by
default, spread over the nodes) running up to ``concurrency`` scenarios at once in its own
event loop, contained as a local batch's are. Before the first job, every worker checks
what the batch names (agent programs and files, model endpoints, its sandbox); a worker
that lacks any of it stops the batch in one line. A worker that is lost (its node removed,
its process killed) costs only the runs it had in flight: they run again elsewhere.

The trust model: the driver is the one log. A worker returns a run's result line and its
records; the driver re-judges the records with the gate (:func:`~cmbs_async.replay`) and
checks that the result line says what they say, then appends them to the one audit
database in one transaction, signed with the operator's key, which never leaves the
driver. A compromised worker can therefore make up what its commands printed, but not a
verdict the gate would not give for it, a result its records do not bear out, a record of
another worker's run, or a change to anything already in the log.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import time
import uuid
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from .._text import escape_controls
from ..audit import AuditError, Entry, RecordKind, SQLiteAuditStore
from ..audit.memory import MemoryAuditStore
from ..profile import Profile
from ..replayer import replay
from .jobs import BatchError, Job
from .progress import Progress
from .ray_worker import BatchWorker, WorkerPlan
from .results import ResultLog, error_record, is_error, judged
from .runner import BatchReport

__all__ = ["run_batch_ray"]

INSTALL_HINT = "the ray backend needs Ray: pip install 'cmbs-async[ray]'"

#: A job whose worker was lost this many times while it ran alone there is not run again
#: (it is what kills them).
MAX_LOSSES = 3
#: How long after a run's deadline its worker may take to answer (its end recorded, its
#: workdir cleaned up), and more with IT-Bench scoring, before the worker is given up.
GRACE_S = 60.0
SCORING_S = 600.0


@dataclass
class _Worker:
    actor: Any
    node: str
    running: int = 0
    alone: bool = False  # running a job whose worker was lost before, and only it


def run_batch_ray(
    jobs: Sequence[Job],
    *,
    plan: WorkerPlan,
    concurrency: int,
    address: str | None = None,
    workers: int | None = None,
    log: ResultLog | None = None,
    progress: Progress | None = None,
    store: SQLiteAuditStore | None = None,
    maxfail: int | None = None,
    start_timeout: float = 120.0,
    worker: type[BatchWorker] = BatchWorker,
    grace: float | None = None,
) -> BatchReport:
    """Run the jobs ``log`` has no result for on a Ray cluster (a local one by default),
    each result written as it comes back; with ``store``, each run's records appended to
    it as the run's result is (:mod:`the trust model <.ray_backend>`).

    ``workers`` actors (default: one per cluster CPU) each run up to ``concurrency`` jobs
    at once. :class:`BatchError` if Ray cannot start or be reached, or a worker lacks what
    ``plan`` names, before any job runs. After ``maxfail`` error outcomes no new job
    starts (``stopped_early``). A worker that has not answered ``grace`` seconds after
    a run's deadline is given up (default :data:`GRACE_S`, more with IT-Bench scoring).
    ``worker`` is the actor class (tests give a faulty one).
    """
    report = BatchReport()
    todo = [job for job in jobs if log is None or job.key not in log.done]
    report.skipped = len(jobs) - len(todo)
    if not todo:
        return report
    if address is None:  # a throwaway local cluster, whose ports every sandbox can reach:
        os.environ["RAY_AUTH_MODE"] = "token"  # none may use them without Ray's token
    try:
        import ray  # after the above: Ray reads its authentication mode as it is imported
    except ImportError:
        raise BatchError(INSTALL_HINT) from None
    started_here = not ray.is_initialized()
    if started_here:
        handlers = _handlers()
        try:
            ray.init(
                address=address or "local",  # a new one: never one another process started
                include_dashboard=False,
                logging_level=logging.WARNING,
                log_to_driver=False,
            )
        except Exception as exc:  # noqa: BLE001 - Ray raises many kinds; say it in one line
            where = escape_controls(address or "local")
            raise BatchError(f"cannot start or reach Ray ({where}): {_first_line(exc)}") from None
        _restore(handlers)  # Ray's own would end this process mid-write
    pool = _Pool(ray, plan, start_timeout, worker)
    try:
        cpus = int(ray.cluster_resources().get("CPU", 1))  # type: ignore[no-untyped-call,unused-ignore]
        count = max(1, min(len(todo), workers or cpus))
        pool.grow(count)
        if grace is None:
            grace = GRACE_S + (SCORING_S if plan.scoring is not None else 0.0)
        _Dispatch(ray, pool, concurrency, log, progress, store, maxfail, report, grace).run(todo)
    except KeyboardInterrupt:
        report.interrupted = True
    finally:
        pool.close()
        if started_here:
            ray.shutdown()
    return report


class _Pool:
    """The batch's worker actors: started together, each checked before any job runs."""

    def __init__(
        self, ray: Any, plan: WorkerPlan, start_timeout: float, worker: type[BatchWorker]
    ) -> None:
        self._ray = ray
        self.plan = plan
        self._timeout = start_timeout
        self._class = ray.remote(worker).options(
            num_cpus=1, max_restarts=0, max_task_retries=0, scheduling_strategy="SPREAD"
        )
        self.live: list[_Worker] = []
        self.made = 0

    def grow(self, count: int) -> None:
        """Start ``count`` workers; :class:`BatchError` if one lacks what the plan names or
        they do not start in time."""
        actors = [self._class.remote() for _ in range(count)]
        self.made += count
        # the secrets in an argument of their own: small, it travels inside the call
        plan = dataclasses.replace(self.plan, env={}, targets={})
        secrets = (self.plan.env, self.plan.targets)
        started = [actor.start.remote(plan, secrets) for actor in actors]
        try:
            answers = self._ray.get(started, timeout=self._timeout)
        except self._ray.exceptions.GetTimeoutError:
            raise BatchError(
                f"Ray workers did not start within {self._timeout:g} s "
                "(does the cluster have a free CPU for each? --workers sets how many)"
            ) from None
        except self._ray.exceptions.RayError as exc:
            raise BatchError(f"a Ray worker could not start: {_first_line(exc)}") from None
        for actor, (node, problems) in zip(actors, answers, strict=True):
            if problems:
                raise BatchError(f"Ray node {node[:12]}: {'; '.join(problems)}")
            self.live.append(_Worker(actor, node))

    def lose(self, worker: _Worker) -> bool:
        """Stop using ``worker``; whether it was in use until now."""
        if worker not in self.live:
            return False
        self.live.remove(worker)
        self._ray.kill(worker.actor)
        return True

    def close(self) -> None:
        """Close every live worker's executors, then end the workers."""
        closing = [w.actor.close.remote() for w in self.live]
        try:
            self._ray.get(closing, timeout=60)
        except self._ray.exceptions.RayError:
            pass  # a worker that is gone has nothing left to close: its sandboxes died with it
        for worker in self.live:
            self._ray.kill(worker.actor)
        self.live.clear()


class _Dispatch:
    """Keeps every worker busy, takes each result as it comes, runs a lost worker's jobs
    again elsewhere."""

    def __init__(
        self,
        ray: Any,
        pool: _Pool,
        concurrency: int,
        log: ResultLog | None,
        progress: Progress | None,
        store: SQLiteAuditStore | None,
        maxfail: int | None,
        report: BatchReport,
        grace: float,
    ) -> None:
        self._ray = ray
        self._pool = pool
        self._concurrency = max(concurrency, 1)
        self._log = log
        self._progress = progress
        self._store = store
        self._maxfail = maxfail
        self._report = report
        self._profiles = pool.plan.profiles
        self._flight: dict[Any, tuple[Job, str, _Worker, float]] = {}
        self._losses: dict[str, int] = {}  # how often a job's worker died with it alone
        self._suspects: set[str] = set()  # jobs whose worker died while they ran
        self._errors = 0
        self._grace = grace

    def run(self, todo: list[Job]) -> None:
        queue = deque(todo)
        while queue or self._flight:
            if not self._report.stopped_early:
                self._fill(queue)
            else:
                self._report.not_started += len(queue)
                queue.clear()
            if not self._flight:
                if queue and not self._pool.live:  # every worker lost: start new ones
                    self._pool.grow(max(1, self._pool.made // 2))
                continue
            done, _ = self._ray.wait(list(self._flight), num_returns=1, timeout=1.0)
            for ref in done:
                self._take(ref, queue)
            self._overdue()

    def _overdue(self) -> None:
        """A run whose worker has not answered ``GRACE_S`` after the run's deadline ends in
        a ``runner_error`` and its worker is given up (its other runs run again): no
        worker stretches a deadline."""
        now = time.time()
        for ref, (job, _, worker, started) in list(self._flight.items()):
            if now - started <= job.spec.deadline_s + self._grace:
                continue
            del self._flight[ref]
            worker.running -= 1
            worker.alone = False
            why = f"its Ray worker gave no answer {self._grace:g} s after the run's deadline"
            self._keep(error_record(job, why, started, now))
            self._report.lost_workers += self._pool.lose(worker)

    def _fill(self, queue: deque[Job]) -> None:
        """Give each worker with room one job in turn, until none has room or none is left.
        A job whose worker was lost while others ran beside it runs alone next: if it is
        what kills workers, it alone is charged for it."""
        while queue:
            free = [w for w in self._pool.live if not w.alone and w.running < self._concurrency]
            given = 0
            for worker in free:
                job = next(
                    (j for j in queue if worker.running == 0 or j.key not in self._suspects), None
                )
                if job is None:
                    continue
                queue.remove(job)
                worker.alone = job.key in self._suspects
                self._submit(job, worker)
                given += 1
            if not given:
                return

    def _submit(self, job: Job, worker: _Worker) -> None:
        session_id = uuid.uuid4().hex  # the driver names each run: no worker can reuse
        ref = worker.actor.run.remote(job, session_id)  # another run's session
        self._flight[ref] = (job, session_id, worker, time.time())
        worker.running += 1
        if self._progress is not None:
            self._progress.start()

    def _take(self, ref: Any, queue: deque[Job]) -> None:
        job, session_id, worker, started = self._flight.pop(ref)
        worker.running -= 1
        alone, worker.alone = worker.alone, False
        try:
            answer = self._ray.get(ref)
        except self._ray.exceptions.RayActorError:
            self._report.lost_workers += self._pool.lose(worker)
            losses = self._losses[job.key] = self._losses.get(job.key, 0) + alone
            self._suspects.add(job.key)
            if self._progress is not None:
                self._progress.running -= 1
            if losses < MAX_LOSSES:
                self._report.rerun += 1
                queue.appendleft(job)
                return
            record = error_record(
                job,
                f"its Ray worker died {losses} times as it ran there alone",
                started,
                time.time(),
            )
        except self._ray.exceptions.RayError as exc:
            record = error_record(job, f"Ray: {_first_line(exc)}", started, time.time())
        else:
            try:
                record = self._accepted(job, session_id, worker, answer, started)
            except Exception as exc:  # an answer of a shape no check foresaw: this run's
                why = f"Ray node {worker.node[:12]} gave an answer that cannot be read: {exc!r}"
                record = error_record(job, why[:500], started, time.time())
        self._keep(record)

    def _keep(self, record: dict[str, Any]) -> None:
        """Write ``record``, count it, show it."""
        if self._log is not None:  # never raises: a result not written as it is is said
            record = self._log.keep(record) or record
        self._report.records.append(record)
        if self._progress is not None:
            self._progress.finish(record)
        if is_error(record):
            self._errors += 1
            self._report.stopped_early |= (
                self._maxfail is not None and self._errors >= self._maxfail
            )

    def _accepted(
        self, job: Job, session_id: str, worker: _Worker, answer: Any, started: float
    ) -> dict[str, Any]:
        """The worker's result line as the driver keeps it: the job's own fields from the
        driver, the run's from the worker, and only if its records bear it out (they are
        then in the one log)."""
        record = answer.get("record") if isinstance(answer, dict) else None
        if not isinstance(record, dict):
            return error_record(
                job, f"Ray node {worker.node[:12]} gave no result", started, time.time()
            )
        record = judged(record | _own(job) | {"node": worker.node}, job.spec.expected)
        if self._store is None:
            return record
        if record.get("session_id") is None and record.get("outcome") == "runner_error":
            return record  # the run never began: nothing was recorded
        try:
            if record.get("session_id") != session_id:
                raise ValueError(f"it names session {record.get('session_id')!r}, not its own")
            entries = [Entry(RecordKind(kind), step, data) for kind, step, data in answer["audit"]]
            why = _unsupported(job, session_id, entries, record, self._store, self._profiles)
            if why is None:
                self._store.add_session(session_id, entries)
                return record
        except (AuditError, KeyError, TypeError, ValueError) as exc:
            why = _first_line(exc)
        return error_record(
            job,
            f"the record of this run from Ray node {worker.node[:12]} was not logged: {why}",
            started,
            time.time(),
        )


def _own(job: Job) -> dict[str, Any]:
    """What the driver knows of a job, which no worker's answer replaces."""
    return {
        "key": job.key,
        "scenario_file": job.scenario_file,
        "scenario_id": job.spec.id,
        "agent": job.agent,
        "repeat": job.repeat,
        "executor": job.where,
        "inputs": asdict(job.what),
    }


def _unsupported(
    job: Job,
    session_id: str,
    entries: list[Entry],
    record: dict[str, Any],
    store: SQLiteAuditStore,
    profiles: dict[str, Profile],
) -> str | None:
    """Why ``entries`` do not bear out ``record`` once in ``store`` (they are of another
    scenario or profile than ``job``'s, the gate judges them otherwise, or they end
    otherwise), or ``None``."""
    if not entries or entries[0].kind != RecordKind.SESSION:
        return "its first record is not a session record"
    try:
        json.dumps([e.data for e in entries], allow_nan=False)
    except (TypeError, ValueError) as exc:
        return f"its records are not JSON: {exc}"
    if any(e.kind == RecordKind.END for e in entries[:-1]):
        return "it has records after its end record"
    if entries[0].data.get("scenario") != job.spec.model_dump(mode="json"):
        return "its records are of another scenario"
    if entries[0].data.get("profile") != profiles[job.spec.profile].model_dump(mode="json"):
        return "its records are judged under another profile"
    first = entries[0]._replace(data=store.first(entries[0].data))
    replayed = replay(MemoryAuditStore.holding(session_id, [first, *entries[1:]]), session_id)
    if not replayed.identical:
        return f"the gate judges it otherwise: {replayed.mismatches[0]}"
    ends = [e.data for e in entries if e.kind == RecordKind.END]
    if len(ends) != 1:
        return f"it has {len(ends)} end records"
    for name in ("outcome", "posture", "steps", "verdicts"):
        if ends[0].get(name) != record.get(name):
            return f"its result says {name} {record.get(name)!r}, its records {ends[0].get(name)!r}"
    said = [step.get("verdict") for step in record.get("trace") or []]
    judged_ = [step.verdict.value for step in replayed.steps]
    if said != judged_:
        return f"its result's verdicts {said} are not the records' {judged_}"
    return None


def _handlers() -> dict[int, Any]:
    return {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGHUP)}


def _restore(handlers: dict[int, Any]) -> None:
    try:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    except ValueError:  # not the main thread: signals are not this caller's to handle
        pass


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"
