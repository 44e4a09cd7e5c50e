"""Parsing of the ``--agent`` and ``--executor`` specs of the command line."""

from __future__ import annotations

from ..agents import Agent, ScriptedAgent

__all__ = ["SpecError", "agent_from_spec", "executor_from_spec"]


class SpecError(ValueError):
    """A spec the command line cannot use; the message is one line for the user."""


def agent_from_spec(spec: str) -> Agent:
    """``script:STEPS.jsonl``: a scripted agent replaying that file."""
    kind, sep, rest = spec.partition(":")
    if kind == "script" and sep and rest:
        try:
            return ScriptedAgent.from_jsonl(rest)
        except OSError as exc:
            raise SpecError(f"--agent {spec}: cannot read {rest}: {exc.strerror or exc}") from exc
        except UnicodeDecodeError as exc:
            raise SpecError(f"--agent {spec}: {rest} is not UTF-8 text") from exc
    raise SpecError(f"--agent {spec!r}: expected script:STEPS.jsonl")


def executor_from_spec(spec: str) -> object:
    """``local``: the local subprocess executor."""
    if spec == "local":
        from executors.local import LocalExecutor

        return LocalExecutor()
    raise SpecError(f"--executor {spec!r}: expected local")
