"""One wiring for every subcommand that runs scenarios (``run``, ``demo``, ``mcp``,
``batch``, ``itbench``): the recording options they share, the executor their commands
run with, and the :class:`~cmbs_async.RunConfig` their runs are supervised under."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from executors import Executor

from .._errors import CmbsError
from ..audit import SQLiteAuditStore, default_data_dir, load_or_create_key
from ..config import RunConfig
from ..profile import Profile
from ..result import TraceEntry
from ..review import ConsoleHuman, OpenAIReviewer, Review, load_config
from ..telemetry import Telemetry, telemetry_for
from .specs import SpecError, executor_from_spec

__all__ = [
    "add_record_options",
    "add_ssh_options",
    "audit_path",
    "audit_store",
    "build_executor",
    "containment_options",
    "named_secrets",
    "run_config",
    "same_file",
    "secrets_of",
]


def add_record_options(parser: argparse.ArgumentParser) -> None:
    """Where runs are recorded and signed, and where their traces are exported."""
    parser.add_argument(
        "--audit-db",
        help="record runs in this SQLite audit database "
        f"(default {default_data_dir() / 'audit.db'})",
    )
    parser.add_argument("--no-audit", action="store_true", help="record nothing")
    parser.add_argument(
        "--head-out", help="write a signed checkpoint of the audit log here at the end"
    )
    parser.add_argument(
        "--signing-key",
        help="Ed25519 key file, made 0600 on first use "
        f"(default {default_data_dir() / 'signing_key'})",
    )
    parser.add_argument(
        "--otel",
        action="store_true",
        help="export a trace of each run over OTLP/HTTP, to $OTEL_EXPORTER_OTLP_ENDPOINT "
        "(default http://localhost:4318)",
    )
    parser.add_argument(
        "--otel-endpoint", metavar="URL", help="export traces here (implies --otel)"
    )


def add_ssh_options(parser: argparse.ArgumentParser) -> None:
    """How an ``ssh://`` executor connects: keys, known hosts, a hop."""
    parser.add_argument("--identity", action="append", default=[], help="SSH private key file")
    parser.add_argument("--known-hosts", help="known_hosts file (default: the user's)")
    parser.add_argument("--jump-host", help="ssh://USER@HOST[:PORT] to connect through (as ssh -J)")
    parser.add_argument(
        "--insecure-no-host-key-check",
        action="store_true",
        help="do not verify SSH host keys (logs a warning)",
    )


def named_secrets(key: str | Path, audit_db: str | Path | None) -> list[tuple[str, str]]:
    """The signing key and the audit database (with its WAL files), each with what it is."""
    named = [(str(key), "the signing key")]
    if audit_db is not None:
        named += [
            (f"{audit_db}{suffix}", "the audit database" + (suffix and f"'s {suffix} file"))
            for suffix in ("", "-wal", "-shm", "-journal")
        ]
    return named


def secrets_of(key: str | Path, audit_db: str | Path | None) -> tuple[str, ...]:
    """The signing key and the audit database (with its WAL files): never for a command."""
    return tuple(path for path, _ in named_secrets(key, audit_db))


def audit_path(args: argparse.Namespace) -> str | None:
    """Where a run is recorded: ``--audit-db``, else the default database; ``None`` with
    ``--no-audit``."""
    if args.no_audit:
        return None
    return str(args.audit_db or default_data_dir() / "audit.db")


def audit_store(args: argparse.Namespace) -> SQLiteAuditStore | None:
    """The store runs are recorded in, signed with ``--signing-key`` (or the default)."""
    path = audit_path(args)
    if path is None:
        if args.head_out:
            raise SpecError("--head-out needs the audit trail (drop --no-audit)")
        return None
    key_path = args.signing_key or default_data_dir() / "signing_key"
    if args.head_out and same_file(args.head_out, secrets_of(key_path, path)):
        raise SpecError(
            f"--head-out {args.head_out}: that is the signing key or the audit database"
        )
    key = load_or_create_key(key_path)
    return SQLiteAuditStore(path, key=key)


def same_file(path: str, others: tuple[str, ...]) -> bool:
    """Whether ``path`` names one of ``others``, however either is spelt (a link, another
    hard link to the same file)."""
    real = os.path.realpath(path)
    for other in others:
        if os.path.realpath(other) == real:
            return True
        try:
            if os.path.samefile(path, other):
                return True
        except OSError:  # one of them does not exist (yet)
            pass
    return False


def containment_options(args: argparse.Namespace, *, recorded: bool = True) -> dict[str, Any]:
    """The sandbox asked for, where workdirs live, and the operator's secrets a sandboxed
    command (or agent program) must not see."""
    key = (args.signing_key if recorded else None) or default_data_dir() / "signing_key"
    root = args.workdir_root
    named = getattr(args, "workdir", None)
    if root is None and named:  # the operator named the workdir: its parent holds it
        root = os.path.dirname(os.path.abspath(named))
    return {
        "sandbox": args.sandbox,
        "hidden": secrets_of(key, audit_path(args) if recorded else None),
        "command": args.command,
        "workdir_root": root,
        "user": args.sandbox_user,
    }


def build_executor(
    args: argparse.Namespace,
    *,
    where: str = "local",
    recorded: bool = True,
    host_key: str | None = None,
    source: str = "--executor",
    **changes: Any,
) -> Executor:
    """The executor of a subcommand: ``where`` (``local`` or ``ssh://...``) with the
    command line's sandbox and SSH options; ``changes`` replace containment options (a
    ``user`` of its own, say). ``recorded``: the subcommand records runs (their database
    and key are hidden from commands)."""
    containment = containment_options(args, recorded=recorded) | changes
    if not where.startswith("ssh://"):
        return executor_from_spec(where, **containment)
    if getattr(args, "backend", "asyncio") == "trio":  # Ray's workers run asyncio
        raise SpecError("the SSH executor needs --backend asyncio (asyncssh does not run on trio)")
    return executor_from_spec(
        where,
        **containment,
        identities=getattr(args, "identity", ()),
        known_hosts=getattr(args, "known_hosts", None),
        host_key=getattr(args, "host_key", None) or host_key,
        insecure=getattr(args, "insecure_no_host_key_check", False),
        jump=getattr(args, "jump_host", None),
        source=source,
    )


def run_config(
    args: argparse.Namespace,
    *,
    store: SQLiteAuditStore | None = None,
    profile: Profile | None = None,
    on_step: Callable[[TraceEntry], None] | None = None,
) -> RunConfig:
    """The configuration a subcommand's runs are supervised under: the command line's
    deadline, step budget, review layer (``--config``) and trace export (``--otel``)."""
    return RunConfig(
        profile=profile,
        deadline=getattr(args, "deadline", None),
        max_steps=getattr(args, "max_steps", None),
        review=_review(args),
        audit=store,
        telemetry=_telemetry(args),
        on_step=on_step,
    )


def _review(args: argparse.Namespace) -> Review | None:
    """The review layer of ``--config``, with the human of ``--human``."""
    path, human = getattr(args, "config", None), getattr(args, "human", "none")
    if not path:
        if human != "none":
            raise SpecError("--human needs --config (a review layer to pause)")
        return None
    config = load_config(path)
    if not config.base_url:
        raise SpecError(f"{path}: supervision.base_url is needed for the reviewer")
    return Review(
        reviewer=OpenAIReviewer(config),
        config=config,
        human=ConsoleHuman() if human == "console" else None,
    )


def _telemetry(args: argparse.Namespace) -> Telemetry | None:
    """The trace exporter of ``--otel`` / ``--otel-endpoint``, or ``None``."""
    endpoint = getattr(args, "otel_endpoint", None)
    asked = endpoint or ("" if getattr(args, "otel", False) else None)
    try:
        return telemetry_for(asked)
    except CmbsError as exc:
        raise SpecError(f"--otel: {exc}") from None
