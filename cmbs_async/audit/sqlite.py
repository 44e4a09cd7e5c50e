"""The embedded audit store: SQLite in WAL mode, every record signed and hash-chained.

Each record's body is canonical JSON holding its session, sequence number, kind, step,
time, the previous record's hash and its data; the row keeps the body, its SHA-256 and
an Ed25519 signature of the body. Each session keeps a signed head (last sequence number
and hash), updated in the same transaction as every append. Any edited byte, deleted,
inserted, reordered or forged record, and a cut-off tail, fail verification.

Every record also takes the next position of one log over all sessions (see
:mod:`cmbs_async.audit.log`), whose signed head is updated in the same transaction: a
whole session deleted fails verification too, and a checkpoint kept elsewhere proves
that nothing it covered was removed or rewritten. Reading (``verify``, ``show``,
``export``, ``replay``) opens the file read-only and never creates anything.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from pydantic import ValidationError

from .log import GENESIS, chain, key_id, log_head_bytes, make_checkpoint
from .shape import body_problem
from .signing import canonical, digest, load_public_key, public_key_text, sign, verify_signature
from .store import AuditError, AuditRecord, Entry, RecordKind, StepHistory

__all__ = ["SQLiteAuditStore", "VerifyReport"]

#: seconds a write waits for another connection's lock (its transactions take milliseconds)
DEFAULT_BUSY_TIMEOUT = 2.0
_SCHEMA = """
CREATE TABLE IF NOT EXISTS sessions (
    session_id TEXT PRIMARY KEY,
    public_key TEXT NOT NULL,
    head_seq INTEGER NOT NULL,
    head_hash TEXT NOT NULL,
    head_signature TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS records (
    session_id TEXT NOT NULL,
    seq INTEGER NOT NULL,
    kind TEXT NOT NULL,
    step INTEGER,
    body TEXT NOT NULL,
    hash TEXT NOT NULL,
    signature TEXT NOT NULL,
    PRIMARY KEY (session_id, seq)
);
CREATE TABLE IF NOT EXISTS log (
    pos INTEGER PRIMARY KEY,
    session_id TEXT NOT NULL,
    seq INTEGER NOT NULL,
    root TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS log_head (
    id INTEGER PRIMARY KEY CHECK (id = 0),
    size INTEGER NOT NULL,
    root TEXT NOT NULL,
    public_key TEXT NOT NULL,
    signature TEXT NOT NULL
);
"""


#: The tables the store makes; ``log`` and ``log_head`` are absent from a database
#: written before the log existed (both, or it is not one).
_TABLES = ("sessions", "records", "log", "log_head")
_RECORD_ROWS = (
    "SELECT session_id, seq, kind, step, body, hash, signature FROM records "
    "ORDER BY session_id, seq"
)
#: What each column of a row read back must be: Python types, ``None`` where allowed.
_ROW_TYPES: dict[str, tuple[tuple[type, ...], ...]] = {
    "sessions": ((str,), (str,), (int,), (str,), (str,)),
    "records": ((str,), (int,), (str,), (int, type(None)), (str,), (str,), (str,)),
    "log": ((int,), (str,), (int,), (str,)),
    "log_head": ((int,), (str,), (str,), (str,)),
}
_COLUMNS = {
    "sessions": ("session_id", "public_key", "head_seq", "head_hash", "head_signature"),
    "records": ("session_id", "seq", "kind", "step", "body", "hash", "signature"),
    "log": ("pos", "session_id", "seq", "root"),
    "log_head": ("size", "root", "public_key", "signature"),
}
_SQL_TYPES = {str: "'text'", int: "'integer'", type(None): "'null'"}
#: ``SELECT 1`` if any row of the table holds a value of a type :data:`_ROW_TYPES` forbids.
_MISTYPED = {
    table: f"SELECT 1 FROM {table} WHERE NOT ("  # noqa: S608 - the names are ours
    + " AND ".join(
        f"typeof({column}) IN ({', '.join(_SQL_TYPES[kind] for kind in allowed)})"
        for column, allowed in zip(_COLUMNS[table], _ROW_TYPES[table], strict=True)
    )
    + ") LIMIT 1"
    for table in _ROW_TYPES
}


@dataclass(frozen=True)
class VerifyReport:
    """What ``verify`` found: no problems means intact.

    ``key`` is the public key every session and the log head were required to be signed
    by; ``pinned`` says it was given from outside the database (a trusted key, a
    checkpoint's, the store's own signing key) rather than taken from its log head.
    """

    sessions: int
    records: int
    problems: tuple[str, ...]
    key: str | None = None
    pinned: bool = False

    @property
    def intact(self) -> bool:
        return not self.problems


class SQLiteAuditStore:
    """An :class:`AuditStore`, plus the seed's checkpoint interface, listing, export and
    verification. Thread-safe; writing needs ``key`` (reading and verifying do not).

    A write waits at most ``busy_timeout`` seconds for another connection's lock, then
    fails; the runtime stops waiting for a write at the run's deadline in any case.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        key: Ed25519PrivateKey | None = None,
        busy_timeout: float = DEFAULT_BUSY_TIMEOUT,
        read_only: bool = False,
    ) -> None:
        self.path = Path(path)
        self._key = key
        self._public = public_key_text(key) if key is not None else None
        self._lock = threading.Lock()
        self._heads: dict[str, tuple[int, str]] = {}
        self.read_only = read_only
        if read_only:
            self._db = _open_read_only(self.path)
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.execute(f"PRAGMA busy_timeout={round(busy_timeout * 1000)}")
            self._db.executescript(_SCHEMA)
        except (sqlite3.Error, OSError) as exc:
            raise AuditError(f"cannot open audit database {self.path}: {exc}") from exc

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # -- writing ------------------------------------------------------------------
    def open_session(self, session_id: str, data: dict[str, Any]) -> None:
        """Start a session; its first record holds ``data`` and the public key."""
        with self._lock, self._transaction():
            self._open_locked(session_id, data)

    def add_session(self, session_id: str, entries: Sequence[Entry]) -> None:
        """Open ``session_id`` with ``entries`` (the first its session record's data, as
        :meth:`open_session` takes it) and append the rest, all in one durable transaction:
        a whole run recorded elsewhere lands whole or not at all."""
        if not entries or entries[0].kind != RecordKind.SESSION:
            raise AuditError(f"session {session_id}: its first record is not a session record")
        with self._lock, self._transaction():
            self._open_locked(session_id, entries[0].data)
            self._append_locked(session_id, entries[1:])

    def append(self, session_id: str, entries: Sequence[Entry]) -> None:
        """Append records in one durable transaction."""
        with self._lock, self._transaction():
            self._append_locked(session_id, entries)

    def head(self, session_id: str) -> str:
        """The hash of the session's last record, as committed (its signed head)."""
        with self._lock:
            try:
                return self._head(session_id)[1]
            except sqlite3.Error as exc:
                raise AuditError(f"cannot read audit database {self.path}: {exc}") from exc

    def checkpoint(self) -> dict[str, Any]:
        """The log's current size and root, signed with this store's key (see
        :func:`cmbs_async.audit.log.make_checkpoint`)."""
        if self._key is None:
            raise AuditError("a checkpoint is signed: open the store with a signing key")
        return make_checkpoint(self._key, *self.log_state())

    def log_state(self) -> tuple[int, str]:
        """The log's size and root as committed (``(0, GENESIS)`` for none)."""
        if not self._has_table("log"):
            return 0, GENESIS
        with self._lock:
            try:
                return self._log_state()
            except sqlite3.Error as exc:
                raise AuditError(f"cannot read audit database {self.path}: {exc}") from exc

    # -- the seed's checkpoint interface (beyond the AuditStore protocol) -----------
    def save_pre(self, session_id: str, step: int, commitment: dict[str, Any]) -> None:
        self.append(session_id, [Entry(RecordKind.PRE, step, commitment)])

    def save_post(self, session_id: str, step: int, assessment: dict[str, Any]) -> None:
        self.append(session_id, [Entry(RecordKind.POST, step, assessment)])

    def save_supervision(self, session_id: str, step: int, record: dict[str, Any]) -> None:
        self.append(session_id, [Entry(RecordKind.SUPERVISION, step, record)])

    def _open_locked(self, session_id: str, data: dict[str, Any]) -> None:
        if self._key is None or self._public is None:
            raise AuditError("this audit store was opened without a signing key")
        self._db.execute(
            "INSERT INTO sessions VALUES (?, ?, -1, ?, '')", (session_id, self._public, GENESIS)
        )
        self._heads[session_id] = (-1, GENESIS)
        self._append_locked(session_id, [Entry(RecordKind.SESSION, None, self.first(data))])

    def first(self, data: dict[str, Any]) -> dict[str, Any]:
        """A session's first record as this store writes it: ``data``, this store's public
        key, and that the record is in the log (signed with it: "I am logged")."""
        return {**data, "public_key": self._public, "log": True}

    def _append_locked(self, session_id: str, entries: Sequence[Entry]) -> None:
        if self._key is None:
            raise AuditError("this audit store was opened without a signing key")
        seq, previous = self._head(session_id)
        size, root = self._log_state()
        if size == 0:
            size, root = self._log_legacy_records()
        for kind, step, data in entries:
            name = RecordKind(kind).value  # refuses a kind the schema does not know
            seq += 1
            body = canonical(
                {
                    "session_id": session_id,
                    "seq": seq,
                    "kind": name,
                    "step": step,
                    "ts": round(time.time(), 6),
                    "prev": previous,
                    "data": data,
                }
            )
            previous = digest(body)
            signature = _sign(self._key, body)
            self._db.execute(
                "INSERT INTO records VALUES (?, ?, ?, ?, ?, ?, ?)",
                (session_id, seq, name, step, body.decode(), previous, signature),
            )
            root = chain(root, [previous])
            self._db.execute("INSERT INTO log VALUES (?, ?, ?, ?)", (size, session_id, seq, root))
            size += 1
        head = _sign(self._key, _head_bytes(session_id, seq, previous))
        self._db.execute(
            "UPDATE sessions SET head_seq = ?, head_hash = ?, head_signature = ? "
            "WHERE session_id = ?",
            (seq, previous, head, session_id),
        )
        self._sign_log_head(size, root)
        self._heads[session_id] = (seq, previous)

    def _log_state(self) -> tuple[int, str]:
        """The log's size and root as committed (read in the transaction: another
        process may have appended since this one last did)."""
        row = self._db.execute("SELECT pos, root FROM log ORDER BY pos DESC LIMIT 1").fetchone()
        return (int(row[0]) + 1, str(row[1])) if row else (0, GENESIS)

    def _sign_log_head(self, size: int, root: str) -> None:
        assert self._key is not None and self._public is not None
        self._db.execute(
            "INSERT OR REPLACE INTO log_head VALUES (0, ?, ?, ?, ?)",
            (size, root, self._public, _sign(self._key, log_head_bytes(size, root))),
        )

    def _log_legacy_records(self) -> tuple[int, str]:
        """With the log still empty, records written before it existed join it, in the
        order they were made (at the first append, in its transaction); the log's state."""
        size, root = 0, GENESIS
        rows = self._db.execute(
            "SELECT r.session_id, r.seq, r.hash, r.body FROM records r JOIN sessions s "
            "ON s.session_id = r.session_id ORDER BY s.rowid, r.seq"
        ).fetchall()
        if any(seq == 0 and _says_logged(body) for _, seq, _, body in rows):
            return size, root  # its log was removed: no new one hides that (verify says so)
        for session_id, seq, record_hash, _ in rows:
            root = chain(root, [record_hash])
            self._db.execute("INSERT INTO log VALUES (?, ?, ?, ?)", (size, session_id, seq, root))
            size += 1
        return size, root

    def _head(self, session_id: str) -> tuple[int, str]:
        if session_id not in self._heads:
            row = self._db.execute(
                "SELECT head_seq, head_hash FROM sessions WHERE session_id = ?", (session_id,)
            ).fetchone()
            if row is None:
                raise AuditError(f"no session {session_id} in {self.path}")
            self._heads[session_id] = (int(row[0]), str(row[1]))
        return self._heads[session_id]

    def _transaction(self) -> _Transaction:
        if self.read_only:
            raise AuditError(f"{self.path} was opened read-only")
        return _Transaction(self._db, self.path, self._heads)

    # -- reading ------------------------------------------------------------------
    def sessions(self) -> list[dict[str, Any]]:
        """Each session's id, scenario, first and last time, record count and outcome."""
        result = []
        for (session_id,) in self._query("SELECT session_id FROM sessions ORDER BY rowid"):
            records = list(self.records(session_id))
            first = records[0].data if records else {}
            if not isinstance(first.get("scenario", {}), dict):
                first = {}  # not what a session record holds: `show` says so
            end = next((r for r in reversed(records) if r.kind is RecordKind.END), None)
            result.append(
                {
                    "session_id": session_id,
                    "scenario_id": first.get("scenario", {}).get("id"),
                    "started": records[0].ts if records else None,
                    "records": len(records),
                    "outcome": end.data.get("outcome") if end else None,
                }
            )
        return result

    def session_ids(self) -> list[str]:
        """Every session's id, in the order they were opened (nothing else is read)."""
        rows = self._query("SELECT session_id FROM sessions ORDER BY rowid")
        return [str(session_id) for (session_id,) in rows]

    def records(self, session_id: str | None = None) -> Iterator[AuditRecord]:
        """Records in order (one session, or all sessions one after the other)."""
        if session_id is None:
            rows = self._query("SELECT body FROM records ORDER BY session_id, seq")
        else:
            rows = self._query(
                "SELECT body FROM records WHERE session_id = ? ORDER BY seq", (session_id,)
            )
        for (body,) in rows:
            try:
                yield AuditRecord.model_validate_json(body)
            except ValidationError as exc:
                raise AuditError(
                    f"cannot read audit database {self.path}: a record there is not an audit "
                    "record; `cmbs audit verify` says which"
                ) from exc

    def raw_rows(self) -> list[tuple[Any, ...]]:
        """Every stored row as it is, for export."""
        return self._query(_RECORD_ROWS)

    def step_history(self, session_id: str, step: int) -> StepHistory:
        records = tuple(r for r in self.records(session_id) if r.step == step)
        return StepHistory(session_id=session_id, step=step, records=records)

    def session_history(self, session_id: str) -> list[StepHistory]:
        by_step: dict[int, list[AuditRecord]] = {}
        for record in self.records(session_id):
            if record.step is not None:
                by_step.setdefault(record.step, []).append(record)
        return [
            StepHistory(session_id=session_id, step=step, records=tuple(records))
            for step, records in sorted(by_step.items())
        ]

    def _query(self, sql: str, args: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        with self._lock:
            try:
                return self._db.execute(sql, args).fetchall()
            except sqlite3.Error as exc:
                raise AuditError(f"cannot read audit database {self.path}: {exc}") from exc

    # -- verifying ----------------------------------------------------------------
    def verify(
        self, *, trusted_key: str | None = None, checkpoint: dict[str, Any] | None = None
    ) -> VerifyReport:
        """Check the tables against the schema, every record's shape, every session's
        chain, signatures and signed head, and the log over them: all signed by one key.

        That key is ``trusted_key`` (base64 Ed25519 public key) if given, else the
        ``checkpoint``'s, else this store's own signing key. A store opened without a key
        and given none takes its log head's key (or, before the log, its first session's):
        that proves one key signed everything, not whose key it was; only a key given from
        outside the database proves that (``VerifyReport.pinned``).
        With a ``checkpoint`` (see :meth:`checkpoint`, its signature already checked), the
        log must still hold exactly what it covered; those records' own signatures are
        then not checked again, since the signed root already binds their hashes.
        """
        problems = self.structure_problems()
        try:
            return self._verify(problems, trusted_key, checkpoint)
        except AuditError as exc:
            unread = _unreadable(problems, exc)
            pinned = trusted_key is not None
            return VerifyReport(0, 0, (*problems, unread), key=trusted_key, pinned=pinned)

    def _verify(
        self, problems: list[str], trusted_key: str | None, checkpoint: dict[str, Any] | None
    ) -> VerifyReport:
        sessions = self._typed(
            "sessions",
            "SELECT session_id, public_key, head_seq, head_hash, head_signature FROM sessions "
            "ORDER BY rowid",
            problems,
        )
        rows = self._typed("records", _RECORD_ROWS, problems)
        log = self._log_rows()
        if log is not None:
            positions: dict[int, tuple[Any, ...]] = {}
            for entry in self._well_typed("log", log, problems):
                positions.setdefault(entry[0], entry)  # a duplicate is a finding already
            log = list(positions.values())
        head = self._log_head()
        if head is not None and not _typed_rows("log_head", [head], problems):
            head = None
        heads: dict[str, tuple[Any, ...]] = {}
        for row in sessions:
            heads.setdefault(row[0], row)  # a duplicate is a finding already
        key, pinned = trusted_key, trusted_key is not None
        if key is None and checkpoint is not None:
            key, pinned = str(checkpoint["public_key"]), True
        if key is None and self._public is not None:
            key, pinned = self._public, True
        if key is None and head is not None:  # only the database names one: then at
            key = str(head[2])  # least one key must have signed it all
        elif key is None and heads:
            key = str(next(iter(heads.values()))[1])
        whose = "the trusted key" if pinned else "the log head's key"
        problems += _verify_log(rows, log, head, key, whose, checkpoint)
        covered: dict[str, int] = {}
        if checkpoint is not None and log is not None:
            for _, session_id, _, _ in log[: checkpoint["size"]]:
                covered[session_id] = covered.get(session_id, 0) + 1
        grouped: dict[str, dict[int, tuple[Any, ...]]] = {}
        for row in rows:
            grouped.setdefault(row[0], {}).setdefault(row[1], row)  # duplicates: found above
        for session_id in sorted(set(grouped) | set(heads)):
            problems += _verify_session(
                session_id,
                list(grouped.get(session_id, {}).values()),
                heads.get(session_id),
                key,
                whose,
                signed_from=covered.get(session_id, 0),
            )
        return VerifyReport(
            sessions=len(heads),
            records=len(rows),
            problems=tuple(problems),
            key=key,
            pinned=pinned,
        )

    def structure_problems(self) -> list[str]:
        """Findings that need no key, one line each: tables whose columns, keys or
        constraints differ from the schema the store makes, triggers it never makes, and
        rows its keys forbid (a session, a record or a log position twice).
        ``cmbs audit show`` and ``cmbs replay`` refuse a database with any."""
        with self._lock:
            try:
                return _structure_problems(self._db)
            except sqlite3.Error as exc:
                raise AuditError(f"cannot read audit database {self.path}: {exc}") from exc

    def integrity_problems(
        self, session_id: str | None = None, *, trusted_key: str | None = None
    ) -> list[str]:
        """What ``verify`` finds without a key: :meth:`structure_problems`, and every
        session's (or one session's) chain: each record's hash, order, columns and shape,
        and where its head says it ends. Cheap (no signature is checked), so ``show`` and
        ``replay`` run it first; an edit that is re-hashed passes it, and only a key
        catches that (``verify``). With ``trusted_key``, the session's records and head
        must also be signed by it (the log over all sessions is ``verify``'s)."""
        problems = self.structure_problems()
        try:
            return self._integrity(problems, session_id, trusted_key)
        except AuditError as exc:
            return [*problems, _unreadable(problems, exc)]

    def _integrity(self, problems: list[str], session_id: str | None, key: str | None) -> list[str]:
        sessions = self._typed(
            "sessions",
            "SELECT session_id, public_key, head_seq, head_hash, head_signature FROM sessions "
            "ORDER BY rowid",
            problems,
        )
        if session_id is None:
            rows = self._typed("records", _RECORD_ROWS, problems)
        else:
            sql = _RECORD_ROWS.replace("ORDER BY", "WHERE session_id = ? ORDER BY")
            rows = self._well_typed("records", self._query(sql, (session_id,)), problems)
            sessions = [row for row in sessions if row[0] == session_id]
        heads: dict[str, tuple[Any, ...]] = {}
        for row in sessions:
            heads.setdefault(row[0], row)
        grouped: dict[str, dict[int, tuple[Any, ...]]] = {}
        for row in rows:
            grouped.setdefault(row[0], {}).setdefault(row[1], row)
        for name in sorted(set(grouped) | set(heads)):
            rows_of = list(grouped.get(name, {}).values())
            problems += _verify_session(
                name, rows_of, heads.get(name), key, "the trusted key", signatures=key is not None
            )
        return problems

    def sessions_problems(
        self, session_ids: Iterable[str], *, trusted_key: str | None = None
    ) -> dict[str, list[str]]:
        """:meth:`integrity_problems` of each of ``session_ids``, and a finding for each the
        database does not hold; what concerns the whole database (its structure, its
        column types) is checked once, not once a session, so checking many sessions
        costs what they hold, not what the database holds times their number."""
        wanted = list(dict.fromkeys(session_ids))
        shared = self.structure_problems()
        if shared:
            return dict.fromkeys(wanted, shared)
        if self._query(_MISTYPED["sessions"]) or self._query(_MISTYPED["records"]):
            return {s: self.integrity_problems(s, trusted_key=trusted_key) for s in wanted}
        head_sql = (
            "SELECT session_id, public_key, head_seq, head_hash, head_signature FROM sessions "
            "WHERE session_id = ?"
        )
        rows_sql = _RECORD_ROWS.replace("ORDER BY", "WHERE session_id = ? ORDER BY")
        found: dict[str, list[str]] = {}
        for session in wanted:
            head = self._query(head_sql, (session,))
            if not head:
                found[session] = [f"session {session}: not in {self.path}"]
                continue
            rows = self._query(rows_sql, (session,))
            found[session] = _verify_session(
                session, rows, head[0], trusted_key, "the trusted key",
                signatures=trusted_key is not None,
            )  # fmt: skip
        return found

    def _typed(self, table: str, sql: str, problems: list[str]) -> list[tuple[Any, ...]]:
        return self._well_typed(table, self._query(sql), problems)

    def _well_typed(
        self, table: str, rows: list[tuple[Any, ...]], problems: list[str]
    ) -> list[tuple[Any, ...]]:
        """``rows`` of ``table`` whose values are of their columns' types (a finding for
        each other); SQLite tells at once when all are, as they are but for tampering."""
        if not self._query(_MISTYPED[table]):
            return rows
        return _typed_rows(table, rows, problems)

    def _log_rows(self) -> list[tuple[Any, ...]] | None:
        """The log in order, or ``None`` for a database written before it existed."""
        if not self._has_table("log"):
            return None
        return self._query("SELECT pos, session_id, seq, root FROM log ORDER BY pos")

    def _log_head(self) -> tuple[Any, ...] | None:
        if not self._has_table("log_head"):
            return None
        found = self._query("SELECT size, root, public_key, signature FROM log_head")
        return found[0] if found else None

    def _has_table(self, name: str) -> bool:
        query = "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?"
        return bool(self._query(query, (name,)))


class _Transaction:
    """``BEGIN IMMEDIATE`` ... ``COMMIT``; on any failure, a rollback that reaches the
    cached session heads too, so that a failed commit (a full disk) leaves the store as
    it was and the next append continues from what is really on disk."""

    def __init__(self, db: sqlite3.Connection, path: Path, heads: dict[str, Any]) -> None:
        self._db = db
        self._path = path
        self._heads = heads
        self._saved: dict[str, Any] = {}

    def __enter__(self) -> None:
        try:
            self._db.execute("BEGIN IMMEDIATE")
        except sqlite3.Error as exc:
            raise AuditError(f"cannot write audit database {self._path}: {exc}") from exc
        self._saved = dict(self._heads)

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        failure: BaseException | None = None
        try:
            self._db.execute("ROLLBACK" if exc_type is not None else "COMMIT")
        except sqlite3.Error as error:
            failure = error
            if self._db.in_transaction:
                self._db.execute("ROLLBACK")
        if exc_type is not None or failure is not None:
            self._heads.clear()
            self._heads.update(self._saved)
        if failure is not None and exc_type is None:
            raise AuditError(f"cannot write audit database {self._path}: {failure}") from failure
        if isinstance(exc, sqlite3.Error):
            raise AuditError(f"cannot write audit database {self._path}: {exc}") from exc


_sign = sign


def _open_read_only(path: Path) -> sqlite3.Connection:
    """``path`` opened with SQLite's ``mode=ro`` (on read-only media, ``immutable``): no
    table, journal or file is ever created. A file without the cmbs schema is refused."""
    if not path.is_file():
        raise AuditError(f"no audit database at {path}")
    uri = path.resolve().as_uri()
    for options in ("mode=ro", "mode=ro&immutable=1"):
        try:
            db = sqlite3.connect(f"{uri}?{options}", uri=True, check_same_thread=False)
            names = {row[0] for row in db.execute("SELECT name FROM sqlite_master")}
            break
        except sqlite3.DatabaseError as exc:
            if "file is not a database" in str(exc):
                raise AuditError(f"{path} is not a cmbs audit database") from None
            error = exc
    else:
        raise AuditError(f"cannot open audit database {path}: {error}") from None
    if not {"sessions", "records"} <= names:
        db.close()
        raise AuditError(f"{path} is not a cmbs audit database")
    return db


def _head_bytes(session_id: str, seq: int, hash_: str) -> bytes:
    return canonical({"head": session_id, "seq": seq, "hash": hash_})


@dataclass(frozen=True)
class _TableShape:
    """A table as SQLite describes it: what the schema comparison compares."""

    columns: tuple[tuple[Any, ...], ...]  # name, declared type, not null, default, pk
    primary_key: tuple[str, ...]
    unique: frozenset[tuple[str, ...]]  # the column sets of its unique indexes
    sql: str  # its definition, white space and case aside


def _table_shape(db: sqlite3.Connection, name: str, sql: str) -> _TableShape:
    columns = tuple(
        (column, str(kind).upper(), bool(not_null), default, pk)
        for column, kind, not_null, default, pk in db.execute(
            'SELECT name, type, "notnull", dflt_value, pk FROM pragma_table_info(?) ORDER BY cid',
            (name,),
        )
    )
    unique = set()
    for index, is_unique, partial in db.execute(
        'SELECT name, "unique", partial FROM pragma_index_list(?)', (name,)
    ):
        if is_unique and not partial:
            found = db.execute("SELECT name FROM pragma_index_info(?) ORDER BY seqno", (index,))
            unique.add(tuple(str(row[0]) for row in found))
    keyed = sorted((pk, column) for column, _, _, _, pk in columns if pk)
    normal = "".join(str(sql).split()).lower().replace("ifnotexists", "")
    return _TableShape(columns, tuple(c for _, c in keyed), frozenset(unique), normal)


def _schema_shapes() -> dict[str, _TableShape]:
    """Each table as the store makes it (from :data:`_SCHEMA`, in memory)."""
    db = sqlite3.connect(":memory:")
    try:
        db.executescript(_SCHEMA)
        made = db.execute("SELECT name, sql FROM sqlite_master WHERE type = 'table'").fetchall()
        return {name: _table_shape(db, name, sql) for name, sql in made}
    finally:
        db.close()


_EXPECTED = _schema_shapes()
#: Rows the schema's keys forbid, and how each is reported.
_DUPLICATES = (
    (
        "sessions",
        "SELECT session_id, COUNT(*) FROM sessions GROUP BY session_id HAVING COUNT(*) > 1",
        "session {0} is in the sessions table {1} times: duplicated",
    ),
    (
        "records",
        "SELECT session_id, seq, COUNT(*) FROM records GROUP BY session_id, seq "
        "HAVING COUNT(*) > 1",
        "session {0} record {1} is there {2} times: duplicated",
    ),
    (
        "log",
        "SELECT pos, COUNT(*) FROM log GROUP BY pos HAVING COUNT(*) > 1",
        "log position {0} is there {1} times: duplicated",
    ),
    (
        "log",
        "SELECT session_id, seq, COUNT(*) FROM log GROUP BY session_id, seq HAVING COUNT(*) > 1",
        "session {0} record {1} is in the log {2} times: duplicated",
    ),
    (
        "log_head",
        "SELECT COUNT(*) FROM log_head HAVING COUNT(*) > 1",
        "the log head is there {0} times: duplicated",
    ),
)


def _structure_problems(db: sqlite3.Connection) -> list[str]:
    """The tables against the schema, and rows its keys forbid (see
    :meth:`SQLiteAuditStore.structure_problems`)."""
    found = {
        str(name): (str(kind), sql)
        for kind, name, sql in db.execute(
            "SELECT type, name, sql FROM sqlite_master WHERE name IN (?, ?, ?, ?)", _TABLES
        )
    }
    problems = []
    tables = []
    for name in _TABLES:
        if name not in found:
            if name in ("sessions", "records"):
                problems.append(f"the schema: table {name} is missing: removed")
            continue
        kind, sql = found[name]
        if kind != "table":
            problems.append(f"the schema: {name} is a {kind}, not a table: replaced")
            continue
        tables.append(name)
        difference = _table_difference(_EXPECTED[name], _table_shape(db, name, str(sql)))
        if difference:
            problems.append(f"the schema: table {name} {difference}: rebuilt")
    if ("log" in found) != ("log_head" in found):
        gone, there = ("log", "log_head") if "log" not in found else ("log_head", "log")
        problems.append(f"the schema: table {gone} is missing, {there} is there: removed")
    for name, table in db.execute(
        "SELECT name, tbl_name FROM sqlite_master WHERE type = 'trigger' ORDER BY name"
    ):
        problems.append(f"the schema: trigger {name!r} on {table!r} is not the store's: added")
    for table, sql, message in _DUPLICATES:
        if table in tables:
            problems += [message.format(*row) for row in db.execute(sql)]
    return problems


def _table_difference(expected: _TableShape, actual: _TableShape) -> str | None:
    """How a table differs from the schema's, or ``None``."""
    if actual.primary_key != expected.primary_key:
        if not actual.primary_key:
            return f"has no primary key (the schema's is {', '.join(expected.primary_key)})"
        return f"has primary key {', '.join(actual.primary_key)}, not the schema's"
    if actual.columns != expected.columns:
        names = [column[0] for column in actual.columns]
        wanted = [column[0] for column in expected.columns]
        if names != wanted:
            return f"has columns {', '.join(map(str, names))}, not {', '.join(wanted)}"
        return "has columns of other types or constraints than the schema's"
    if actual.unique != expected.unique:
        return "has other unique constraints than the schema's"
    if actual.sql != expected.sql:
        return "is defined otherwise than the schema (its constraints differ)"
    return None


def _unreadable(problems: list[str], exc: AuditError) -> str:
    """Why tables whose schema was found wrong cannot be checked; an error reading tables
    whose schema is right is no finding but the error itself, raised."""
    if not problems:
        raise exc
    return f"the tables cannot be read as the store's ({_cause(exc)}): rebuilt"


def _cause(exc: AuditError) -> str:
    """What SQLite said, without the path (``no such column: signature``)."""
    cause = exc.__cause__
    return str(cause) if cause is not None else str(exc)


def _typed_rows(
    table: str, rows: Sequence[tuple[Any, ...]], problems: list[str]
) -> list[tuple[Any, ...]]:
    """The rows whose columns hold what the schema says; a finding for each other."""
    types = _ROW_TYPES[table]
    good = []
    for row in rows:
        if len(row) == len(types) and all(
            isinstance(value, allowed) for value, allowed in zip(row, types, strict=True)
        ):
            good.append(row)
            continue
        where = {
            "sessions": f"session {row[0]}: its sessions row",
            "records": f"session {row[0]} record {row[1]}",
            "log": f"log position {row[0]}",
            "log_head": "the log head",
        }[table]
        problems.append(f"{where}: a column holds a value of the wrong type: edited")
    return good


def _verify_log(
    records: list[tuple[Any, ...]],
    log: list[tuple[Any, ...]] | None,
    head: tuple[Any, ...] | None,
    key: str | None,
    whose: str,
    checkpoint: dict[str, Any] | None,
) -> list[str]:
    """The log holds every record once, in an order its roots and signed head vouch for,
    and (with a checkpoint) the first ``size`` records that checkpoint covered; its head
    is signed by ``key`` (``whose`` it is, for the finding).

    A database written before the log existed has none and passes, unless one of its
    sessions says, in its signed first record, that it was written into a log.
    """
    if not log and head is None:
        logged = sorted(str(r[0]) for r in records if r[1] == 0 and _says_logged(str(r[4])))
        if logged:
            return [f"the log is gone, yet session {logged[0]} was written into it: removed"]
        if checkpoint is not None and checkpoint["size"] > 0:
            return [f"the log holds no record, the checkpoint covered {checkpoint['size']}"]
        return []
    log = log or []
    hashes = {(str(r[0]), int(r[1])): str(r[5]) for r in records}
    problems: list[str] = []
    root = GENESIS
    for expected, (pos, session_id, seq, stored) in enumerate(log):
        at = f"log position {expected}"
        if pos != expected:
            return [*problems, f"{at}: missing (found position {pos} in its place): deleted"]
        record_hash = hashes.pop((str(session_id), int(seq)), None)
        if record_hash is None:
            return [f"{at}: session {session_id} record {seq} is missing: deleted"]
        root = chain(root, [record_hash])
        if root != stored:
            return [f"{at}: the log does not follow from its records: rewritten"]
        if checkpoint is not None and expected + 1 == checkpoint["size"]:
            if root != checkpoint["root"]:
                return [f"the first {expected + 1} records differ from the checkpoint's: rewritten"]
    if checkpoint is not None and len(log) < checkpoint["size"]:
        return [
            f"the log holds {len(log)} record(s), the checkpoint covered {checkpoint['size']}: "
            "records were deleted, cut off or the file emptied"
        ]
    if hashes:
        session_id, seq = min(hashes)
        return [f"session {session_id} record {seq} is not in the log: inserted"]
    return _verify_log_head(head, len(log), root, key, whose)


def _says_logged(body: str) -> bool:
    try:
        return json.loads(body).get("data", {}).get("log") is True
    except (ValueError, AttributeError, RecursionError):
        return False  # not a record: the session's own check says so


def _verify_log_head(
    head: tuple[Any, ...] | None, size: int, root: str, key: str | None, whose: str
) -> list[str]:
    if head is None:
        return [] if size == 0 else ["the log's signed head is missing: deleted"]
    head_size, head_root, key_text, signature = head
    if key is not None and key_text != key:
        return [
            f"the log's head is signed by key {key_id(key_text)}, not {whose} {key_id(key)}: "
            "the log was rebuilt or replaced"
        ]
    try:
        public = load_public_key(str(key_text))
    except ValueError:
        return ["the log head's public key is not valid"]
    if not verify_signature(public, str(signature), log_head_bytes(int(head_size), str(head_root))):
        return ["the log head's signature is bad: edited"]
    if (int(head_size), str(head_root)) != (size, root):
        return [
            f"the log's signed head names {head_size} record(s), the log holds {size}: "
            "records were cut off or added"
        ]
    return []


def _verify_session(
    session_id: str,
    rows: list[tuple[Any, ...]],
    head: tuple[Any, ...] | None,
    key: str | None,
    whose: str,
    *,
    signed_from: int = 0,
    signatures: bool = True,
) -> list[str]:
    """One session's chain, every record of a record's shape, all signed by ``key``
    (``whose`` it is, for the finding); record signatures below ``signed_from`` are
    vouched for by a checkpoint and not checked again. Without ``signatures``, what
    needs no key: hashes, order, shapes and the head's place."""
    where = f"session {session_id}"
    if head is None:
        return [f"{where}: records without a session entry"]
    key_text = str(head[1])
    public: Ed25519PublicKey | None = None
    if signatures and key is not None and key_text != key:
        return [
            f"{where}: signed by key {key_id(key_text)}, not {whose} {key_id(key)}: "
            "re-signed or written by another key"
        ]
    if signatures:
        try:
            public = load_public_key(key_text)
        except ValueError:
            return [f"{where}: the session's public key is not valid"]
    previous = GENESIS
    for expected, (_, seq, kind, step, body, hash_, signature) in enumerate(rows):
        at = f"{where} record {expected}"
        if seq != expected:
            return [f"{at}: missing (found record {seq} in its place): deleted or inserted"]
        text = str(body)
        data = text.encode()
        if digest(data) != hash_:
            return [f"{at}: its content does not match its hash: edited"]
        if (
            public is not None
            and expected >= signed_from
            and not verify_signature(public, str(signature), data)
        ):
            return [f"{at}: bad signature: edited or forged"]
        try:
            parsed = json.loads(text)
        except (ValueError, RecursionError):
            return [f"{at}: its body is not JSON: edited"]
        shape = body_problem(parsed, first=expected == 0)
        if shape is not None:
            return [f"{at}: not of a record's shape ({shape}): edited"]
        if (
            parsed.get("session_id"),
            parsed.get("seq"),
            parsed.get("kind"),
            parsed.get("step"),
        ) != (
            session_id,
            seq,
            kind,
            step,
        ):
            return [f"{at}: its columns do not match its signed body: moved or edited"]
        if parsed.get("prev") != previous:
            return [f"{at}: does not follow the record before it: reordered"]
        if expected == 0 and parsed["data"]["public_key"] != key_text:
            return [f"{at}: the session's key was replaced"]
        previous = str(hash_)
    last = len(rows) - 1
    if (int(head[2]), str(head[3])) != (last, previous if rows else GENESIS):
        return [
            f"{where}: the signed head names record {head[2]}, the chain ends at {last}: "
            "records were cut off or added"
        ]
    if public is not None and not verify_signature(
        public, str(head[4]), _head_bytes(session_id, last, previous)
    ):
        return [f"{where}: the head's signature is bad: edited"]
    return []
