"""Parsing of the ``--agent`` and ``--executor`` specs of the command line."""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Sequence

from pydantic import TypeAdapter, ValidationError

from executors import Executor, ExecutorError, LocalExecutor
from executors.observation import ENV_NAME, Network
from executors.sandbox import (
    INSTALL_HINT,
    SandboxMode,
    SandboxUnavailable,
    SandboxUser,
    check_readable,
    default_hidden,
)
from executors.ssh import SANDBOXES, SSHExecutor, SSHTarget, read_identity

from .._errors import validation_reason
from ..agents import Agent
from ..agents.specs import AgentOptions, SpecError, agent_factory, canonical_agents
from ..agents.stdio import AgentSandbox
from ..profile import Profile

__all__ = [
    "AgentOptions",
    "SpecError",
    "add_agent_options",
    "add_sandbox_option",
    "agent_options",
    "parse_network",
    "agent_factory",
    "agent_from_spec",
    "canonical_agents",
    "executor_from_spec",
]


def agent_from_spec(spec: str, *, profile: Profile, options: AgentOptions | None = None) -> Agent:
    """One agent for ``spec``, speaking the vocabulary of ``profile``."""
    return agent_factory(spec, options)(profile)


def add_sandbox_option(parser: argparse.ArgumentParser) -> None:
    """``--sandbox``, ``--workdir-root`` and ``--sandbox-user``: how commands are kept in."""
    parser.add_argument(
        "--sandbox",
        choices=("auto", "bwrap", "none"),
        default="auto",
        help="contain local commands with bubblewrap: auto uses it where installed and says "
        "so when it is not; bwrap refuses to run without it; none runs commands bare "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--workdir-root",
        help="workdirs live under this directory, and a scenario's workdir elsewhere is "
        "refused (default: a fresh temporary directory, or --workdir's parent)",
    )
    parser.add_argument(
        "--sandbox-user",
        help="who sandboxed commands and agent programs run as (default, as root: a user "
        "of their own for each scenario and agent program, owning nothing on the host)",
    )


def add_agent_options(parser: argparse.ArgumentParser) -> None:
    """What a ``stdio:`` agent program is given: variables, files, network."""
    parser.add_argument(
        "--agent-env",
        action="append",
        default=[],
        metavar="NAME",
        help="repeatable: a variable of yours a stdio agent program gets (its model key, say)",
    )
    parser.add_argument(
        "--agent-readable",
        action="append",
        default=[],
        metavar="PATH",
        help="repeatable: a file or directory a stdio agent program may read (its code)",
    )
    parser.add_argument(
        "--agent-network",
        default="all",
        metavar="all|none|HOST:PORT,...",
        help="what a stdio agent program reaches (default: all, for its model)",
    )


_NETWORK: TypeAdapter[Network] = TypeAdapter(Network)


def parse_network(text: str, *, option: str) -> Network:
    """``all``, ``none`` or ``HOST:PORT,...`` as a network policy, or :class:`SpecError`."""
    value: object = text if text in ("all", "none") else [e for e in text.split(",") if e]
    try:
        return _NETWORK.validate_python(value)
    except ValidationError as exc:
        raise SpecError(f"{option} {text!r}: {validation_reason(exc)}") from None


def agent_options(
    args: argparse.Namespace, *, hidden: Sequence[str], workdir_root: str | None
) -> AgentOptions:
    """The options of a ``stdio:`` agent from the command line; a variable that is not set
    or a path that does not exist is refused now, in one line."""
    for name in args.agent_env:
        if not re.match(ENV_NAME, name):
            raise SpecError(f"--agent-env {name!r}: not a variable name")
        if name not in os.environ:
            raise SpecError(f"--agent-env {name}: not set in this environment")
    for path in args.agent_readable:
        if not os.path.exists(path):
            raise SpecError(f"--agent-readable {path}: no such file or directory")
        try:
            check_readable(path, hidden=[*default_hidden(), *hidden])
        except ExecutorError as exc:
            raise SpecError(f"--agent-{exc}") from None
    sandbox = AgentSandbox(
        hidden=tuple(hidden),
        workdir_root=workdir_root,
        readable=tuple(os.path.abspath(path) for path in args.agent_readable),
        network=parse_network(args.agent_network, option="--agent-network"),
        user=getattr(args, "sandbox_user", None),
    )
    return AgentOptions(sandbox=sandbox, pass_env=tuple(args.agent_env))


def executor_from_spec(
    spec: str,
    *,
    sandbox: SandboxMode = "auto",
    hidden: Sequence[str] = (),
    workdir_root: str | None = None,
    user: str | SandboxUser | None = None,
    command: str = "run",
    identities: Sequence[str] = (),
    known_hosts: str | None = None,
    host_key: str | None = None,
    insecure: bool = False,
    jump: str | None = None,
    source: str = "--executor",
) -> Executor:
    """``local``, or ``ssh://USER@HOST[:PORT]`` with its connection options.

    ``sandbox``, ``hidden``, ``workdir_root`` and ``user`` are for the local executor;
    without bubblewrap, ``auto`` says on stderr, in one line, that commands run bare. Over
    SSH, ``sandbox`` ``none`` is the remote launcher's ``session-kill`` (said on stderr),
    ``bwrap`` only that; ``jump`` is a host to connect through. ``source`` names where the
    spec came from, for the message when it is not one (``host:`` of a scenario, say).
    """
    if spec == "local":
        try:
            local = LocalExecutor(
                sandbox=sandbox, hidden=hidden, workdir_root=workdir_root, user=user
            )
        except SandboxUnavailable as exc:
            raise SpecError(f"--sandbox bwrap: {exc}") from None
        except ExecutorError as exc:
            raise SpecError(f"--workdir-root: {exc}") from None
        except ValueError as exc:
            raise SpecError(f"--sandbox-user: {exc}") from None
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
        hop = None
        if jump is not None:
            try:
                hop = SSHTarget.parse(jump, identities=tuple(identities), known_hosts=known_hosts)
            except ValueError as exc:
                raise SpecError(f"--jump-host {exc}") from exc
        try:
            target = SSHTarget.parse(
                spec,
                jump=hop,
                identities=tuple(identities),
                known_hosts=known_hosts,
                host_key=host_key,
                insecure=insecure,
            )
        except ValueError as exc:
            raise SpecError(f"{source} {exc}") from exc
        if sandbox == "none":
            print(
                f"cmbs {command}: warning: --sandbox none: remote commands run without a "
                "sandbox (session-kill), and could change what the login's sessions run",
                file=sys.stderr,
            )
        containments = {"none": ("session-kill",), "bwrap": ("bwrap",)}.get(sandbox, SANDBOXES)
        return SSHExecutor(target, containments=containments)
    raise SpecError(f"--executor {spec!r}: expected local or ssh://USER@HOST[:PORT]")
