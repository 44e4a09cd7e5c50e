"""The embedded audit store: SQLite in WAL mode, every record signed and hash-chained.

Each record's body is canonical JSON holding its session, sequence number, kind, step,
time, the previous record's hash and its data; the row keeps the body, its SHA-256 and
an Ed25519 signature of the body. Each session keeps a signed head (last sequence number
and hash), updated in the same transaction as every append. Any edited byte, deleted,
inserted, reordered or forged record, and a cut-off tail, fail verification.
"""

from __future__ import annotations

import base64
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

from .signing import canonical, digest, load_public_key, public_key_text, verify_signature
from .store import AuditError, AuditRecord, Entry, RecordKind, StepHistory

__all__ = ["SQLiteAuditStore", "VerifyReport"]

_GENESIS = "0" * 64
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
    ) -> None:
        self.path = Path(path)
        self._key = key
        self._public = public_key_text(key) if key is not None else None
        self._lock = threading.Lock()
        self._heads: dict[str, tuple[int, str]] = {}
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
                (session_id, self._public, _GENESIS),
            )
            self._heads[session_id] = (-1, _GENESIS)
            self._append_locked(
                session_id, [Entry(RecordKind.SESSION, None, {**data, "public_key": self._public})]
            )

    def append(self, session_id: str, entries: Sequence[Entry]) -> None:
        """Append records in one durable transaction."""
        with self._lock, self._transaction():
            self._append_locked(session_id, entries)

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
        head = _sign(self._key, _head_bytes(session_id, seq, previous))
        self._db.execute(
            "UPDATE sessions SET head_seq = ?, head_hash = ?, head_signature = ? "
            "WHERE session_id = ?",
            (seq, previous, head, session_id),
        )
        self._heads[session_id] = (seq, previous)

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
        return _Transaction(self._db, self.path)

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
    def verify(self, *, trusted_key: str | None = None) -> VerifyReport:
        """Check every session's chain, signatures and signed head.

        With ``trusted_key`` (base64 Ed25519 public key) every session must be signed by
        it; otherwise each session is checked against the key its first record names.
        """
        problems: list[str] = []
        heads = {
            row[0]: row
            for row in self._query(
                "SELECT session_id, public_key, head_seq, head_hash, head_signature FROM sessions"
            )
        }
        rows = self.raw_rows()
        grouped: dict[str, list[tuple[Any, ...]]] = {}
        for row in rows:
            grouped.setdefault(str(row[0]), []).append(row)
        for session_id in sorted(set(grouped) | set(heads)):
            problems += _verify_session(
                session_id, grouped.get(session_id, []), heads.get(session_id), trusted_key
            )
        return VerifyReport(sessions=len(heads), records=len(rows), problems=tuple(problems))


class _Transaction:
    def __init__(self, db: sqlite3.Connection, path: Path) -> None:
        self._db = db
        self._path = path

    def __enter__(self) -> None:
        try:
            self._db.execute("BEGIN IMMEDIATE")
        except sqlite3.Error as exc:
            raise AuditError(f"cannot write audit database {self._path}: {exc}") from exc

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        try:
            self._db.execute("ROLLBACK" if exc_type is not None else "COMMIT")
        except sqlite3.Error as error:
            if exc_type is None:
                raise AuditError(f"cannot write audit database {self._path}: {error}") from error
        if isinstance(exc, sqlite3.Error):
            raise AuditError(f"cannot write audit database {self._path}: {exc}") from exc


def _sign(key: Ed25519PrivateKey, data: bytes) -> str:
    return base64.b64encode(key.sign(data)).decode()


def _head_bytes(session_id: str, seq: int, hash_: str) -> bytes:
    return canonical({"head": session_id, "seq": seq, "hash": hash_})


def _verify_session(
    session_id: str,
    rows: list[tuple[Any, ...]],
    head: tuple[Any, ...] | None,
    trusted_key: str | None,
) -> list[str]:
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
    previous = _GENESIS
    for expected, (_, seq, kind, step, body, hash_, signature) in enumerate(rows):
        at = f"{where} record {expected}"
        if seq != expected:
            return [f"{at}: missing (found record {seq} in its place): deleted or inserted"]
        data = str(body).encode()
        if digest(data) != hash_:
            return [f"{at}: its content does not match its hash: edited"]
        if not verify_signature(public, str(signature), data):
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
    if (int(head[2]), str(head[3])) != (last, previous if rows else _GENESIS):
        return [
            f"{where}: the signed head names record {head[2]}, the chain ends at {last}: "
            "records were cut off or added"
        ]
    if not verify_signature(public, str(head[4]), _head_bytes(session_id, last, previous)):
        return [f"{where}: the head's signature is bad: edited"]
    return []
