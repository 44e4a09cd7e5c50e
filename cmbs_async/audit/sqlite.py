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
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from pydantic import ValidationError

from .log import GENESIS, chain, log_head_bytes, make_checkpoint
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


@dataclass(frozen=True)
class VerifyReport:
    """What ``verify`` found: no problems means intact."""

    sessions: int
    records: int
    problems: tuple[str, ...]

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
        if self._key is None or self._public is None:
            raise AuditError("this audit store was opened without a signing key")
        with self._lock, self._transaction():
            self._db.execute(
                "INSERT INTO sessions VALUES (?, ?, -1, ?, '')",
                (session_id, self._public, GENESIS),
            )
            self._heads[session_id] = (-1, GENESIS)
            first = {**data, "public_key": self._public, "log": True}  # signed: "I am logged"
            self._append_locked(session_id, [Entry(RecordKind.SESSION, None, first)])

    def append(self, session_id: str, entries: Sequence[Entry]) -> None:
        """Append records in one durable transaction."""
        with self._lock, self._transaction():
            self._append_locked(session_id, entries)

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
        return self._query(
            "SELECT session_id, seq, kind, step, body, hash, signature FROM records "
            "ORDER BY session_id, seq"
        )

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
        """Check every session's chain, signatures and signed head, and the log over them.

        With ``trusted_key`` (base64 Ed25519 public key) every session must be signed by
        it; otherwise each session is checked against the key its first record names.
        With a ``checkpoint`` (see :meth:`checkpoint`, its signature already checked), the
        log must still hold exactly what it covered; those records' own signatures are
        then not checked again, since the signed root already binds their hashes.
        """
        heads = {
            row[0]: row
            for row in self._query(
                "SELECT session_id, public_key, head_seq, head_hash, head_signature FROM sessions"
            )
        }
        rows = self.raw_rows()
        log = self._log_rows()
        problems = _verify_log(rows, log, self._log_head(), trusted_key, checkpoint)
        covered: dict[str, int] = {}
        if checkpoint is not None and log is not None:
            for _, session_id, _, _ in log[: checkpoint["size"]]:
                covered[session_id] = covered.get(session_id, 0) + 1
        grouped: dict[str, list[tuple[Any, ...]]] = {}
        for row in rows:
            grouped.setdefault(str(row[0]), []).append(row)
        for session_id in sorted(set(grouped) | set(heads)):
            problems += _verify_session(
                session_id,
                grouped.get(session_id, []),
                heads.get(session_id),
                trusted_key,
                signed_from=covered.get(session_id, 0),
            )
        return VerifyReport(sessions=len(heads), records=len(rows), problems=tuple(problems))

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


def _verify_log(
    records: list[tuple[Any, ...]],
    log: list[tuple[Any, ...]] | None,
    head: tuple[Any, ...] | None,
    trusted_key: str | None,
    checkpoint: dict[str, Any] | None,
) -> list[str]:
    """The log holds every record once, in an order its roots and signed head vouch for,
    and (with a checkpoint) the first ``size`` records that checkpoint covered.

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
    return _verify_log_head(head, len(log), root, trusted_key)


def _says_logged(body: str) -> bool:
    try:
        return json.loads(body).get("data", {}).get("log") is True
    except (ValueError, AttributeError):
        return False  # not a record: the session's own check says so


def _verify_log_head(
    head: tuple[Any, ...] | None, size: int, root: str, trusted_key: str | None
) -> list[str]:
    if head is None:
        return [] if size == 0 else ["the log's signed head is missing: deleted"]
    head_size, head_root, key_text, signature = head
    if trusted_key is not None and key_text != trusted_key:
        return ["the log's head is signed by a key other than the trusted one"]
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
    trusted_key: str | None,
    *,
    signed_from: int = 0,
) -> list[str]:
    """One session's chain; record signatures below ``signed_from`` are vouched for by a
    checkpoint and not checked again."""
    where = f"session {session_id}"
    if head is None:
        return [f"{where}: records without a session entry"]
    key_text = str(head[1])
    if trusted_key is not None and key_text != trusted_key:
        return [f"{where}: signed by a key other than the trusted one"]
    try:
        public: Ed25519PublicKey = load_public_key(key_text)
    except ValueError:
        return [f"{where}: the session's public key is not valid"]
    previous = GENESIS
    for expected, (_, seq, kind, step, body, hash_, signature) in enumerate(rows):
        at = f"{where} record {expected}"
        if seq != expected:
            return [f"{at}: missing (found record {seq} in its place): deleted or inserted"]
        data = str(body).encode()
        if digest(data) != hash_:
            return [f"{at}: its content does not match its hash: edited"]
        if expected >= signed_from and not verify_signature(public, str(signature), data):
            return [f"{at}: bad signature: edited or forged"]
        try:
            parsed = json.loads(data)
        except ValueError:
            return [f"{at}: its body is not JSON: edited"]
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
        if expected == 0 and parsed.get("data", {}).get("public_key") != key_text:
            return [f"{at}: the session's key was replaced"]
        previous = str(hash_)
    last = len(rows) - 1
    if (int(head[2]), str(head[3])) != (last, previous if rows else GENESIS):
        return [
            f"{where}: the signed head names record {head[2]}, the chain ends at {last}: "
            "records were cut off or added"
        ]
    if not verify_signature(public, str(head[4]), _head_bytes(session_id, last, previous)):
        return [f"{where}: the head's signature is bad: edited"]
    return []
