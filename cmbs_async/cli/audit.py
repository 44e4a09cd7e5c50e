"""``cmbs audit verify|show|export`` and ``cmbs replay``: reading the audit trail back."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from .._errors import CmbsError
from .._text import escape_controls, table
from ..audit import (
    AuditError,
    RecordKind,
    SigningKeyError,
    SQLiteAuditStore,
    load_or_create_key,
    public_key_text,
)
from ..replayer import replay

__all__ = ["add_audit_commands", "run_audit_command"]

EXIT_OK = 0
EXIT_FAILED = 1


class AuditUsageError(CmbsError):
    """A mistake of the user's with the audit commands (one line, exit 2)."""


def add_audit_commands(sub: Any) -> None:
    audit = sub.add_parser("audit", help="verify, show or export an audit database")
    verbs = audit.add_subparsers(dest="verb", required=True)
    verify = verbs.add_parser("verify", help="check signatures and chains (exit 1 if tampered)")
    verify.add_argument("db")
    trust = verify.add_mutually_exclusive_group()
    trust.add_argument("--public-key", help="base64 Ed25519 key every session must be signed by")
    trust.add_argument("--signing-key", help="trust the public half of this signing key file")
    show = verbs.add_parser("show", help="list sessions, or show one as a step table")
    show.add_argument("db")
    show.add_argument("session", nargs="?", help="session id (a unique prefix is enough)")
    export = verbs.add_parser("export", help="print every record")
    export.add_argument("db")
    export.add_argument("--jsonl", action="store_true", required=True, help="as JSON lines")
    again = sub.add_parser("replay", help="re-run the gate over a recorded session")
    again.add_argument("db")
    again.add_argument("session", help="session id (a unique prefix is enough)")


def run_audit_command(args: argparse.Namespace) -> int:
    store = _open(args.db)
    try:
        if args.command == "replay":
            return _replay(store, args.session)
        if args.verb == "verify":
            return _verify(store, args)
        if args.verb == "show":
            return _show(store, args.session)
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
    if not Path(path).is_file():
        raise AuditUsageError(f"no audit database at {path}")
    return SQLiteAuditStore(path)


def _session(store: SQLiteAuditStore, prefix: str) -> str:
    matches = [s["session_id"] for s in store.sessions() if s["session_id"].startswith(prefix)]
    if len(matches) != 1:
        what = "no session" if not matches else f"{len(matches)} sessions"
        raise AuditUsageError(f"{what} in {store.path} match {prefix!r}")
    return str(matches[0])


def _verify(store: SQLiteAuditStore, args: argparse.Namespace) -> int:
    trusted = args.public_key
    if args.signing_key:
        try:
            trusted = public_key_text(load_or_create_key(args.signing_key))
        except SigningKeyError as exc:
            raise AuditUsageError(str(exc)) from exc
    report = store.verify(trusted_key=trusted)
    for problem in report.problems:
        print(escape_controls(f"TAMPERED: {problem}"))
    basis = "the trusted key" if trusted else "the keys stored with the sessions"
    state = "intact" if report.intact else f"{len(report.problems)} problem(s)"
    print(
        f"{store.path}: {report.sessions} session(s), {report.records} record(s), "
        f"{state}; signatures checked against {basis}"
    )
    return EXIT_OK if report.intact else EXIT_FAILED


def _show(store: SQLiteAuditStore, prefix: str | None) -> int:
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
    for record in store.records(session_id):
        if record.kind is RecordKind.END:
            end = record.data
    print("\n".join(table(rows)))
    print(f"\nsession  {escape_controls(session_id)}")
    if end:
        reason = f" ({end['reason']})" if end.get("reason") else ""
        print(escape_controls(f"outcome  {end['outcome']}{reason}"))
    else:
        print("outcome  (no end record: the run was cut off)")
    return EXIT_OK


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
