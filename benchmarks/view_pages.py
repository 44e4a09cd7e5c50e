"""What the viewer's pages cost on the server.

Run: ``python benchmarks/view_pages.py [--sessions N] [--steps N] [--rounds N]``. Builds an
audit database with ``--sessions`` recorded sessions (10,000 by default: each a session
record holding the CISO profile, a step, a decision and an end record, signed as runs
sign them) and one real run of ``--steps`` steps (500: a scripted agent's commands
through the null executor, recorded by the runtime), then times in one process, through
the application itself (Starlette's test client, no network): the runs list, first read
and then again, a filtered list, and the 500-step run's page (its records, the gate
judging them again for the masks, the verification against the key). Prints medians.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import uuid
from pathlib import Path

import anyio
from starlette.testclient import TestClient

from cmbs_async import ScenarioSpec, ScriptedAgent, run_scenario
from cmbs_async.audit import SQLiteAuditStore, load_or_create_key, public_key_text
from cmbs_async.audit.store import Entry, RecordKind
from cmbs_async.profile import load_profile
from cmbs_async.records import session_data
from cmbs_async.view import Library, build_app
from executors import NullExecutor


def populate(db: Path, key_path: Path, sessions: int) -> None:
    key = load_or_create_key(key_path)
    store = SQLiteAuditStore(db, key=key)
    profile = load_profile("ciso")
    try:
        for number in range(sessions):
            spec = ScenarioSpec(id=f"scenario-{number % 50}", goal="check", deadline_s=200)
            session = uuid.uuid4().hex
            store.open_session(session, session_data(spec, profile, None))
            outcome = ("terminated", "agent_finished", "agent_error")[number % 3]
            store.append(
                session,
                [
                    Entry(RecordKind.STEP, 1, {"raw": '{"action": {"type": "terminate"}}'}),
                    Entry(
                        RecordKind.DECISION,
                        1,
                        {
                            "action": "terminate",
                            "verdict": "BLOCK",
                            "message": "Termination blocked; belief incomplete.",
                            "detail": None,
                        },
                    ),
                    Entry(
                        RecordKind.END,
                        None,
                        {
                            "outcome": outcome,
                            "posture": None,
                            "steps": 1,
                            "duration_s": 0.1,
                            "reason": None,
                        },
                    ),
                ],  # fmt: skip
            )
    finally:
        store.close()


async def long_run(db: Path, key_path: Path, steps: int) -> str:
    store = SQLiteAuditStore(db, key=load_or_create_key(key_path))
    line = '{"belief": {"posture": "unknown", "evidence": "none"}, "action": {"type": "check_status", "payload": {"command": "true"}}}'  # noqa: E501
    try:
        result = await run_scenario(
            ScenarioSpec(id="long-run", goal="many steps", deadline_s=600, max_steps=steps + 1),
            agent=ScriptedAgent([line] * steps),
            executor=NullExecutor(),
            audit=store,
        )
    finally:
        store.close()
    assert result.session_id is not None
    return result.session_id


def timed(client: TestClient, url: str, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        response = client.get(url)
        times.append(time.perf_counter() - started)
        assert response.status_code == 200, response.text[:200]
    return statistics.median(times) * 1000


def main(sessions: int, steps: int, rounds: int) -> None:
    folder = Path(tempfile.mkdtemp(prefix="cmbs-view-bench-"))
    db, key = folder / "audit.db", folder / "key"
    started = time.perf_counter()
    populate(db, key, sessions)
    session = anyio.run(long_run, db, key, steps)
    took = time.perf_counter() - started
    print(f"built {sessions} sessions and a {steps}-step run in {took:.0f} s")
    library = Library([db], trusted_key=public_key_text(load_or_create_key(key)))
    client = TestClient(build_app(library))
    started = time.perf_counter()
    client.get("/")
    first = (time.perf_counter() - started) * 1000
    print(f"  {f'runs list, first read ({sessions + 1} sessions)':38} {first:8.1f} ms")
    for label, url in [
        ("runs list, again", "/"),
        ("runs list, filtered (q=scenario-7)", "/?q=scenario-7"),
        ("runs list, sorted by steps", "/?sort=-steps"),
        (f"a run of {steps} steps", f"/run/{session}"),
    ]:
        print(f"  {label:38} {timed(client, url, rounds):8.1f} ms")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=10000)
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    main(args.sessions, args.steps, args.rounds)
