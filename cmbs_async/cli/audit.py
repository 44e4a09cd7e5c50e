"""``cmbs audit verify|show|export`` and ``cmbs replay``: reading the audit trail back."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from .._errors import CmbsError
from .._text import escape_controls, table
from ..audit import (
    AuditError,
    RecordKind,
    SigningKeyError,
    SQLiteAuditStore,
    default_data_dir,
    public_key_text,
)
from ..audit.log import CheckpointError, make_checkpoint, read_checkpoint
from ..audit.signing import load_key, load_public_key
from ..protocol import Output
from ..replayer import replay

__all__ = ["add_audit_commands", "run_audit_command", "write_checkpoint"]

EXIT_OK = 0
EXIT_FAILED = 1


class AuditUsageError(CmbsError):
    """A mistake of the user's with the audit commands (one line, exit 2)."""


def add_audit_commands(sub: Any) -> None:
    audit = sub.add_parser("audit", help="verify, show or export an audit database")
    verbs = audit.add_subparsers(dest="verb", required=True)
    verify = verbs.add_parser("verify", help="check signatures and chains (exit 1 if tampered)")
    verify.add_argument("db", help="audit database (SQLite)")
    trust = verify.add_mutually_exclusive_group()
    trust.add_argument("--public-key", help="base64 Ed25519 key every session must be signed by")
    trust.add_argument("--signing-key", help="trust the public half of this signing key file")
    verify.add_argument(
        "--head", help="a checkpoint (from `cmbs audit head` or --head-out) the log must extend"
    )
    head = verbs.add_parser("head", help="print a signed checkpoint of the log (JSON)")
    head.add_argument("db", help="audit database (SQLite)")
    head.add_argument(
        "--signing-key",
        help=f"the key to sign with (default {default_data_dir() / 'signing_key'})",
    )
    show = verbs.add_parser("show", help="list sessions, or show one as a step table")
    show.add_argument("db", help="audit database (SQLite)")
    show.add_argument("session", nargs="?", help="session id (a unique prefix is enough)")
    show.add_argument(
        "--full", action="store_true", help="also print each command's captured output"
    )
    export = verbs.add_parser("export", help="print every record")
    export.add_argument("db", help="audit database (SQLite)")
    export.add_argument("--jsonl", action="store_true", required=True, help="as JSON lines")
    again = sub.add_parser("replay", help="re-run the gate over a recorded session")
    again.add_argument("db", help="audit database (SQLite)")
    again.add_argument("session", help="session id (a unique prefix is enough)")


def run_audit_command(args: argparse.Namespace) -> int:
    if args.command == "audit" and args.verb == "verify":
        return _verify(args)
    store = _open(args.db)
    try:
        if args.command == "replay":
            return _replay(store, args.session)
        if args.verb == "head":
            key = _existing_key(args.signing_key or default_data_dir() / "signing_key")
            print(json.dumps(signed_checkpoint(store, key)))
            return EXIT_OK
        if args.verb == "show":
            return _show(store, args.session, full=args.full)
        for row in store.raw_rows():
            session_id, seq, kind, step, body, hash_, signature = row
            print(
                json.dumps(
                    {
                        "session_id": session_id,
                        "seq": seq,
                        "kind": kind,
                        "step": step,
                        "body": json.loads(body),
                        "hash": hash_,
                        "signature": signature,
                    }
                )
            )
        return EXIT_OK
    finally:
        store.close()


def _open(path: str) -> SQLiteAuditStore:
    """The database, read-only: reading never creates a table or a file."""
    try:
        return SQLiteAuditStore(path, read_only=True)
    except AuditError as exc:
        raise AuditUsageError(str(exc)) from None


def _existing_key(path: str | Path) -> Ed25519PrivateKey:
    """A key that must already exist: a mistyped path is an error, never a new key."""
    try:
        return load_key(path)
    except FileNotFoundError:
        raise AuditUsageError(f"no signing key at {path}") from None
    except SigningKeyError as exc:
        raise AuditUsageError(str(exc)) from None


def signed_checkpoint(store: SQLiteAuditStore, key: Ed25519PrivateKey) -> dict[str, Any]:
    """The log's state in ``store``, signed with ``key``."""
    size, root = store.log_state()
    return make_checkpoint(key, size, root)


def write_checkpoint(store: SQLiteAuditStore, path: str) -> None:
    """``--head-out``: the checkpoint after the run, written whole or not at all."""
    target = Path(path)
    temporary = target.with_name(f".{target.name}.tmp")
    try:
        temporary.write_text(json.dumps(store.checkpoint()) + "\n")
        temporary.replace(target)
    except OSError as exc:
        raise AuditUsageError(f"--head-out {path}: {exc.strerror or exc}") from None


def _session(store: SQLiteAuditStore, prefix: str) -> str:
    matches = [s["session_id"] for s in store.sessions() if s["session_id"].startswith(prefix)]
    if len(matches) != 1:
        what = "no session" if not matches else f"{len(matches)} sessions"
        raise AuditUsageError(f"{what} in {store.path} match {prefix!r}")
    return str(matches[0])


def _verify(args: argparse.Namespace) -> int:
    trusted, checkpoint = _trust(args)
    try:
        store = SQLiteAuditStore(args.db, read_only=True)
    except AuditError as exc:
        if checkpoint is None or not Path(args.db).is_file():
            raise AuditUsageError(str(exc)) from None
        # a file is there, and what the checkpoint covered is not: emptied, cut, damaged
        print(escape_controls(f"TAMPERED: {exc}; the checkpoint covered {checkpoint['size']}"))
        return EXIT_FAILED
    try:
        return _report(store, trusted, checkpoint)
    finally:
        store.close()


def _trust(args: argparse.Namespace) -> tuple[str | None, dict[str, Any] | None]:
    """The key every session must be signed by (if pinned) and the checkpoint (if any)."""
    trusted = args.public_key
    if trusted is not None:
        try:
            load_public_key(trusted)
        except ValueError as exc:
            raise AuditUsageError(f"--public-key: {exc}") from None
    if args.signing_key:
        trusted = public_key_text(_existing_key(args.signing_key))
    checkpoint = None
    if args.head:
        try:
            text = Path(args.head).read_text("utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise AuditUsageError(f"--head {args.head}: cannot read: {exc}") from None
        try:
            checkpoint = read_checkpoint(text, trusted_key=trusted)
        except CheckpointError as exc:
            raise AuditUsageError(f"--head {args.head}: {exc}") from None
    return trusted, checkpoint


def _report(store: SQLiteAuditStore, trusted: str | None, checkpoint: dict[str, Any] | None) -> int:
    report = store.verify(trusted_key=trusted, checkpoint=checkpoint)
    for problem in report.problems:
        print(escape_controls(f"TAMPERED: {problem}"))
    basis = "the trusted key" if trusted else "the keys stored with the sessions"
    state = "intact" if report.intact else f"{len(report.problems)} problem(s)"
    against = f"; it extends the checkpoint of {checkpoint['size']} record(s)" if checkpoint else ""
    print(
        f"{store.path}: {report.sessions} session(s), {report.records} record(s), "
        f"{state}; signatures checked against {basis}" + (against if report.intact else "")
    )
    return EXIT_OK if report.intact else EXIT_FAILED


def _show(store: SQLiteAuditStore, prefix: str | None, *, full: bool = False) -> int:
    if prefix is None:
        print(f"{'session':34} {'scenario':28} {'records':>7}  outcome")
        for s in store.sessions():
            line = (
                f"{s['session_id']:34} {str(s['scenario_id']):28} {s['records']:7}  "
                f"{s['outcome'] or '(no end record)'}"
            )
            print(escape_controls(line))
        return EXIT_OK
    session_id = _session(store, prefix)
    rows = [("step", "action", "verdict", "message", "review", "observed")]
    outputs: list[str] = []
    end = None
    for history in store.session_history(session_id):
        decision = next(iter(history.of_kind(RecordKind.DECISION)), None)
        review = next(iter(history.of_kind(RecordKind.SUPERVISION)), None)
        observed = next(iter(history.of_kind(RecordKind.OBSERVATION)), None)
        rows.append(
            (
                str(history.step),
                str(decision.data.get("action") or "-") if decision else "-",
                decision.data["verdict"] if decision else "-",
                decision.data["message"] if decision else "-",
                f"{review.data['verdict']} -> {review.data['action']}" if review else "",
                _observed(observed.data) if observed else "",
            )
        )
        if full and observed and observed.data.get("kind") == "command":
            outputs += _output(history.step, observed.data)
    for record in store.records(session_id):
        if record.kind is RecordKind.END:
            end = record.data
    print("\n".join(table(rows)))
    if outputs:
        print("\n".join(["", *outputs]))
    print(f"\nsession  {escape_controls(session_id)}")
    if end:
        reason = f" ({end['reason']})" if end.get("reason") else ""
        print(escape_controls(f"outcome  {end['outcome']}{reason}"))
    else:
        print("outcome  (no end record: the run was cut off)")
    return EXIT_OK


def _output(step: int, data: dict[str, Any]) -> list[str]:
    """A command's captured streams, a line each, escaped, under a heading per stream."""
    lines = []
    for stream in ("stdout", "stderr"):
        text = Output.model_validate(data.get(stream) or {}).text
        if text:
            lines.append(f"step {step} {stream}:")
            lines += [f"  {escape_controls(line)}" for line in text.splitlines()]
    return lines


def _observed(data: dict[str, object]) -> str:
    if data.get("kind") == "artifact":
        return (
            f"wrote {data.get('path')}" if data.get("success") else f"refused: {data.get('error')}"
        )
    return str(data.get("error") or f"exit {data.get('exit_status')}")


def _replay(store: SQLiteAuditStore, prefix: str) -> int:
    session_id = _session(store, prefix)
    try:
        report = replay(store, session_id)
    except AuditError as exc:
        raise AuditUsageError(str(exc)) from exc
    for mismatch in report.mismatches:
        print(escape_controls(f"DIFFERENT: {mismatch}"))
    verdict = "identical" if report.identical else f"{len(report.mismatches)} difference(s)"
    print(
        f"session {session_id}: {report.decisions} decision(s) and {report.reconciles} "
        f"reconcile(s) replayed: {verdict}"
    )
    return EXIT_OK if report.identical else EXIT_FAILED
