"""Shared pieces of the ``ray`` tests: scripted jobs, their worker plan, and a batch run
through ``run_batch_ray`` on a running cluster. Ray and the batch modules are imported
when called, as the tests skip where Ray is absent."""

from __future__ import annotations

from typing import Any


def scripted_jobs(names: list[str], agent: str, deadline: float = 60) -> list[Any]:
    """One job a name (its scenario id), each run once by the scripted ``agent``."""
    from cmbs_async.batch import Job
    from cmbs_async.scenario import ScenarioSpec

    return [
        Job(
            scenario_file=f"{name}.yaml",
            spec=ScenarioSpec(id=name, goal="g", deadline_s=deadline),
            agent=agent,
            repeat=0,
        )
        for name in names
    ]


def scripted_plan(agent: str, steps: list[Any], **more: Any) -> Any:
    """The worker plan that runs ``agent`` as ``steps``, under the ciso profile."""
    from cmbs_async.agents.specs import AgentOptions
    from cmbs_async.batch.ray_worker import WorkerPlan
    from cmbs_async.profile import load_profile

    return WorkerPlan(
        agents={agent: steps},
        options=AgentOptions(),
        profiles={"ciso": load_profile("ciso")},
        **more,
    )


def run_on_cluster(address: str, jobs: list[Any], **options: Any) -> dict[str, dict[str, Any]]:
    """``run_batch_ray(jobs, **options)`` as a driver of the cluster at ``address``: the
    records by scenario id."""
    import ray

    from cmbs_async.batch.ray_backend import run_batch_ray

    ray.init(address=address, log_to_driver=False)
    try:
        report = run_batch_ray(jobs, **options)
    finally:
        ray.shutdown()
    return {r["scenario_id"]: r for r in report.records}
