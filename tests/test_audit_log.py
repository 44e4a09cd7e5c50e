"""The audit trail as one log a third party can check: signed checkpoints, what they
catch, read-only reading, a failed commit that loses nothing, keys made without races."""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from cmbs_async.audit import (
    Entry,
    RecordKind,
    SQLiteAuditStore,
    load_or_create_key,
    public_key_text,
)
from cmbs_async.audit.log import key_id
from executors.sandbox import find_bwrap

from .helpers import CMBS, step

#: The key that signed ``data/audit_trail_v0.db`` (its private half is not kept).
V0_KEY = "PT4U7ELik7FANgtmxY1CInD3BEutThinMCK6p5Lz0w0="


def cmbs(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CMBS, *args], capture_output=True, text=True, timeout=120, env=env, check=False
    )


@pytest.fixture
def scenario(tmp_path: Path) -> list[str]:
    """``run`` arguments for a one-step scenario, recorded with a key of the test's own."""
    (tmp_path / "s.yaml").write_text("id: logged\ngoal: g\n")
    (tmp_path / "steps.jsonl").write_text(step("check_status", {"command": "echo hi"}) + "\n")
    return ["run", str(tmp_path / "s.yaml"), "--agent", f"script:{tmp_path / 'steps.jsonl'}"] + [
        "--signing-key",
        str(tmp_path / "key"),
    ]


def run_into(db: Path, scenario: list[str], *extra: str) -> str:
    done = cmbs(*scenario, "--audit-db", str(db), "--json", *extra)
    assert done.returncode == 3, done.stderr
    return str(json.loads(done.stdout)["session_id"])


def verify(db: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    """``cmbs audit verify DB``, trusting the key the ``scenario`` fixture signs with (the
    one beside DB) unless ``extra`` names what to trust."""
    trust = ("--public-key", "--signing-key", "--head")
    pinned = [] if set(extra) & set(trust) else ["--signing-key", str(db.parent / "key")]
    return cmbs("audit", "verify", str(db), *extra, *pinned)


def test_a_checkpoint_proves_the_log_only_grew(tmp_path: Path, scenario: list[str]) -> None:
    db, head = tmp_path / "audit.db", tmp_path / "head.json"
    first = run_into(db, scenario, "--head-out", str(head))
    checkpoint = json.loads(head.read_text())
    assert set(checkpoint) == {"size", "root", "time", "key_id", "public_key", "signature"}
    assert checkpoint["size"] == 5  # session, step, decision, observation, end
    run_into(db, scenario)
    later = verify(db, "--head", str(head))
    assert later.returncode == 0, later.stdout
    assert "2 session(s), 10 record(s), intact" in later.stdout
    assert "extends the checkpoint of 5 record(s)" in later.stdout
    printed = cmbs("audit", "head", str(db), "--signing-key", str(tmp_path / "key"))
    assert printed.returncode == 0 and json.loads(printed.stdout)["size"] == 10

    # a whole session deleted: both of its rows, as the old trail let pass
    deleted = tmp_path / "deleted.db"
    shutil.copy(db, deleted)
    with sqlite3.connect(deleted) as raw:
        raw.execute("DELETE FROM records WHERE session_id = ?", (first,))
        raw.execute("DELETE FROM sessions WHERE session_id = ?", (first,))
    for extra in ((), ("--head", str(head))):
        done = verify(deleted, *extra)
        assert done.returncode == 1
        assert f"TAMPERED: log position 0: session {first} record 0 is missing" in done.stdout

    # a log wiped altogether is not made again by the next run: verify still says so
    wiped = tmp_path / "wiped.db"
    shutil.copy(deleted, wiped)
    with sqlite3.connect(wiped) as raw:
        raw.execute("DELETE FROM log")
        raw.execute("DELETE FROM log_head")
    run_into(wiped, scenario)
    done = verify(wiped)
    assert done.returncode == 1 and "is not in the log" in done.stdout, done.stdout

    # ...and the log rows with it, the chain recomputed: the signed heads give it away
    with sqlite3.connect(deleted) as raw:
        raw.execute("DELETE FROM log WHERE session_id = ?", (first,))
        raw.execute("UPDATE log SET pos = pos - 5")
    done = verify(deleted, "--head", str(head))
    assert done.returncode == 1 and "TAMPERED" in done.stdout


def test_a_cut_an_emptied_and_a_rewritten_log_fail_against_the_checkpoint(
    tmp_path: Path, scenario: list[str]
) -> None:
    db, head = tmp_path / "audit.db", tmp_path / "head.json"
    run_into(db, scenario)
    run_into(db, scenario, "--head-out", str(head))

    cut = tmp_path / "cut.db"
    shutil.copy(db, cut)
    with sqlite3.connect(cut) as raw:  # the second session gone, its log rows too
        last = raw.execute("SELECT session_id FROM sessions ORDER BY rowid DESC").fetchone()[0]
        for table in ("records", "sessions", "log"):
            raw.execute(f"DELETE FROM {table} WHERE session_id = ?", (last,))  # noqa: S608
        raw.execute("DELETE FROM log_head")
    done = verify(cut, "--head", str(head))
    assert done.returncode == 1
    assert "the log holds 5 record(s), the checkpoint covered 10" in done.stdout

    # the same key writes a new database of the same size: another history
    rewritten = tmp_path / "rewritten.db"
    run_into(rewritten, scenario)
    run_into(rewritten, scenario)
    done = verify(rewritten, "--head", str(head))
    assert done.returncode == 1
    assert "the first 10 records differ from the checkpoint's: rewritten" in done.stdout

    emptied = tmp_path / "emptied.db"
    emptied.write_bytes(b"")
    done = verify(emptied, "--head", str(head))
    assert done.returncode == 1, done.stderr
    assert "TAMPERED: " in done.stdout and "not a cmbs audit database" in done.stdout
    truncated = tmp_path / "truncated.db"
    data = db.read_bytes()
    truncated.write_bytes(data[: len(data) // 2])
    done = verify(truncated, "--head", str(head))
    assert done.returncode == 1 and "the checkpoint covered 10" in done.stdout, done.stderr

    forged = json.loads(head.read_text()) | {"size": 3}
    (tmp_path / "forged.json").write_text(json.dumps(forged))
    done = verify(db, "--head", str(tmp_path / "forged.json"))
    assert done.returncode == 2 and "signature is bad" in done.stderr


def test_reading_never_writes(tmp_path: Path, scenario: list[str]) -> None:
    """An empty file stays empty; any SQLite file keeps its tables; a database on
    read-only media (a read-only mount, in bubblewrap) verifies, shows and exports."""
    empty = tmp_path / "empty.db"
    empty.write_bytes(b"")
    for command in (["audit", "verify"], ["audit", "show"], ["audit", "export"]):
        extra = ["--jsonl"] if command[1] == "export" else []
        done = cmbs(*command, str(empty), *extra)
        assert done.returncode == 2 and done.stderr.count("\n") == 1
        assert "not a cmbs audit database" in done.stderr
    assert empty.read_bytes() == b""
    assert sorted(os.listdir(tmp_path)) == ["empty.db", "s.yaml", "steps.jsonl"]

    other = tmp_path / "other.db"
    with sqlite3.connect(other) as raw:
        raw.execute("CREATE TABLE notes (text TEXT)")
    before = other.read_bytes()
    assert verify(other).returncode == 2 and other.read_bytes() == before

    bwrap = find_bwrap()
    if bwrap is None:
        pytest.skip("bubblewrap is needed for a read-only mount")
    db = tmp_path / "audit.db"
    session = run_into(db, scenario)
    for suffix in ("-wal", "-shm"):  # as copied to read-only media: the file alone
        Path(f"{db}{suffix}").unlink(missing_ok=True)
    read_only = [bwrap, "--dev-bind", "/", "/", "--ro-bind", str(tmp_path), str(tmp_path), "--"]
    for command in (
        ["audit", "verify", str(db), "--signing-key", str(tmp_path / "key")],
        ["audit", "show", str(db), session, "--full"],
        ["audit", "export", str(db), "--jsonl"],
        ["replay", str(db), session],
    ):
        done = subprocess.run(
            [*read_only, *CMBS, *command], capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, (command, done.stderr)
    assert not Path(f"{db}-wal").exists() and not Path(f"{db}-shm").exists()


FILL = """
import resource, signal, sys
from cmbs_async.audit import Entry, RecordKind, SQLiteAuditStore, load_or_create_key
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG)
store = SQLiteAuditStore(sys.argv[1], key=load_or_create_key(sys.argv[2]))
store.open_session("s", {"scenario": {"id": "full"}})
store.append("s", [Entry(RecordKind.DECISION, 1, {"n": 1})])
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, hard))  # the disk is full
try:
    store.append("s", [Entry(RecordKind.DECISION, 2, {"big": "x" * (1 << 18)})])
except Exception as exc:
    print("failed:", type(exc).__name__)
resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))  # room again
store.append("s", [Entry(RecordKind.DECISION, 3, {"n": 3})])
print("intact:", store.verify().intact)
"""


def test_a_failed_commit_rolls_the_head_back(tmp_path: Path) -> None:
    """A real write failure (the file size limit, as a full disk): the append fails, the
    next one continues from what is on disk, and the database verifies."""
    db = tmp_path / "audit.db"
    done = subprocess.run(
        [sys.executable, "-c", FILL, str(db), str(tmp_path / "key")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.stdout.splitlines() == ["failed: AuditError", "intact: True"], done.stderr
    store = SQLiteAuditStore(db, read_only=True)
    try:
        steps = [r.step for r in store.records("s")]
        assert steps == [None, 1, 3] and store.verify().intact
    finally:
        store.close()


def test_six_processes_creating_one_new_key_get_the_same_key(tmp_path: Path) -> None:
    key = tmp_path / "fresh" / "signing_key"
    program = (
        "import sys\n"
        "from cmbs_async.audit import load_or_create_key, public_key_text\n"
        "print(public_key_text(load_or_create_key(sys.argv[1])))\n"
    )

    def create(_: int) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-c", program, str(key)], capture_output=True, text=True, timeout=120
        )

    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(create, range(6)))
    assert all(r.returncode == 0 for r in results), [r.stderr for r in results]
    assert len({r.stdout for r in results}) == 1
    assert sorted(os.listdir(key.parent)) == ["signing_key"]
    assert oct(key.stat().st_mode & 0o777) == "0o600"


def test_unusable_key_paths_are_one_line(tmp_path: Path, scenario: list[str]) -> None:
    regular = tmp_path / "a-file"
    regular.write_text("x")
    done = cmbs(*scenario[:-1], str(regular / "key"), "--audit-db", str(tmp_path / "db"))
    assert done.returncode == 2 and done.stderr.count("\n") == 1
    assert "signing key" in done.stderr and "Not a directory" in done.stderr

    db = tmp_path / "audit.db"
    run_into(db, scenario)
    mistyped = tmp_path / "kye"
    done = verify(db, "--signing-key", str(mistyped))
    assert done.returncode == 2 and f"no signing key at {mistyped}" in done.stderr
    assert not mistyped.exists()
    done = verify(db, "--public-key", "not-a-key")
    assert done.returncode == 2 and "invalid key" in done.stderr and "TAMPERED" not in done.stdout


def test_a_trail_written_before_the_log_gets_one_when_written_again(tmp_path: Path) -> None:
    db = tmp_path / "audit.db"
    shutil.copy(Path(__file__).parent / "data" / "audit_trail_v0.db", db)
    old = SQLiteAuditStore(db, read_only=True)
    assert old.verify().intact and old.log_state()[0] == 0
    old.close()
    key = load_or_create_key(tmp_path / "key")
    store = SQLiteAuditStore(db, key=key)
    try:
        records = sum(1 for _ in store.records())
        assert records > 0
        store.open_session("new", {"scenario": {"id": "n"}})
        store.append("new", [Entry(RecordKind.END, None, {"outcome": "x"})])
        assert store.log_state()[0] == records + 2
        # one log over sessions of two keys: no one key vouches for all of it
        report = store.verify()
        assert report.key == public_key_text(key) and report.pinned
        assert [p.split(":")[0] for p in report.problems] == [
            "session checkpoints",
            "session demo",
            "session reviewed",
        ]
        old = f"signed by key {key_id(V0_KEY)}, not the trusted key"
        assert all(old in problem for problem in report.problems)
        assert not store.verify(trusted_key=V0_KEY).intact  # the new session and the head
    finally:
        store.close()


def test_batch_writes_a_checkpoint_and_a_read_only_key_folder_is_one_line(
    tmp_path: Path, scenario: list[str]
) -> None:
    db, head = tmp_path / "audit.db", tmp_path / "head.json"
    done = cmbs(
        "batch", scenario[1], scenario[2], scenario[3], "--out", str(tmp_path / "r.jsonl"),
        "--audit-db", str(db), "--head-out", str(head),
    )  # fmt: skip
    assert done.returncode == 3, done.stderr
    assert json.loads(head.read_text())["size"] == 5
    assert verify(db, "--head", str(head)).returncode == 0
    refused = cmbs(
        "batch", scenario[1], scenario[2], scenario[3], "--no-audit", "--head-out", str(head)
    )  # fmt: skip
    assert refused.returncode == 2 and "--head-out needs the audit trail" in refused.stderr

    bwrap = find_bwrap()
    if bwrap is None:
        pytest.skip("bubblewrap is needed for a read-only mount")
    keys = tmp_path / "keys"
    keys.mkdir()
    read_only = [bwrap, "--dev-bind", "/", "/", "--ro-bind", str(keys), str(keys), "--"]
    done = subprocess.run(
        [*read_only, *CMBS, *scenario[:-1], str(keys / "new"), "--audit-db", str(db)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "cannot create signing key" in done.stderr and "Read-only file system" in done.stderr
