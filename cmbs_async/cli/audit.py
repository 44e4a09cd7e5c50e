"""``cmbs audit verify|head|key|show|export`` and ``cmbs replay``: reading the audit trail
back.

``verify`` trusts only a key the operator gives from outside the database: ``--public-key``
(a file, or the key itself), ``--signing-key`` (the public half of a key file), the key of
a ``--head`` checkpoint, or else the public half of the default signing key. ``show`` and
``replay`` refuse, in one line, a database whose tables or rows the schema forbids, or a
record without what they read of it.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from pydantic import ValidationError

from .._errors import CmbsError, validation_reason
from .._reading import ReadError, read_json, read_text
from .._text import escape_controls, table
from ..audit import (
    AuditError,
    RecordKind,
    SigningKeyError,
    SQLiteAuditStore,
    default_data_dir,
    public_key_text,
)
from ..audit.log import (
    CHECKPOINT_MAX_BYTES,
    CHECKPOINT_MAX_DEPTH,
    CheckpointError,
    key_id,
    make_checkpoint,
    read_checkpoint,
)
from ..audit.shape import data_problem
from ..audit.signing import load_key, normal_public_key
from ..audit.store import AuditRecord
from ..profile import Profile, load_profile
from ..protocol import Output
from ..replayer import replay

__all__ = ["add_audit_commands", "run_audit_command", "write_checkpoint"]

EXIT_OK = 0
EXIT_FAILED = 1
#: A public key file holds one key: a line of base64, or a PEM block.
PUBLIC_KEY_MAX_BYTES = 16 * 1024


class AuditUsageError(CmbsError):
    """A mistake of the user's with the audit commands (one line, exit 2)."""


_DB_HELP = f"audit database (SQLite; default {default_data_dir() / 'audit.db'})"


def add_audit_commands(sub: Any) -> None:
    audit = sub.add_parser("audit", help="verify, show or export an audit database")
    verbs = audit.add_subparsers(dest="verb", required=True)
    verify = verbs.add_parser("verify", help="check signatures and chains (exit 1 if tampered)")
    verify.add_argument("db", nargs="?", help=_DB_HELP)
    trust = verify.add_mutually_exclusive_group()
    trust.add_argument(
        "--public-key",
        metavar="FILE|KEY",
        help="the operator's public key, every session and the log head must be signed by: "
        "a file holding it (base64, as `cmbs audit key` prints it, or PEM) or the base64 "
        "text itself",
    )
    trust.add_argument(
        "--signing-key", metavar="FILE", help="trust the public half of this signing key file"
    )
    verify.add_argument(
        "--head",
        metavar="FILE",
        help="a checkpoint (from `cmbs audit head` or --head-out) the log must extend; "
        "alone, its key is the trusted one",
    )
    key = verbs.add_parser(
        "key", help="print the public half of a signing key (base64), for --public-key"
    )
    key.add_argument(
        "--signing-key",
        metavar="FILE",
        help=f"the signing key (default {default_data_dir() / 'signing_key'})",
    )
    head = verbs.add_parser("head", help="print a signed checkpoint of the log (JSON)")
    head.add_argument("db", nargs="?", help=_DB_HELP)
    head.add_argument(
        "--signing-key",
        help=f"the key to sign with (default {default_data_dir() / 'signing_key'})",
    )
    show = verbs.add_parser("show", help="list sessions, or show one as a step table")
    show.add_argument("db", nargs="?", help=_DB_HELP)
    show.add_argument("session", nargs="?", help="session id (a unique prefix is enough)")
    show.add_argument(
        "--full", action="store_true", help="also print each command's captured output"
    )
    export = verbs.add_parser("export", help="print every record")
    export.add_argument("db", nargs="?", help=_DB_HELP)
    export.add_argument("--jsonl", action="store_true", required=True, help="as JSON lines")
    again = sub.add_parser("replay", help="re-run the gate over a recorded session")
    again.add_argument("db", nargs="?", help=_DB_HELP)
    again.add_argument("session", help="session id (a unique prefix is enough)")
    again.add_argument(
        "--profile",
        metavar="FILE|NAME",
        help="judge the recorded steps under this profile instead (nothing runs again): "
        "each verdict that changes is listed",
    )


def run_audit_command(args: argparse.Namespace) -> int:
    if args.command == "audit" and args.verb == "verify":
        return _verify(args)
    if args.command == "audit" and args.verb == "key":
        key = _existing_key(args.signing_key or default_data_dir() / "signing_key")
        print(public_key_text(key))
        return EXIT_OK
    _default_database(args)
    store = _open(args.db)
    try:
        if args.command == "replay":
            _refuse_tampered(store, store.structure_problems())
            profile = load_profile(args.profile) if args.profile else None
            return _replay(store, args.session, profile)
        if args.verb == "head":
            key = _existing_key(args.signing_key or default_data_dir() / "signing_key")
            print(json.dumps(signed_checkpoint(store, key)))
            return EXIT_OK
        if args.verb == "show":
            _refuse_tampered(store, store.structure_problems())
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
                        "body": _body(body),
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
    """``--head-out``: the checkpoint after the run, written whole or not at all; a file
    already there is replaced only if it is a checkpoint (an earlier one)."""
    target = Path(path)
    if target.exists() and not _a_checkpoint(target):
        raise AuditUsageError(f"--head-out {path}: exists and is not a checkpoint: left as it is")
    temporary = target.with_name(f".{target.name}.tmp")
    try:
        temporary.write_text(json.dumps(store.checkpoint()) + "\n")
        temporary.replace(target)
    except OSError as exc:
        raise AuditUsageError(f"--head-out {path}: {exc.strerror or exc}") from None


def _a_checkpoint(path: Path) -> bool:
    """Whether ``path`` is a regular file holding a checkpoint's fields (not checked)."""
    try:
        if not path.is_file() or path.stat().st_size > 64 * 1024:
            return False
        data = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and {"size", "root", "public_key", "signature"} <= data.keys()


def _session(store: SQLiteAuditStore, prefix: str) -> str:
    matches = [name for name in store.session_ids() if name.startswith(prefix)]
    if len(matches) != 1:
        what = "no session" if not matches else f"{len(matches)} sessions"
        raise AuditUsageError(f"{what} in {store.path} match {prefix!r}")
    return str(matches[0])


def _default_database(args: argparse.Namespace) -> None:
    """The database a command reads when none is named: the one runs record into. ``show
    X`` alone is a database when X looks like a file, else a session of the default one."""
    session = getattr(args, "session", None)
    if args.command == "audit" and args.verb == "show" and args.db and session is None:
        if not (Path(args.db).exists() or "/" in args.db or args.db.endswith(".db")):
            args.db, args.session = None, args.db
    if args.db is None:
        args.db = str(default_data_dir() / "audit.db")


def _verify(args: argparse.Namespace) -> int:
    _default_database(args)
    trusted, source, checkpoint = _trust(args)
    try:
        store = SQLiteAuditStore(args.db, read_only=True)
    except AuditError as exc:
        if checkpoint is None or not Path(args.db).is_file():
            raise AuditUsageError(str(exc)) from None
        # a file is there, and what the checkpoint covered is not: emptied, cut, damaged
        print(escape_controls(f"TAMPERED: {exc}; the checkpoint covered {checkpoint['size']}"))
        return EXIT_FAILED
    try:
        if trusted is None:  # none given: the operator's own signing key, where runs make it
            trusted, source = default_trusted_key()
        return _report(store, trusted, source, checkpoint)
    finally:
        store.close()


def _trust(args: argparse.Namespace) -> tuple[str | None, str, dict[str, Any] | None]:
    """The key every session and the log head must be signed by as the operator gave it
    (``None`` if they gave none), where it came from, and the checkpoint (if any). A
    checkpoint given alone brings its key: the operator kept it outside the database."""
    trusted, source = None, ""
    if args.public_key is not None:
        trusted, source = public_key_option(args.public_key)
    if args.signing_key:
        trusted = public_key_text(_existing_key(args.signing_key))
        source = f"--signing-key {args.signing_key}"
    checkpoint = None
    if args.head:
        try:
            data = read_json(
                args.head,
                what="a checkpoint",
                max_bytes=CHECKPOINT_MAX_BYTES,
                max_depth=CHECKPOINT_MAX_DEPTH,
            )
        except ReadError as exc:
            raise AuditUsageError(escape_controls(f"--head {exc}")) from None
        try:
            checkpoint = read_checkpoint(data, trusted_key=trusted)
        except CheckpointError as exc:
            raise AuditUsageError(escape_controls(f"--head {args.head}: {exc}")) from None
        if trusted is None:
            trusted, source = str(checkpoint["public_key"]), f"--head {args.head}"
    return trusted, source, checkpoint


def public_key_option(value: str) -> tuple[str, str]:
    """``--public-key``: a file holding the key (base64 or PEM), else the base64 key."""
    if os.path.exists(value):
        try:
            text = read_text(value, what="a public key file", max_bytes=PUBLIC_KEY_MAX_BYTES)
            return normal_public_key(text), f"--public-key {value}"
        except (ReadError, ValueError) as exc:
            where = "" if isinstance(exc, ReadError) else f"{value}: "
            raise AuditUsageError(escape_controls(f"--public-key {where}{exc}")) from None
    try:
        return normal_public_key(value), "--public-key"
    except ValueError as exc:
        raise AuditUsageError(escape_controls(f"--public-key: no such file, and {exc}")) from None


def default_trusted_key() -> tuple[str, str]:
    """The public half of the signing key runs use by default; one line if there is none."""
    path = default_data_dir() / "signing_key"
    try:
        return public_key_text(load_key(path)), f"the signing key {path}"
    except FileNotFoundError:
        raise AuditUsageError(
            "no key to check the signatures against: give the operator's with "
            f"--public-key FILE, --signing-key FILE or --head FILE (no signing key at {path})"
        ) from None
    except SigningKeyError as exc:
        raise AuditUsageError(str(exc)) from None


def _report(
    store: SQLiteAuditStore, trusted: str, source: str, checkpoint: dict[str, Any] | None
) -> int:
    report = store.verify(trusted_key=trusted, checkpoint=checkpoint)
    for problem in report.problems:
        print(escape_controls(f"TAMPERED: {problem}"))
    state = "intact" if report.intact else f"{len(report.problems)} problem(s)"
    against = f"; it extends the checkpoint of {checkpoint['size']} record(s)" if checkpoint else ""
    print(
        escape_controls(
            f"{store.path}: {report.sessions} session(s), {report.records} record(s), "
            f"{state}; signatures checked against the trusted key {key_id(trusted)} "
            f"({source})"
        )
        + (against if report.intact else "")
    )
    return EXIT_OK if report.intact else EXIT_FAILED


def _refuse_tampered(store: SQLiteAuditStore, problems: list[str]) -> None:
    """What the schema forbids (a duplicated session, a rebuilt table) and a chain that
    does not hold (an edited record) are never shown as if they were records: one line,
    exit 2. (Who signed them is ``verify``'s to say: it needs the operator's key.)"""
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise AuditUsageError(
            escape_controls(
                f"{store.path}: TAMPERED: {problems[0]}{more}; "
                "`cmbs audit verify` lists every finding"
            )
        )


def _checked(store: SQLiteAuditStore, session_id: str | None = None) -> list[AuditRecord]:
    """The records (of one session, or all), each with what ``show`` reads of it."""
    records = list(store.records(session_id))
    for record in records:
        problem = data_problem(record)
        if problem is not None:
            raise AuditUsageError(_unreadable(store, record, problem))
    return records


def _unreadable(store: SQLiteAuditStore, record: AuditRecord, problem: str) -> str:
    return escape_controls(
        f"{store.path}: session {record.session_id} record {record.seq} ({record.kind.value}) "
        f"is not of its kind's shape: {problem}; `cmbs audit verify` says more"
    )


def _body(body: object) -> object:
    """A stored body for export: its JSON, or the text as stored if it is not JSON."""
    if isinstance(body, bytes):
        return f"x'{body.hex()}'"
    try:
        return json.loads(str(body))
    except (ValueError, RecursionError):
        return body


def _show(store: SQLiteAuditStore, prefix: str | None, *, full: bool = False) -> int:
    if prefix is None:
        _refuse_tampered(store, store.integrity_problems())
        _checked(store)
        print(f"{'session':34} {'scenario':28} {'records':>7}  outcome")
        for s in store.sessions():
            line = (
                f"{s['session_id']:34} {str(s['scenario_id']):28} {s['records']:7}  "
                f"{s['outcome'] or '(no end record)'}"
            )
            print(escape_controls(line))
        return EXIT_OK
    session_id = _session(store, prefix)
    _refuse_tampered(store, store.integrity_problems(session_id))
    records = _checked(store, session_id)
    by_step: dict[int, list[AuditRecord]] = {}
    for record in records:
        if record.step is not None:
            by_step.setdefault(record.step, []).append(record)
    rows = [("step", "action", "verdict", "message", "review", "observed")]
    outputs: list[str] = []
    end = None
    for number, history in sorted(by_step.items()):
        decision = _first(history, RecordKind.DECISION)
        review = _first(history, RecordKind.SUPERVISION)
        observed = _first(history, RecordKind.OBSERVATION)
        rows.append(
            (
                str(number),
                str(decision.data.get("action") or "-") if decision else "-",
                decision.data["verdict"] if decision else "-",
                decision.data["message"] if decision else "-",
                _reviewed(review.data) if review else "",
                _observed(observed.data) if observed else "",
            )
        )
        if full and observed and observed.data.get("kind") == "command":
            try:
                outputs += _output(number, observed.data)
            except ValidationError as exc:
                problem = f"its captured output is not one ({validation_reason(exc)})"
                raise AuditUsageError(_unreadable(store, observed, problem)) from None
    for record in records:
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


def _first(records: list[AuditRecord], kind: RecordKind) -> AuditRecord | None:
    return next((record for record in records if record.kind is kind), None)


def _reviewed(data: dict[str, Any]) -> str:
    """A supervision record's verdict, and what was done (the seed's own records, written
    through ``save_supervision``, may hold the verdict alone)."""
    action = data.get("action")
    return f"{data['verdict']} -> {action}" if action else str(data["verdict"])


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


def _replay(store: SQLiteAuditStore, prefix: str, profile: Profile | None) -> int:
    session_id = _session(store, prefix)
    _refuse_tampered(store, store.integrity_problems(session_id))
    try:
        report = replay(store, session_id, profile=profile)
    except AuditError as exc:
        raise AuditUsageError(str(exc)) from exc
    for mismatch in report.mismatches:
        print(escape_controls(f"DIFFERENT: {mismatch}"))
    verdict = "identical" if report.identical else f"{len(report.mismatches)} difference(s)"
    under = f" under profile {profile.name}" if profile is not None else ""
    print(
        f"session {session_id}: {report.decisions} decision(s) and {report.reconciles} "
        f"reconcile(s) replayed{under}: {verdict}"
    )
    return EXIT_OK if report.identical else EXIT_FAILED
