"""Beyond one machine: a batch split into shards that run on Ray workers.

Each shard is one anyio event loop in its worker running the local batch runner (every
scenario keeps its own deadline there); results come back to the driver shard by shard
and go through the same results file, resume and summary as a local batch. Jobs travel
as data (the scenario spec and the scripted agent's lines), so workers need the package
installed but no shared filesystem. Only the local executor runs on workers.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

import anyio

from executors import LocalExecutor
from executors.sandbox import SandboxMode

from ..agents import ScriptedAgent
from ..scenario import ScenarioSpec
from .jobs import BatchError, Job
from .progress import Progress
from .results import ResultLog
from .runner import BatchReport, run_batch

__all__ = ["run_batch_ray"]

INSTALL_HINT = "the ray backend needs Ray: pip install 'cmbs-async[ray]'"


def _shard(
    jobs: list[dict[str, Any]],
    agents: dict[str, list[str]],
    concurrency: int,
    containment: dict[str, Any],
) -> list[dict[str, Any]]:
    """Runs in a Ray worker: one event loop for the whole shard, its executor contained as
    the driver's local one is (``containment``: its sandbox, hidden paths, user) and
    closed with the shard."""
    planned = [
        Job(
            scenario_file=j["scenario_file"],
            spec=ScenarioSpec.model_validate(j["spec"]),
            agent=j["agent"],
            repeat=j["repeat"],
            inputs=j["inputs"],  # keyed as the driver keyed it
        )
        for j in jobs
    ]

    def factory(spec: str) -> Callable[[], ScriptedAgent]:
        lines = agents[spec]
        return lambda: ScriptedAgent(lines)

    async def main() -> list[dict[str, Any]]:
        async with LocalExecutor(**containment) as executor:
            report = await run_batch(
                planned, agents=factory, executor=executor, concurrency=concurrency
            )
        return report.records

    return anyio.run(main)


def run_batch_ray(
    jobs: Sequence[Job],
    *,
    agent_lines: dict[str, list[str]],
    concurrency: int,
    address: str | None = None,
    shards: int | None = None,
    sandbox: SandboxMode = "auto",
    hidden: Sequence[str] = (),
    user: str | None = None,
    log: ResultLog | None = None,
    progress: Progress | None = None,
) -> BatchReport:
    """Run the jobs ``log`` has no result for on a Ray cluster (a local one by default).

    Each worker's commands are contained as a local batch's are: ``sandbox``, ``hidden``
    (the operator's signing key and audit database, say) and ``user`` as for
    :class:`executors.LocalExecutor`; a worker's workdirs live under a fresh root of its
    own."""
    try:
        import ray
    except ImportError:
        raise BatchError(INSTALL_HINT) from None
    report = BatchReport()
    todo = [job for job in jobs if log is None or job.key not in log.done]
    report.skipped = len(jobs) - len(todo)
    if not todo:
        return report
    if address is None:
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a throwaway local cluster
    started_here = not ray.is_initialized()
    if started_here:
        try:
            ray.init(
                address=address,
                include_dashboard=False,
                logging_level=logging.WARNING,
                log_to_driver=False,
            )
        except Exception as exc:  # noqa: BLE001 - Ray raises many kinds; say it in one line
            raise BatchError(f"cannot start or reach Ray ({address or 'local'}): {exc}") from None
    try:
        cpus = int(ray.cluster_resources().get("CPU", 1))  # type: ignore[no-untyped-call,unused-ignore]
        count = max(1, min(len(todo), shards or cpus * 2))
        remote = ray.remote(_shard)
        payload = [
            {
                "scenario_file": job.scenario_file,
                "spec": job.spec.model_dump(mode="json"),
                "agent": job.agent,
                "repeat": job.repeat,
                "inputs": job.inputs,
            }
            for job in todo
        ]
        containment = {"sandbox": sandbox, "hidden": tuple(hidden), "user": user}
        pending = [
            remote.remote(payload[i::count], agent_lines, concurrency, containment)
            for i in range(count)
        ]
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            for record in ray.get(done[0]):
                if log is not None:  # never raises: a result not written as it is is said
                    record = log.keep(record) or record
                report.records.append(record)
                if progress is not None:
                    progress.running += 1
                    progress.finish(record)
    except KeyboardInterrupt:
        report.interrupted = True
    finally:
        if started_here:
            ray.shutdown()
    return report
