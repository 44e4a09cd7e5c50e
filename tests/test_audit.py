"""The audit trail: durable, signed, chained records; tampering found; replay identical;
nothing lost when the process is killed."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cmbs_async import CallableAgent, Outcome, Verdict, replay, run_scenario
from cmbs_async.audit import RecordKind, SigningKeyError, SQLiteAuditStore, load_or_create_key
from cmbs_async.demo import demo_agent, demo_scenario
from cmbs_async.review import Review, ReviewVerdict, SupervisionConfig, Verdict3
from executors import NullExecutor

from .helpers import CMBS, ScriptedReviewer, assessed, replaying, step

pytestmark = pytest.mark.anyio


@pytest.fixture
def key_path(tmp_path: Path) -> Path:
    return tmp_path / "keys" / "signing_key"


@pytest.fixture
def store(tmp_path: Path, key_path: Path) -> SQLiteAuditStore:
    db = SQLiteAuditStore(tmp_path / "audit.db", key=load_or_create_key(key_path))
    yield db  # type: ignore[misc]
    db.close()


def cmbs(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CMBS, *args], capture_output=True, text=True, timeout=60)


async def test_a_run_is_recorded_and_verifies(store: SQLiteAuditStore) -> None:
    result = await run_scenario(demo_scenario(), agent=demo_agent(), audit=store)
    assert result.session_id is not None
    kinds = [r.kind for r in store.records(result.session_id)]
    assert kinds[0] == "session" and kinds[-1] == "end"
    assert kinds.count("step") == 12 and kinds.count("decision") == 12
    assert kinds.count("observation") == 6
    # each decision is recorded after its step and before its observation
    assert kinds[1:5] == ["step", "decision", "step", "decision"]
    history = store.step_history(result.session_id, 10)
    # (an evaluation's provenance chain, where there is one, follows its observation)
    kinds_10 = [r.kind for r in history.records if r.kind != "evidence"]
    assert kinds_10 == ["step", "decision", "observation"]
    assert history.of_kind("observation")[0].data["stdout"]["head"] == "false\n"
    assert len(store.session_history(result.session_id)) == 12
    assert store.verify().intact
    assert replay(store, result.session_id).identical


async def test_a_callable_agents_non_json_values_replay_identically(
    store: SQLiteAuditStore,
) -> None:
    """Sets, bytes, NaN, integer keys, a bare number: the gate judges what is recorded."""
    valid = json.loads(step("check_status", {"command": "true"}))
    said: list[object] = [
        valid | {"when": {1, 2}},
        valid | {"action": {"type": "check_status", "payload": {"command": float("nan")}}},
        {1: 2, "a": b"x"},
        42,
        valid,
    ]

    async def agent(turn: object) -> object:
        return said.pop(0) if said else None

    result = await run_scenario(
        demo_scenario(), agent=CallableAgent(agent), executor=NullExecutor(), audit=store
    )
    assert result.session_id is not None and result.steps == 5
    assert [t.verdict for t in result.trace][-1] is Verdict.ALLOW
    report = replay(store, result.session_id)
    assert report.decisions == 5 and report.identical, report.mismatches
    done = cmbs("replay", str(store.path), result.session_id)
    assert done.returncode == 0 and "identical" in done.stdout and done.stderr == ""


async def test_a_reviewed_run_replays_identically(store: SQLiteAuditStore) -> None:
    reorient = ReviewVerdict(verdict=Verdict3.REORIENT, reasoning="r", correction="c")
    flagged = assessed("check_status", {"command": "true"}, confidence=0.1)
    agent, _ = replaying(step("check_status", {"command": "true"}), flagged, flagged)
    result = await run_scenario(
        demo_scenario(),
        agent=agent,
        executor=NullExecutor(),
        audit=store,
        review=Review(
            reviewer=ScriptedReviewer(
                reorient, ReviewVerdict(verdict=Verdict3.CONTINUE, reasoning="ok")
            ),
            config=SupervisionConfig(),
        ),
    )
    assert result.outcome is Outcome.AGENT_FINISHED
    session = result.session_id or ""
    supervision = [r.data for r in store.records(session) if r.kind == "supervision"]
    assert [s["action"] for s in supervision] == ["reorient", "proceed"]
    assert supervision[0]["flags"][0]["trigger"] == "low_confidence"
    report = replay(store, session)
    assert report.identical and report.decisions == 3 and report.reconciles == 3


def test_checkpoint_store_interface(store: SQLiteAuditStore) -> None:
    store.open_session("s1", {"scenario": {"id": "x"}})
    store.save_pre("s1", 1, {"interpretation": "i"})
    store.save_post("s1", 1, {"commitment_met": True, "confidence": 0.9})
    store.save_supervision("s1", 1, {"verdict": "CONTINUE"})
    history = store.step_history("s1", 1)
    assert [r.kind for r in history.records] == ["pre", "post", "supervision"]
    assert store.sessions()[0]["session_id"] == "s1"
    assert store.verify().intact


def test_a_trail_written_before_the_typed_schema_verifies_and_replays(tmp_path: Path) -> None:
    db = tmp_path / "audit.db"
    shutil.copy(Path(__file__).parent / "data" / "audit_trail_v0.db", db)
    old = SQLiteAuditStore(db)
    try:
        assert old.verify().intact
        for session, decisions in (("demo", 8), ("reviewed", 4)):
            report = replay(old, session)
            assert report.identical and report.decisions == decisions
        history = old.step_history("checkpoints", 1)
        assert [r.kind for r in history.records] == [
            RecordKind.PRE,
            RecordKind.POST,
            RecordKind.SUPERVISION,
        ]
    finally:
        old.close()


@pytest.fixture(scope="module")
def recorded_demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The audit database of one ``cmbs demo`` run, verified intact; built once per module."""
    folder = tmp_path_factory.mktemp("recorded")
    db = folder / "audit.db"
    done = cmbs("demo", "--audit-db", str(db), "--signing-key", str(folder / "k"))
    assert done.returncode == 0, done.stderr
    assert verify(db, recorded=db).returncode == 0
    return db


def verify(db: Path, *, recorded: Path) -> subprocess.CompletedProcess[str]:
    """``cmbs audit verify DB``, trusting the key that signed the ``recorded`` demo."""
    return cmbs("audit", "verify", str(db), "--signing-key", str(recorded.parent / "k"))


def _tamper(db: Path, sql: str, *args: object) -> None:
    with sqlite3.connect(db) as conn:
        conn.execute(sql, args)


@pytest.mark.parametrize(
    ("how", "found"),
    [
        ("edit", "record 3: its content does not match its hash"),
        ("delete", "record 3: missing"),
        ("swap", "record 2: its columns do not match its signed body"),
        ("forge", "bad signature: edited or forged"),
        ("cut", "the signed head names record"),
        ("resign", "record 3: bad signature"),
    ],
)
def test_tampering_is_found(tmp_path: Path, recorded_demo: Path, how: str, found: str) -> None:
    db = tmp_path / "audit.db"
    for written in recorded_demo.parent.glob("audit.db*"):  # with any WAL file
        shutil.copy(written, tmp_path / written.name)
    if how == "edit":  # change one byte of a stored record
        _tamper(
            db,
            "UPDATE records SET body = replace(body, 'generate_script', "
            "'generate_scripT') WHERE seq = 3",
        )
    elif how == "delete":
        _tamper(db, "DELETE FROM records WHERE seq = 3")
    elif how == "swap":
        with sqlite3.connect(db) as conn:
            rows = conn.execute(
                "SELECT seq, kind, step, body, hash, signature FROM records "
                "WHERE seq IN (2, 3) ORDER BY seq"
            ).fetchall()
            for (seq, *_), (_, kind, step_, body, hash_, sig) in zip(
                rows, reversed(rows), strict=True
            ):
                conn.execute(
                    "UPDATE records SET kind=?, step=?, body=?, hash=?, signature=? WHERE seq=?",
                    (kind, step_, body, hash_, sig, seq),
                )
    elif how in ("forge", "cut"):
        with sqlite3.connect(db) as conn:
            session, last, body = conn.execute(
                "SELECT session_id, seq, body FROM records ORDER BY seq DESC LIMIT 1"
            ).fetchone()
            if how == "cut":
                conn.execute("DELETE FROM records WHERE seq = ?", (last,))
            else:
                previous = hashlib.sha256(body.encode()).hexdigest()
                forged = json.dumps(
                    json.loads(body) | {"seq": last + 1, "kind": "decision", "prev": previous},
                    sort_keys=True,
                    separators=(",", ":"),
                )
                conn.execute(
                    "INSERT INTO records VALUES (?, ?, 'decision', NULL, ?, ?, 'c2lnbmVk')",
                    (session, last + 1, forged, hashlib.sha256(forged.encode()).hexdigest()),
                )
    elif how == "resign":  # a consistent edit, re-hashed, but not signable without the key
        with sqlite3.connect(db) as conn:
            body = conn.execute("SELECT body FROM records WHERE seq = 3").fetchone()[0]
            body = body.replace("generate_script", "generate_scripT")
            conn.execute(
                "UPDATE records SET body = ?, hash = ? WHERE seq = 3",
                (body, hashlib.sha256(body.encode()).hexdigest()),
            )
    checked = verify(db, recorded=recorded_demo)
    assert checked.returncode == 1, checked.stdout
    assert found in checked.stdout and "TAMPERED" in checked.stdout


def test_a_record_of_no_known_kind_is_refused_in_one_line(
    tmp_path: Path, recorded_demo: Path
) -> None:
    db = tmp_path / "audit.db"
    for written in recorded_demo.parent.glob("audit.db*"):
        shutil.copy(written, tmp_path / written.name)
    _tamper(db, """UPDATE records SET body = replace(body, '"kind":"step"', '"kind":"note"')""")
    shown = cmbs("audit", "show", str(db))
    assert shown.returncode == 2 and "Traceback" not in shown.stderr
    assert shown.stderr.count("\n") == 1 and "TAMPERED: session " in shown.stderr
    assert shown.stderr.strip().endswith("`cmbs audit verify` lists every finding")
    # re-hashed, the chain holds: the body is still not a record's (no key needed to see)
    with sqlite3.connect(db) as conn:
        for seq, body in conn.execute("SELECT seq, body FROM records ORDER BY seq").fetchall():
            if '"kind":"note"' in body:
                conn.execute(
                    "UPDATE records SET hash = ?, kind = 'note' WHERE seq = ?",
                    (hashlib.sha256(body.encode()).hexdigest(), seq),
                )
    session = cmbs("audit", "export", str(db), "--jsonl").stdout.split('"', 4)[3]
    for command in (["audit", "show", str(db)], ["replay", str(db), session]):
        shown = cmbs(*command)
        assert shown.returncode == 2 and shown.stderr.count("\n") == 1, shown.stderr
        assert "record 1: not of a record's shape ('note' is not a kind of record)" in shown.stderr
    assert "TAMPERED" in verify(db, recorded=recorded_demo).stdout


def test_a_run_killed_mid_way_loses_no_decision(tmp_path: Path) -> None:
    db, ready = tmp_path / "audit.db", tmp_path / "ready"
    child = tmp_path / "child.py"
    child.write_text(
        "import anyio, json, pathlib, sys\n"
        "from cmbs_async import CallableAgent, ScenarioSpec, run_scenario\n"
        "from cmbs_async.audit import SQLiteAuditStore, load_or_create_key\n"
        f"store = SQLiteAuditStore({str(db)!r}, key=load_or_create_key({str(tmp_path / 'k')!r}))\n"
        "async def agent(turn):\n"
        "    if turn.step > 5:\n"
        f"        pathlib.Path({str(ready)!r}).write_text('5')\n"
        "        await anyio.sleep_forever()\n"
        f"    return {step('check_status', {'command': 'true'})!r}\n"
        "anyio.run(lambda: run_scenario(ScenarioSpec(id='crash', goal='g', deadline_s=60),"
        " agent=CallableAgent(agent), audit=store))\n"
    )
    process = subprocess.Popen([sys.executable, str(child)])
    try:
        deadline = time.monotonic() + 30
        while not ready.exists():
            assert process.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        os.kill(process.pid, signal.SIGKILL)
        process.wait()
    store = SQLiteAuditStore(db)
    try:
        assert store.verify().intact
        (session,) = store.sessions()
        assert session["outcome"] is None  # no end record: the run was cut off
        decisions = [r for r in store.records(session["session_id"]) if r.kind == "decision"]
        assert [d.step for d in decisions] == [1, 2, 3, 4, 5]
        assert replay(store, session["session_id"]).identical
    finally:
        store.close()


def test_signing_keys_are_0600_and_loose_ones_refused(key_path: Path) -> None:
    load_or_create_key(key_path)
    assert oct(key_path.stat().st_mode & 0o777) == "0o600"
    key_path.chmod(0o644)
    with pytest.raises(SigningKeyError, match="must be 0600"):
        load_or_create_key(key_path)


def test_cli_show_export_replay_and_trusted_key(tmp_path: Path) -> None:
    db, key = tmp_path / "a.db", tmp_path / "k"
    assert cmbs("demo", "--audit-db", str(db), "--signing-key", str(key)).returncode == 0
    sessions = cmbs("audit", "show", str(db)).stdout.splitlines()
    session = sessions[1].split()[0]
    shown = cmbs("audit", "show", str(db), session[:8])
    assert "Posture declaration not permitted without successful execution." in shown.stdout
    assert "outcome  terminated" in shown.stdout
    lines = cmbs("audit", "export", str(db), "--jsonl").stdout.splitlines()
    evidence = sum(json.loads(line)["kind"] == "evidence" for line in lines)
    assert json.loads(lines[0])["kind"] == "session" and len(lines) == 32 + evidence
    again = cmbs("replay", str(db), session)
    assert (
        again.returncode == 0 and "12 decision(s)" in again.stdout and "identical" in again.stdout
    )
    trusted = cmbs("audit", "verify", str(db), "--signing-key", str(key))
    assert trusted.returncode == 0 and "the trusted key" in trusted.stdout
    other = tmp_path / "other"
    load_or_create_key(other)  # a key that signed nothing here
    assert cmbs("audit", "verify", str(db), "--signing-key", str(other)).returncode == 1
    missing = cmbs("audit", "verify", str(tmp_path / "none.db"))
    assert missing.returncode == 2 and "no audit database" in missing.stderr
