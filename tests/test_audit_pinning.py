"""The audit trail pinned to the operator's key (issue 22, item 4).

Every attack is done for real, with SQLite, on a database that real ``cmbs demo`` runs
wrote, and checked with the real CLI: ``cmbs audit verify`` trusts only a key given from
outside the database (``--public-key``, ``--signing-key``, a ``--head`` checkpoint, or the
operator's default signing key) and says TAMPERED, exit 1, a reason per line; ``show`` and
``replay`` refuse in one line; nothing ends in a traceback.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from cmbs_async import run_scenario
from cmbs_async.audit import SQLiteAuditStore, load_or_create_key, public_key_text
from cmbs_async.audit.log import GENESIS, chain, key_id, log_head_bytes
from cmbs_async.audit.signing import canonical, digest, sign
from cmbs_async.demo import demo_agent, demo_scenario

from .helpers import CMBS


def cmbs(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CMBS, *args], capture_output=True, text=True, timeout=120, env=env, check=False
    )


def data_home(folder: Path, key: Path | None = None) -> dict[str, str]:
    """An environment whose default data dir is ``folder`` (holding ``key`` as the
    operator's default signing key, if given)."""
    if key is not None:
        (folder / "cmbs").mkdir(parents=True, exist_ok=True)
        shutil.copy(key, folder / "cmbs" / "signing_key")
        (folder / "cmbs" / "signing_key").chmod(0o600)
    return os.environ | {"XDG_DATA_HOME": str(folder)}


@pytest.fixture(scope="module")
def honest(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two real ``cmbs demo`` runs (asyncio, then trio) into one database, signed with the
    operator's key ``key`` beside it; ``head.json`` is the checkpoint after the first,
    ``operator.pub`` the key's public half as ``cmbs audit key`` prints it."""
    folder = tmp_path_factory.mktemp("honest")
    db, key = folder / "audit.db", folder / "key"
    env = data_home(folder / "data")
    for extra in (["--head-out", str(folder / "head.json")], ["--backend", "trio"]):
        done = cmbs("demo", "--audit-db", str(db), "--signing-key", str(key), *extra, env=env)
        assert done.returncode == 0, done.stderr
    printed = cmbs("audit", "key", "--signing-key", str(key), env=env)
    assert printed.returncode == 0 and printed.stdout.count("\n") == 1
    (folder / "operator.pub").write_text(printed.stdout)
    return db


@pytest.fixture
def copy(honest: Path, tmp_path: Path) -> Path:
    """A copy of the honest database to attack."""
    for written in honest.parent.glob("audit.db*"):  # with any WAL file
        shutil.copy(written, tmp_path / written.name)
    return tmp_path / "audit.db"


def sessions_of(db: Path) -> list[str]:
    with sqlite3.connect(db) as conn:
        return [row[0] for row in conn.execute("SELECT session_id FROM sessions ORDER BY rowid")]


def operator(honest: Path) -> Ed25519PrivateKey:
    return load_or_create_key(honest.parent / "key")


# --- what an attacker with write access to the file (and a key of their own) does ---------


def resign_session(conn: sqlite3.Connection, session_id: str, key: Ed25519PrivateKey) -> None:
    """Every record of the session re-chained and re-signed with ``key``, its public key
    (in the sessions row and in its first record) made ``key``'s, its head re-signed."""
    public = public_key_text(key)
    rows = conn.execute(
        "SELECT seq, body FROM records WHERE session_id = ? ORDER BY seq", (session_id,)
    ).fetchall()
    previous = GENESIS
    for seq, body in rows:
        parsed = json.loads(body) | {"prev": previous}
        if seq == 0:
            parsed["data"]["public_key"] = public
        rewritten = canonical(parsed)
        previous = digest(rewritten)
        conn.execute(
            "UPDATE records SET body = ?, hash = ?, signature = ? WHERE session_id = ? AND seq = ?",
            (rewritten.decode(), previous, sign(key, rewritten), session_id, seq),
        )
    head = canonical({"head": session_id, "seq": len(rows) - 1, "hash": previous})
    conn.execute(
        "UPDATE sessions SET public_key = ?, head_hash = ?, head_signature = ? "
        "WHERE session_id = ?",
        (public, previous, sign(key, head), session_id),
    )


def rebuild_log(conn: sqlite3.Connection, key: Ed25519PrivateKey) -> None:
    """The log made again over the records there are now, its head signed with ``key``."""
    order = conn.execute(
        "SELECT r.session_id, r.seq, r.hash FROM records r JOIN sessions s "
        "ON s.session_id = r.session_id ORDER BY s.rowid, r.seq"
    ).fetchall()
    conn.execute("DELETE FROM log")
    root = GENESIS
    for pos, (session_id, seq, record_hash) in enumerate(order):
        root = chain(root, [record_hash])
        conn.execute("INSERT INTO log VALUES (?, ?, ?, ?)", (pos, session_id, seq, root))
    sign_log_head(conn, key, len(order), root)


def sign_log_head(conn: sqlite3.Connection, key: Ed25519PrivateKey, size: int, root: str) -> None:
    conn.execute("DELETE FROM log_head")
    conn.execute(
        "INSERT INTO log_head VALUES (0, ?, ?, ?, ?)",
        (size, root, public_key_text(key), sign(key, log_head_bytes(size, root))),
    )


def delete_session(conn: sqlite3.Connection, session_id: str) -> None:
    for table in ("records", "sessions", "log"):
        conn.execute(f"DELETE FROM {table} WHERE session_id = ?", (session_id,))  # noqa: S608


def rebuild_table(conn: sqlite3.Connection, table: str, definition: str) -> None:
    """``table`` made again from ``definition`` (a column list), its rows copied over."""
    conn.execute(f"ALTER TABLE {table} RENAME TO old_{table}")
    conn.execute(f"CREATE TABLE {table} ({definition})")
    conn.execute(f"INSERT INTO {table} SELECT * FROM old_{table}")  # noqa: S608
    conn.execute(f"DROP TABLE old_{table}")


# --- the honest database --------------------------------------------------------------


def test_the_honest_database_verifies_against_the_operators_key_however_it_is_given(
    honest: Path, tmp_path: Path
) -> None:
    folder = honest.parent
    key = operator(honest)
    pem = tmp_path / "operator.pem"
    pem.write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    env = data_home(tmp_path / "nokey")
    for trust in (
        ["--public-key", str(folder / "operator.pub")],
        ["--public-key", str(pem)],
        ["--public-key", public_key_text(key)],
        ["--signing-key", str(folder / "key")],
        ["--head", str(folder / "head.json")],
        ["--public-key", str(folder / "operator.pub"), "--head", str(folder / "head.json")],
    ):
        done = cmbs("audit", "verify", str(honest), *trust, env=env)
        assert done.returncode == 0, (trust, done.stdout, done.stderr)
        assert "2 session(s)" in done.stdout and "intact" in done.stdout
        assert f"the trusted key {key_id(public_key_text(key))}" in done.stdout
    # nothing given: the operator's own signing key, where runs make it by default
    done = cmbs("audit", "verify", str(honest), env=data_home(tmp_path / "own", folder / "key"))
    assert done.returncode == 0 and "intact" in done.stdout and "the signing key" in done.stdout

    # no key anywhere: nothing is called intact on the database's own say-so
    done = cmbs("audit", "verify", str(honest), env=env)
    assert done.returncode == 2 and done.stdout == "" and done.stderr.count("\n") == 1
    assert "no key to check the signatures against" in done.stderr

    # another key, however given: every session and the head are someone else's
    other = tmp_path / "other"
    load_or_create_key(other)
    for trust in (
        ["--signing-key", str(other)],
        ["--public-key", public_key_text(load_or_create_key(other))],
    ):
        done = cmbs("audit", "verify", str(honest), *trust, env=env)
        assert done.returncode == 1
        tampered = [line for line in done.stdout.splitlines() if line.startswith("TAMPERED: ")]
        assert len(tampered) == 3 and "not the trusted key" in done.stdout  # 2 sessions, head

    store = SQLiteAuditStore(honest, read_only=True)
    try:
        pinned = store.verify(trusted_key=public_key_text(key))
        assert pinned.intact and pinned.pinned and pinned.records > 60
        unpinned = store.verify()
        assert unpinned.intact and not unpinned.pinned
        assert unpinned.key == public_key_text(key)
    finally:
        store.close()


# --- the attacks ------------------------------------------------------------------------

Conn, Key = sqlite3.Connection, Ed25519PrivateKey
#: An attack: the open database, the attacker's key, the operator's, the session ids.
Attack = Callable[[Conn, Key, Key, list[str]], None]


def _rebuilt_after_a_deletion(conn: Conn, attacker: Key, own: Key, sessions: list[str]) -> None:
    delete_session(conn, sessions[0])
    rebuild_log(conn, attacker)


def _head_by_another_key(conn: Conn, attacker: Key, own: Key, sessions: list[str]) -> None:
    size, root = conn.execute("SELECT size, root FROM log_head").fetchone()
    sign_log_head(conn, attacker, size, root)


def _session_resigned(conn: Conn, attacker: Key, own: Key, sessions: list[str]) -> None:
    resign_session(conn, sessions[1], attacker)
    rebuild_log(conn, attacker)


def _session_resigned_log_kept(conn: Conn, attacker: Key, own: Key, sessions: list[str]) -> None:
    resign_session(conn, sessions[1], attacker)


def _records_signed_by_a_second_key(
    conn: Conn, attacker: Key, own: Key, sessions: list[str]
) -> None:
    for seq, body in conn.execute(
        "SELECT seq, body FROM records WHERE session_id = ?", (sessions[0],)
    ).fetchall():
        conn.execute(
            "UPDATE records SET signature = ? WHERE session_id = ? AND seq = ?",
            (sign(attacker, body.encode()), sessions[0], seq),
        )


def _everything_resigned(conn: Conn, attacker: Key, own: Key, sessions: list[str]) -> None:
    for session_id in sessions:
        resign_session(conn, session_id, attacker)
    rebuild_log(conn, attacker)


def _session_deleted(conn: Conn, attacker: Key, own: Key, sessions: list[str]) -> None:
    conn.execute("DELETE FROM records WHERE session_id = ?", (sessions[0],))
    conn.execute("DELETE FROM sessions WHERE session_id = ?", (sessions[0],))


def _session_row_deleted(conn: Conn, attacker: Key, own: Key, sessions: list[str]) -> None:
    conn.execute("DELETE FROM sessions WHERE session_id = ?", (sessions[1],))


def _session_duplicated(conn: Conn, attacker: Key, own: Key, sessions: list[str]) -> None:
    rebuild_table(
        conn,
        "sessions",
        "session_id TEXT, public_key TEXT NOT NULL, head_seq INTEGER NOT NULL, "
        "head_hash TEXT NOT NULL, head_signature TEXT NOT NULL",
    )
    conn.execute("INSERT INTO sessions SELECT * FROM sessions WHERE session_id = ?", (sessions[0],))


def _record_duplicated(conn: Conn, attacker: Key, own: Key, sessions: list[str]) -> None:
    rebuild_table(
        conn,
        "records",
        "session_id TEXT NOT NULL, seq INTEGER NOT NULL, kind TEXT NOT NULL, step INTEGER, "
        "body TEXT NOT NULL, hash TEXT NOT NULL, signature TEXT NOT NULL",
    )
    conn.execute(
        "INSERT INTO records SELECT * FROM records WHERE session_id = ? AND seq = 1",
        (sessions[0],),
    )


def _log_position_duplicated(conn: Conn, attacker: Key, own: Key, sessions: list[str]) -> None:
    rebuild_table(
        conn, "log", "pos INTEGER, session_id TEXT NOT NULL, seq INTEGER NOT NULL, root TEXT"
    )
    conn.execute("INSERT INTO log SELECT * FROM log WHERE pos = 3")


def _head_without_its_check(conn: Conn, attacker: Key, own: Key, sessions: list[str]) -> None:
    rebuild_table(
        conn,
        "log_head",
        "id INTEGER PRIMARY KEY, size INTEGER NOT NULL, root TEXT NOT NULL, "
        "public_key TEXT NOT NULL, signature TEXT NOT NULL",
    )


def _records_with_another_column(conn: Conn, attacker: Key, own: Key, sessions: list[str]) -> None:
    conn.execute("ALTER TABLE records ADD COLUMN note TEXT")


def _a_column_dropped(conn: Conn, attacker: Key, own: Key, sessions: list[str]) -> None:
    conn.execute("ALTER TABLE records DROP COLUMN signature")


def _a_trigger(conn: Conn, attacker: Key, own: Key, sessions: list[str]) -> None:
    conn.execute(
        "CREATE TRIGGER quiet AFTER INSERT ON records BEGIN DELETE FROM records "
        "WHERE kind = 'decision'; END"
    )


def _log_dropped(conn: Conn, attacker: Key, own: Key, sessions: list[str]) -> None:
    conn.execute("DROP TABLE log")


def _a_view_for_records(conn: Conn, attacker: Key, own: Key, sessions: list[str]) -> None:
    conn.execute("ALTER TABLE records RENAME TO kept")
    conn.execute("CREATE VIEW records AS SELECT * FROM kept WHERE kind != 'observation'")


def _a_column_of_the_wrong_type(conn: Conn, attacker: Key, own: Key, sessions: list[str]) -> None:
    conn.execute("UPDATE records SET step = 'one' WHERE session_id = ? AND seq = 1", (sessions[0],))


def _verdict_removed(conn: Conn, attacker: Key, own: Key, sessions: list[str]) -> None:
    body = conn.execute(
        "SELECT body FROM records WHERE session_id = ? AND kind = 'decision' ORDER BY seq",
        (sessions[0],),
    ).fetchone()[0]
    parsed = json.loads(body)
    del parsed["data"]["verdict"]
    conn.execute(
        "UPDATE records SET body = ? WHERE session_id = ? AND body = ?",
        (json.dumps(parsed), sessions[0], body),
    )


def _wrong_shape_signed_by_the_operator(
    conn: Conn, attacker: Key, own: Key, sessions: list[str]
) -> None:
    """An insider with the key: a record of no record's shape, signed and chained."""
    body = conn.execute(
        "SELECT body FROM records WHERE session_id = ? AND seq = 2", (sessions[1],)
    ).fetchone()[0]
    parsed = json.loads(body)
    parsed["data"] = ["not", "an", "object"]
    parsed.pop("ts")
    rewritten = json.dumps(parsed)
    conn.execute(
        "UPDATE records SET body = ? WHERE session_id = ? AND seq = 2", (rewritten, sessions[1])
    )
    resign_session(conn, sessions[1], own)
    rebuild_log(conn, own)


ATTACKS: list[tuple[str, Attack, list[str]]] = [
    (
        "a session deleted, the log rebuilt and its head signed by another key",
        _rebuilt_after_a_deletion,
        ["the log's head is signed by key {attacker}, not the trusted key {operator}"],
    ),
    (
        "the log head signed by another key",
        _head_by_another_key,
        ["the log's head is signed by key {attacker}, not the trusted key {operator}"],
    ),
    (
        "a session re-signed with a second key, the log rebuilt",
        _session_resigned,
        [
            "session {1}: signed by key {attacker}, not the trusted key {operator}",
            "the log's head is signed by key {attacker}",
        ],
    ),
    (
        "a session re-signed with a second key, the log kept",
        _session_resigned_log_kept,
        [
            "session {1}: signed by key {attacker}, not the trusted key {operator}",
            "the log does not follow from its records: rewritten",
        ],
    ),
    (
        "a session's records signed by a second key under the operator's name",
        _records_signed_by_a_second_key,
        ["session {0} record 0: bad signature: edited or forged"],
    ),
    (
        "every session and the log re-signed by another key",
        _everything_resigned,
        [
            "session {0}: signed by key {attacker}, not the trusted key {operator}",
            "session {1}: signed by key {attacker}, not the trusted key {operator}",
            "the log's head is signed by key {attacker}",
        ],
    ),
    (
        "a session deleted",
        _session_deleted,
        ["log position 0: session {0} record 0 is missing: deleted"],
    ),
    (
        "a session's row deleted",
        _session_row_deleted,
        ["session {1}: records without a session entry"],
    ),
    (
        "the sessions table rebuilt without its primary key, a session duplicated",
        _session_duplicated,
        [
            "the schema: table sessions has no primary key (the schema's is session_id): rebuilt",
            "session {0} is in the sessions table 2 times: duplicated",
        ],
    ),
    (
        "the records table rebuilt without its primary key, a record duplicated",
        _record_duplicated,
        [
            "the schema: table records has no primary key",
            "session {0} record 1 is there 2 times: duplicated",
        ],
    ),
    (
        "the log rebuilt without its primary key, a position duplicated",
        _log_position_duplicated,
        ["the schema: table log has no primary key", "log position 3 is there 2 times"],
    ),
    (
        "the log head rebuilt without its CHECK",
        _head_without_its_check,
        ["the schema: table log_head is defined otherwise than the schema"],
    ),
    (
        "the records table with another column",
        _records_with_another_column,
        ["the schema: table records has columns session_id, seq, kind, step, body, hash, "],
    ),
    (
        "the records table without its signature column",
        _a_column_dropped,
        [
            "the schema: table records has columns session_id, seq, kind, step, body, hash, not",
            "the tables cannot be read as the store's (no such column: signature): rebuilt",
        ],
    ),
    (
        "a trigger added",
        _a_trigger,
        ["the schema: trigger 'quiet' on 'records' is not the store's: added"],
    ),
    (
        "the log dropped, its head kept",
        _log_dropped,
        ["the schema: table log is missing, log_head is there: removed"],
    ),
    (
        "the records table replaced by a view",
        _a_view_for_records,
        ["the schema: records is a view, not a table: replaced"],
    ),
    (
        "a column of the wrong type",
        _a_column_of_the_wrong_type,
        ["session {0} record 1: a column holds a value of the wrong type: edited"],
    ),
    (
        "a record of the wrong shape (a decision without its verdict)",
        _verdict_removed,
        ["its content does not match its hash: edited"],
    ),
    (
        "a record of the wrong shape, signed with the operator's own key",
        _wrong_shape_signed_by_the_operator,
        ["session {1} record 2: not of a record's shape (its fields are not a record's (no ts))"],
    ),
]


@pytest.mark.parametrize(
    ("attack", "findings"), [a[1:] for a in ATTACKS], ids=[a[0] for a in ATTACKS]
)
def test_each_attack_is_tampering_with_a_reason(
    honest: Path, copy: Path, tmp_path: Path, attack: Attack, findings: list[str]
) -> None:
    own, attacker = operator(honest), Ed25519PrivateKey.generate()
    sessions = sessions_of(copy)
    with sqlite3.connect(copy) as conn:
        attack(conn, attacker, own, sessions)
    conn.close()
    names = {
        "attacker": key_id(public_key_text(attacker)),
        "operator": key_id(public_key_text(own)),
    }
    expected = [finding.format(*sessions, **names) for finding in findings]
    folder = honest.parent
    for trust, env in (
        (["--public-key", str(folder / "operator.pub")], None),
        (["--head", str(folder / "head.json")], None),
        ([], data_home(tmp_path / "data", folder / "key")),  # the operator's default key
    ):
        done = cmbs("audit", "verify", str(copy), *trust, env=env)
        if trust[:1] == ["--head"] and attack is _records_signed_by_a_second_key:
            # Not one byte of what the checkpoint covered changed: its signed root, and
            # the session's head (signed by the trusted key), bind every record's hash;
            # the records' own signatures are then not checked again (docs/concepts/audit.md).
            assert done.returncode == 0 and "intact" in done.stdout, done.stdout
            continue
        assert done.returncode == 1, (trust, done.stdout, done.stderr)
        assert "Traceback" not in done.stderr and done.stderr == ""
        *lines, summary = done.stdout.splitlines()
        assert lines and all(line.startswith("TAMPERED: ") for line in lines), done.stdout
        assert "intact" not in summary and "problem(s)" in summary
        if trust[:1] != ["--head"]:  # the checkpoint adds findings of its own
            for finding in expected:
                assert any(finding in line for line in lines), (finding, done.stdout)


@pytest.mark.parametrize(
    ("attack", "attacked"),
    [
        (_session_duplicated, None),  # None: the tables themselves, every reading refused
        (_record_duplicated, None),
        (_a_trigger, None),
        (_a_column_of_the_wrong_type, 0),  # the index of the one session attacked
        (_verdict_removed, 0),
        (_wrong_shape_signed_by_the_operator, 1),
    ],
)
def test_show_and_replay_refuse_a_tampered_database_in_one_line(
    honest: Path, copy: Path, attack: Attack, attacked: int | None
) -> None:
    sessions = sessions_of(copy)
    with sqlite3.connect(copy) as conn:
        attack(conn, Ed25519PrivateKey.generate(), operator(honest), sessions)
    conn.close()
    for index, command in (
        (None, ["audit", "show", str(copy)]),  # the listing reads every session
        (0, ["audit", "show", str(copy), sessions[0][:8]]),
        (1, ["audit", "show", str(copy), sessions[1][:8], "--full"]),
        (0, ["replay", str(copy), sessions[0]]),
        (1, ["replay", str(copy), sessions[1]]),
    ):
        done = cmbs(*command)
        assert "Traceback" not in done.stderr, done.stderr
        if attacked is not None and index not in (None, attacked):
            assert done.returncode == 0, (command, done.stderr)  # the other session reads
            continue
        assert done.returncode == 2, (command, done.stdout, done.stderr)
        assert done.stderr.count("\n") == 1 and "TAMPERED" in done.stderr, done.stderr


def _edit_record(
    db: Path, session_id: str, kind: str, edit: Callable[[dict[str, Any]], None]
) -> None:
    """Edit the first record of ``kind`` and re-hash it (no key needed for that): the chain
    is re-linked, so only a signature, or what readers need of the record, can tell."""
    with sqlite3.connect(db) as conn:
        rows = conn.execute(
            "SELECT seq, kind, body FROM records WHERE session_id = ? ORDER BY seq", (session_id,)
        ).fetchall()
        previous, done = GENESIS, False
        for seq, row_kind, body in rows:
            parsed = json.loads(body) | {"prev": previous}
            if row_kind == kind and not done:
                edit(parsed["data"])
                done = True
            rewritten = canonical(parsed).decode()
            previous = digest(rewritten.encode())
            conn.execute(
                "UPDATE records SET body = ?, hash = ? WHERE session_id = ? AND seq = ?",
                (rewritten, previous, session_id, seq),
            )
        conn.execute(
            "UPDATE sessions SET head_hash = ? WHERE session_id = ?", (previous, session_id)
        )
    conn.close()


@pytest.mark.parametrize(
    ("kind", "edit", "said"),
    [
        ("decision", lambda data: data.pop("verdict"), "its data has no verdict"),
        (
            "decision",
            lambda data: data.update(message=["a", "list"]),
            "its message is of the wrong type",
        ),
        ("step", lambda data: data.pop("raw"), "its data has no raw message"),
        ("observation", lambda data: data.update(stdout="text"), "its stdout is of the wrong type"),
        (
            "observation",
            lambda data: data.update(success="maybe"),
            "not of its kind's shape (success",
        ),
        ("session", lambda data: data.update(scenario="text"), "its scenario is of the wrong type"),
        ("session", lambda data: data.update(profile={"nope": 1}), "its profile is not one"),
        ("end", lambda data: data.pop("outcome"), "its data has no outcome"),
    ],
)
def test_a_rehashed_record_of_the_wrong_shape_is_one_line_in_show_and_replay(
    honest: Path,
    copy: Path,
    kind: str,
    edit: Callable[[dict[str, Any]], None],
    said: str,
) -> None:
    session = sessions_of(copy)[0]
    _edit_record(copy, session, kind, edit)
    verified = cmbs("audit", "verify", str(copy), "--signing-key", str(honest.parent / "key"))
    assert verified.returncode == 1 and "bad signature: edited or forged" in verified.stdout
    outcomes = []
    for command in (
        ["audit", "show", str(copy)],
        ["audit", "show", str(copy), session, "--full"],
        ["replay", str(copy), session],
    ):
        done = cmbs(*command)
        assert "Traceback" not in done.stderr, done.stderr
        if done.returncode != 0:
            assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
        outcomes.append((done.returncode, done.stderr))
    # each reader refuses what it reads: show a session's table, replay its every record
    refused = [stderr for code, stderr in outcomes if code == 2]
    assert refused and all(said in stderr for stderr in refused), outcomes
    assert outcomes[2][0] == 2 or kind == "end"  # replay reads no end record


def test_a_checkpoint_nested_deep_or_endless_is_one_line(honest: Path, tmp_path: Path) -> None:
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 5000 + "]" * 5000)
    nested = tmp_path / "nested.json"
    checkpoint = json.loads((honest.parent / "head.json").read_text())
    value: object = "x"
    for _ in range(200):
        value = {"v": value}
    nested.write_text(json.dumps(checkpoint | {"time": value}))
    big = tmp_path / "big.json"
    big.write_text(" " * (1 << 20) + json.dumps(checkpoint))
    for path, said in (
        (deep, "nested deeper than 8 levels"),
        (nested, "nested deeper than 8 levels"),
        (Path("/dev/zero"), "larger than 64 KiB"),
        (big, "larger than 64 KiB"),
        (tmp_path / "absent.json", "cannot read"),
    ):
        done = cmbs("audit", "verify", str(honest), "--head", str(path))
        assert done.returncode == 2 and done.stdout == "", (path, done.stdout)
        assert done.stderr.count("\n") == 1 and said in done.stderr, done.stderr
        assert "Traceback" not in done.stderr


def test_a_public_key_file_that_is_not_one_is_one_line(honest: Path, tmp_path: Path) -> None:
    wrong = tmp_path / "wrong.pub"
    wrong.write_text("hello\n")
    rsa = tmp_path / "rsa.pem"
    rsa.write_text("-----BEGIN PUBLIC KEY-----\nAAAA\n-----END PUBLIC KEY-----\n")
    for value, said in (
        (str(wrong), "invalid key"),
        (str(rsa), "invalid key"),
        ("/dev/zero", "larger than 16 KiB"),
        (str(tmp_path), "Is a directory"),
        ("c2hvcnQ=", "invalid key"),
    ):
        done = cmbs("audit", "verify", str(honest), "--public-key", value)
        assert done.returncode == 2 and done.stdout == "", (value, done.stdout)
        assert done.stderr.count("\n") == 1 and said in done.stderr, done.stderr


def test_export_of_a_body_that_is_not_json_is_as_stored(copy: Path) -> None:
    with sqlite3.connect(copy) as conn:
        conn.execute("UPDATE records SET body = ? WHERE seq = 1", ("[" * 5000,))
        conn.execute("UPDATE records SET body = 'not json' WHERE seq = 2")
    conn.close()
    done = cmbs("audit", "export", str(copy), "--jsonl")
    assert done.returncode == 0 and "Traceback" not in done.stderr
    bodies = [json.loads(line)["body"] for line in done.stdout.splitlines()]
    assert "not json" in bodies and "[" * 5000 in bodies


@pytest.mark.anyio
async def test_a_run_in_process_then_re_signed_by_another_key_is_tampered(
    tmp_path: Path,
) -> None:
    """On both event loops: a real run, its database re-signed whole by another key; the
    library's unpinned check (one key throughout) cannot tell, the operator's key can."""
    key_path = tmp_path / "key"
    store = SQLiteAuditStore(tmp_path / "audit.db", key=load_or_create_key(key_path))
    try:
        result = await run_scenario(demo_scenario(), agent=demo_agent(), audit=store)
    finally:
        store.close()
    assert result.session_id is not None
    verify = [*CMBS, "audit", "verify", str(tmp_path / "audit.db"), "--signing-key", str(key_path)]
    done = await anyio.run_process(verify, check=False)
    assert done.returncode == 0 and b"intact" in done.stdout

    attacker = Ed25519PrivateKey.generate()
    with sqlite3.connect(tmp_path / "audit.db") as conn:
        resign_session(conn, result.session_id, attacker)
        rebuild_log(conn, attacker)
    conn.close()
    reader = SQLiteAuditStore(tmp_path / "audit.db", read_only=True)
    try:
        assert reader.verify().intact and not reader.verify().pinned  # one key: whose?
        pinned = reader.verify(trusted_key=public_key_text(load_or_create_key(key_path)))
        assert not pinned.intact and len(pinned.problems) == 2
    finally:
        reader.close()
    done = await anyio.run_process(verify, check=False)
    assert done.returncode == 1
    lines = done.stdout.decode().splitlines()
    assert [line.split(":")[0] for line in lines[:-1]] == ["TAMPERED", "TAMPERED"]
    assert f"signed by key {key_id(public_key_text(attacker))}" in lines[0]
