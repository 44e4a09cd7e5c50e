"""Parsing of the ``--agent`` and ``--executor`` specs of the command line."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

from ..agents import Agent, OpenAIAgent, ScriptedAgent, StdioAgent

__all__ = ["SpecError", "agent_factory", "agent_from_spec", "executor_from_spec"]


class SpecError(ValueError):
    """A spec the command line cannot use; the message is one line for the user."""


def agent_factory(spec: str) -> Callable[[], Agent]:
    """A maker of fresh agents for ``spec``; the spec's files are read once, now.

    ``script:STEPS.jsonl``: a scripted agent replaying that file; ``stdio:COMMAND``: a
    program speaking JSON lines; ``openai:MODEL@BASE_URL``: a language model (its key from
    ``CMBS_AGENT_API_KEY``).
    """
    kind, sep, rest = spec.partition(":")
    if kind == "script" and sep and rest:
        try:
            lines = ScriptedAgent.from_jsonl(rest).messages
        except OSError as exc:
            raise SpecError(f"--agent {spec}: cannot read {rest}: {exc.strerror or exc}") from exc
        except UnicodeDecodeError as exc:
            raise SpecError(f"--agent {spec}: {rest} is not UTF-8 text") from exc
        return lambda: ScriptedAgent(lines)
    if kind == "stdio" and sep and rest:
        return lambda: StdioAgent(rest)
    if kind == "openai" and sep and rest:
        try:
            OpenAIAgent.from_spec(rest)
        except ValueError as exc:
            raise SpecError(f"--agent {exc}") from exc
        return lambda: OpenAIAgent.from_spec(rest)
    raise SpecError(
        f"--agent {spec!r}: expected script:STEPS.jsonl, stdio:COMMAND or openai:MODEL@BASE_URL"
    )


def agent_from_spec(spec: str) -> Agent:
    return agent_factory(spec)()


def executor_from_spec(
    spec: str,
    *,
    identities: Sequence[str] = (),
    known_hosts: str | None = None,
    host_key: str | None = None,
    insecure: bool = False,
) -> object:
    """``local``, or ``ssh://USER@HOST[:PORT]`` with its connection options."""
    if spec == "local":
        from executors.local import LocalExecutor

        return LocalExecutor()
    if spec.startswith("ssh://"):
        from executors.ssh import SSHExecutor, SSHTarget

        for path in (*identities, *([known_hosts] if known_hosts else [])):
            if not os.path.isfile(path):
                raise SpecError(f"no such file: {path}")
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
