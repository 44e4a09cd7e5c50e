"""What the viewer's pages cost on the server.

Run: ``python benchmarks/view_pages.py [--sessions N] [--steps N] [--rounds N]``. Builds an
audit database with ``--sessions`` recorded sessions (10,000 by default: each a session
record holding the CISO profile, a step, a decision and an end record, signed as runs
sign them) and one real run of ``--steps`` steps (500: a scripted agent's commands
through the null executor, recorded by the runtime), then times in one process, through
the application itself (Starlette's test client, no network): the runs list, first read
and then again, a filtered list, and the 500-step run's page (its records, the gate
judging them again for the masks, the verification against the key). Then the same
sessions as a batch's results file (a line per session, with its agent spec) beside the
database, each line signed as ``cmbs batch`` signs it (one in a hundred unsigned, as an
older cmbs wrote them): the list with both, first read (every line's signature checked)
and again, the batch page, and the list after a line is appended. Prints medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import uuid
from pathlib import Path

import anyio
from starlette.testclient import TestClient

from cmbs_async import ScenarioSpec, ScriptedAgent, run_scenario
from cmbs_async.audit import SQLiteAuditStore, load_or_create_key, public_key_text
from cmbs_async.audit.signing import sign
from cmbs_async.audit.store import Entry, RecordKind
from cmbs_async.batch.results import signed_payload
from cmbs_async.profile import load_profile
from cmbs_async.records import session_data
from cmbs_async.view import Library, build_app
from executors import NullExecutor

AGENTS = ("builtin:solver", "stdio:python agent.py", "openai:model@http://127.0.0.1:8080/v1")
OUTCOMES = ("terminated", "agent_finished", "agent_error")


def populate(db: Path, key_path: Path, sessions: int) -> list[str]:
    """The sessions recorded, in order."""
    key = load_or_create_key(key_path)
    store = SQLiteAuditStore(db, key=key)
    profile = load_profile("ciso")
    made = []
    try:
        for number in range(sessions):
            spec = ScenarioSpec(id=f"scenario-{number % 50}", goal="check", deadline_s=200)
            session = uuid.uuid4().hex
            made.append(session)
            data = session_data(spec, profile, None) | {"agent": AGENTS[number % 7 % 3]}
            store.open_session(session, data)
            outcome = OUTCOMES[number % 3]
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
    return made


def results_file(path: Path, sessions: list[str], db: Path, key_path: Path) -> None:
    """A batch's results, a line per recorded session, as ``cmbs batch`` writes them
    (signed with the key at ``key_path``, but one line in a hundred)."""
    key = load_or_create_key(key_path)
    public = public_key_text(key)
    with path.open("w") as out:
        for number, session in enumerate(sessions):
            outcome = OUTCOMES[number % 3]
            record = {
                "key": f"scenario-{number % 50}.yaml|{AGENTS[number % 7 % 3]}|{number}",
                "scenario_file": f"scenario-{number % 50}.yaml",
                "agent": AGENTS[number % 7 % 3],
                "repeat": number,
                "scenario_id": f"scenario-{number % 50}",
                "outcome": outcome,
                "posture": None,
                "steps": 1,
                "verdicts": {"BLOCK": 1},
                "duration_s": 0.1,
                "reason": "endpoint unreachable" if outcome == "agent_error" else None,
                "session_id": session,
                "trace": [
                    {
                        "step": 1,
                        "action": "terminate",
                        "verdict": "BLOCK",
                        "message": "Termination blocked; belief incomplete.",
                    }
                ],
                "started_at": 1.7e9 + number,
                "finished_at": 1.7e9 + number + 0.1,
                "expected": ("compliant", "non_compliant")[number % 2],
                "correct": False,
                "itbench_pass": number % 5 == 0,
            }
            if number % 100 != 99:
                record |= {"audit_db": str(db.resolve()), "signed_by": public}
                record["signature"] = sign(key, signed_payload(record))
            out.write(json.dumps(record) + "\n")


def first_and_again(client: TestClient, url: str, label: str, rounds: int) -> None:
    started = time.perf_counter()
    assert client.get(url).status_code == 200
    print(f"  {label + ', first read':52} {(time.perf_counter() - started) * 1000:8.1f} ms")
    print(f"  {label + ', again':52} {timed(client, url, rounds):8.1f} ms")


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
    made = populate(db, key, sessions)
    session = anyio.run(long_run, db, key, steps)
    took = time.perf_counter() - started
    print(f"built {sessions} sessions and a {steps}-step run in {took:.0f} s")
    trusted = public_key_text(load_or_create_key(key))
    client = TestClient(build_app(Library([db], trusted_key=trusted)))
    started = time.perf_counter()
    client.get("/")
    first = (time.perf_counter() - started) * 1000
    print(f"  {f'runs list, first read ({sessions + 1} sessions)':52} {first:8.1f} ms")
    for label, url in [
        ("runs list, again", "/"),
        ("runs list, filtered (q=scenario-7)", "/?q=scenario-7"),
        ("runs list, sorted by steps", "/?sort=-steps"),
        ("runs list, filtered by agent and outcome", "/?agent=builtin%3Asolver&outcome=terminated"),
        ("runs list, sorted by agent", "/?sort=agent"),
        (f"a run of {steps} steps", f"/run/{session}"),
    ]:
        print(f"  {label:52} {timed(client, url, rounds):8.1f} ms")
    results = folder / "results.jsonl"
    results_file(results, made, db, key)
    with_results = TestClient(build_app(Library([db], [results], trusted_key=trusted)))
    first_and_again(with_results, "/", f"runs list + results file ({sessions} lines)", rounds)
    url = "/?batch=results.jsonl&pass=pass&expected=compliant"
    label = "  filtered by batch, IT-Bench pass, expected"
    print(f"  {label:52} {timed(with_results, url, rounds):8.1f} ms")
    first_and_again(with_results, "/batches", f"batch page ({sessions} results)", rounds)
    with results.open("a") as more:  # the batch goes on: only the new line is checked
        more.write(results.read_text().splitlines()[0].replace('"key": "', '"key": "more-') + "\n")
    started = time.perf_counter()
    assert with_results.get("/").status_code == 200
    label = "runs list, after a line was appended"
    print(f"  {label:52} {(time.perf_counter() - started) * 1000:8.1f} ms")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=10000)
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    main(args.sessions, args.steps, args.rounds)
