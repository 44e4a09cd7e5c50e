"""Agents named by a spec (``script:F``, ``stdio:CMD``, ``openai:M@URL``): made wherever
the run is, on this machine or a batch's Ray worker."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .._errors import CmbsError
from .._reading import ReadError
from ..profile import Profile
from .base import Agent
from .openai import OpenAIAgent
from .scripted import ScriptedAgent
from .stdio import AgentSandbox, StdioAgent

__all__ = ["AgentOptions", "SpecError", "agent_factory", "canonical_agents"]


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


@dataclass(frozen=True)
class AgentOptions:
    """How a ``stdio:`` agent program is run: its sandbox, the operator's variables it
    is given, and the directory it starts in (``cwd``: this process's by default)."""

    sandbox: AgentSandbox = field(default_factory=AgentSandbox)
    pass_env: tuple[str, ...] = ()
    cwd: str | None = None


def agent_factory(spec: str, options: AgentOptions | None = None) -> Callable[[Profile], Agent]:
    """A maker of fresh agents for ``spec``, given the scenario's profile; the spec's files
    are read once, now.

    ``script:STEPS.jsonl``: a scripted agent replaying that file; ``stdio:COMMAND``: a
    program speaking JSON lines, run as ``options`` say; ``openai:MODEL@BASE_URL``: a
    language model (its key from ``CMBS_AGENT_API_KEY``) prompted with the profile's
    actions and constrained by its schema.
    """
    options = options or AgentOptions()
    kind, sep, rest = spec.partition(":")
    if kind == "script" and sep and rest:
        try:
            lines = ScriptedAgent.from_jsonl(rest).messages
        except ReadError as exc:  # "FILE: cannot read: ...", "FILE: larger than 64 MiB ..."
            raise SpecError(f"--agent {spec}: {exc}") from None
        return lambda profile: ScriptedAgent(lines, label=spec)
    if kind == "stdio" and sep and rest:
        return lambda profile: StdioAgent(
            rest, sandbox=options.sandbox, pass_env=options.pass_env, cwd=options.cwd
        )
    if kind == "openai" and sep and rest:
        try:
            OpenAIAgent.from_spec(rest)
        except ValueError as exc:
            raise SpecError(f"--agent {exc}") from exc
        return lambda profile: OpenAIAgent.from_spec(rest, profile=profile)
    raise SpecError(
        f"--agent {spec!r}: expected script:STEPS.jsonl, stdio:COMMAND or openai:MODEL@BASE_URL"
    )
