"""One run configuration (``RunConfig``) for every way to run: the same frozen object
configures ``run_scenario``, a ``Session`` and a batch alike, and the audit log names the
agent that ran."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from cmbs_async import (
    Outcome,
    RunConfig,
    ScenarioSpec,
    ScriptedAgent,
    Session,
    SQLiteAuditStore,
    run_scenario,
)
from cmbs_async.batch import Job, run_batch
from executors import LocalExecutor

from .helpers import CMBS, step

LOOKING = [step("check_status", {"command": "echo looking"})] * 5


def _spec() -> ScenarioSpec:
    return ScenarioSpec(id="configured", goal="look around", deadline_s=600, max_steps=50)


def _store(path: Path) -> SQLiteAuditStore:
    return SQLiteAuditStore(path, key=Ed25519PrivateKey.generate())


def test_a_run_configuration_is_frozen_and_checks_its_values() -> None:
    config = RunConfig(max_steps=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.max_steps = 3  # type: ignore[misc]
    assert config.replace(deadline=5).deadline == 5 and config.deadline is None
    with pytest.raises(ValueError, match="deadline"):
        RunConfig(deadline=0)
    with pytest.raises(ValueError, match="max_steps"):
        RunConfig(max_steps=0)


@pytest.mark.anyio
async def test_one_configuration_runs_alike_under_run_scenario_session_and_batch(
    tmp_path: Path,
) -> None:
    store = _store(tmp_path / "audit.db")
    config = RunConfig(max_steps=2, audit=store)
    async with LocalExecutor(sandbox="none") as executor:
        alone = await run_scenario(
            _spec(), agent=ScriptedAgent(LOOKING), executor=executor, config=config
        )
        async with Session(_spec(), executor=executor, config=config) as session:
            for _ in range(5):
                reply = await session.step("check_status", {"command": "echo looking"})
                if reply.ended:
                    break
        batched = await run_batch(
            [Job(scenario_file="s.yaml", spec=_spec(), agent="script:looking", repeat=0)],
            agents=lambda spec: lambda: ScriptedAgent(LOOKING, label=spec),
            executor=executor,
            concurrency=1,
            config=config,
        )
    stepped = session.result
    assert stepped is not None
    for outcome, steps in (
        (alone.outcome, alone.steps),
        (stepped.outcome, stepped.steps),
        (Outcome(batched.records[0]["outcome"]), batched.records[0]["steps"]),
    ):
        assert (outcome, steps) == (Outcome.STEP_BUDGET_EXHAUSTED, 2)
    agents = [next(iter(store.records(sid))).data["agent"] for sid in store.session_ids()]
    assert agents == ["script", "session", "script:looking"]
    store.close()


@pytest.mark.anyio
async def test_a_keyword_option_replaces_the_configurations_own(tmp_path: Path) -> None:
    config = RunConfig(max_steps=2)
    result = await run_scenario(
        _spec(),
        agent=ScriptedAgent(LOOKING),
        executor=None,
        config=config,
        max_steps=3,
    )
    assert result.steps == 3 and config.max_steps == 2


def test_the_audit_log_names_the_agent_of_a_command_line_run(tmp_path: Path) -> None:
    steps = tmp_path / "steps.jsonl"
    steps.write_text(step("terminate") + "\n")
    scenario = tmp_path / "s.json"
    scenario.write_text(json.dumps({"id": "named", "goal": "g"}))
    db = tmp_path / "audit.db"
    done = subprocess.run(
        [
            *CMBS,
            "run",
            str(scenario),
            "--agent",
            f"script:{steps}",
            "--audit-db",
            str(db),
            "--signing-key",
            str(tmp_path / "key"),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode in (0, 3), done.stderr
    store = SQLiteAuditStore(db, key=Ed25519PrivateKey.generate())
    try:
        first = next(iter(store.records()))
    finally:
        store.close()
    assert first.data["agent"] == f"script:{steps.resolve()}"


@pytest.mark.ray
@pytest.mark.skipif(
    importlib.util.find_spec("ray") is None and not os.environ.get("CI"),
    reason="install the ray extra: pip install -e '.[ray]'",
)
def test_a_ray_worker_hides_what_the_local_executor_hides(tmp_path: Path) -> None:
    from cmbs_async.agents.specs import AgentOptions
    from cmbs_async.batch.ray_backend import run_batch_ray
    from cmbs_async.batch.ray_worker import WorkerPlan
    from cmbs_async.profile import load_profile

    place = Path(tempfile.mkdtemp(dir="/var/tmp"))  # not /tmp: each sandbox has its own
    try:
        place.chmod(0o755)
        secret = place / "operator-secret"
        secret.write_text("s3cret\n")
        secret.chmod(0o644)  # readable by anyone: only the sandbox keeps it out of reach
        lines = [
            step("check_status", {"command": f"cat {secret} || echo unreadable"}),
            step("terminate"),
        ]
        spec = ScenarioSpec(id="peek", goal="g", deadline_s=120)
        seen = {}
        for hidden in ((), (str(secret),)):
            plan = WorkerPlan(
                agents={"script:peek": lines},
                options=AgentOptions(),
                profiles={"ciso": load_profile("ciso")},
                sandbox="bwrap",
                hidden=hidden,
                audit=False,
            )
            report = run_batch_ray(
                [Job(scenario_file="peek.yaml", spec=spec, agent="script:peek", repeat=0)],
                plan=plan,
                concurrency=1,
                workers=1,
            )
            (record,) = report.records
            seen[hidden] = record["trace"][0]["observed"]
    finally:
        shutil.rmtree(place)
    assert "s3cret" in seen[()]  # the file is there to read, unless hidden
    assert "s3cret" not in seen[(str(secret),)] and "unreadable" in seen[(str(secret),)]
