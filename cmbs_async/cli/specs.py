"""Parsing of the ``--agent`` and ``--executor`` specs of the command line."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from executors import Executor, ExecutorError, LocalExecutor
from executors.sandbox import INSTALL_HINT, SandboxMode, SandboxUnavailable
from executors.ssh import SSHExecutor, SSHTarget, read_identity

from .._errors import CmbsError
from ..agents import Agent, OpenAIAgent, ScriptedAgent, StdioAgent
from ..profile import Profile

__all__ = [
    "SpecError",
    "add_sandbox_option",
    "agent_factory",
    "agent_from_spec",
    "canonical_agents",
    "executor_from_spec",
    "secrets_of",
]


class SpecError(CmbsError, ValueError):
    """A spec the command line cannot use; the message is one line for the user."""


def canonical_agents(specs: Sequence[str]) -> list[str]:
    """The ``--agent`` specs with a script's path resolved, each once: the same agent spelt
    two ways (``script:s.jsonl``, ``script:./s.jsonl``) is one agent, and one job key."""
    canonical = []
    for spec in specs:
        kind, sep, rest = spec.partition(":")
        canonical.append(f"script:{Path(rest).resolve()}" if kind == "script" and rest else spec)
    return list(dict.fromkeys(canonical))


def agent_factory(spec: str) -> Callable[[Profile], Agent]:
    """A maker of fresh agents for ``spec``, given the scenario's profile; the spec's files
    are read once, now.

    ``script:STEPS.jsonl``: a scripted agent replaying that file; ``stdio:COMMAND``: a
    program speaking JSON lines; ``openai:MODEL@BASE_URL``: a language model (its key from
    ``CMBS_AGENT_API_KEY``) prompted with the profile's actions and constrained by its schema.
    """
    kind, sep, rest = spec.partition(":")
    if kind == "script" and sep and rest:
        try:
            lines = ScriptedAgent.from_jsonl(rest).messages
        except OSError as exc:
            raise SpecError(f"--agent {spec}: cannot read {rest}: {exc.strerror or exc}") from exc
        except UnicodeDecodeError as exc:
            raise SpecError(f"--agent {spec}: {rest} is not UTF-8 text") from exc
        return lambda profile: ScriptedAgent(lines)
    if kind == "stdio" and sep and rest:
        return lambda profile: StdioAgent(rest)
    if kind == "openai" and sep and rest:
        try:
            OpenAIAgent.from_spec(rest)
        except ValueError as exc:
            raise SpecError(f"--agent {exc}") from exc
        return lambda profile: OpenAIAgent.from_spec(rest, profile=profile)
    raise SpecError(
        f"--agent {spec!r}: expected script:STEPS.jsonl, stdio:COMMAND or openai:MODEL@BASE_URL"
    )


def agent_from_spec(spec: str, *, profile: Profile) -> Agent:
    """One agent for ``spec``, speaking the vocabulary of ``profile``."""
    return agent_factory(spec)(profile)


def add_sandbox_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--sandbox",
        choices=("auto", "bwrap", "none"),
        default="auto",
        help="contain local commands with bubblewrap: auto uses it where installed and says "
        "so when it is not; bwrap refuses to run without it; none runs commands bare "
        "(default: %(default)s)",
    )


def secrets_of(key: str | Path, audit_db: str | Path | None) -> tuple[str, ...]:
    """The signing key and the audit database (with its WAL files): never for a command."""
    paths = [str(key)]
    if audit_db is not None:
        paths += [f"{audit_db}{suffix}" for suffix in ("", "-wal", "-shm", "-journal")]
    return tuple(paths)


def executor_from_spec(
    spec: str,
    *,
    sandbox: SandboxMode = "auto",
    hidden: Sequence[str] = (),
    command: str = "run",
    identities: Sequence[str] = (),
    known_hosts: str | None = None,
    host_key: str | None = None,
    insecure: bool = False,
) -> Executor:
    """``local``, or ``ssh://USER@HOST[:PORT]`` with its connection options.

    ``sandbox`` and ``hidden`` are for the local executor; without bubblewrap, ``auto``
    says on stderr, in one line, that commands run bare.
    """
    if spec == "local":
        try:
            local = LocalExecutor(sandbox=sandbox, hidden=hidden)
        except SandboxUnavailable as exc:
            raise SpecError(f"--sandbox bwrap: {exc}") from None
        if local.containment == "none" and sandbox == "auto":
            print(
                f"cmbs {command}: warning: bubblewrap (bwrap) is not available, so commands "
                f"run without a sandbox (sandbox: none); install it: {INSTALL_HINT}",
                file=sys.stderr,
            )
        return local
    if spec.startswith("ssh://"):
        for path in (*identities, *([known_hosts] if known_hosts else [])):
            if not os.path.isfile(path):
                raise SpecError(f"no such file: {path}")
        for path in identities:
            try:
                read_identity(path)
            except ExecutorError as exc:
                raise SpecError(f"--{exc}") from None
        try:
            target = SSHTarget.parse(
                spec,
                identities=tuple(identities),
                known_hosts=known_hosts,
                host_key=host_key,
                insecure=insecure,
            )
        except ValueError as exc:
            raise SpecError(f"--executor {exc}") from exc
        return SSHExecutor(target)
    raise SpecError(f"--executor {spec!r}: expected local or ssh://USER@HOST[:PORT]")
