"""Scenario specs and their loading from YAML or JSON files."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ._errors import CmbsError, one_line, validation_reason
from .protocol import ENV_NAME, CommandEnv

__all__ = ["ScenarioError", "ScenarioSpec", "load_scenario"]

_VAR = re.compile(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}")


class ScenarioError(CmbsError, ValueError):
    """A scenario file could not be read or is not valid; the message is one line."""


class ScenarioSpec(BaseModel):
    """One scenario: the goal handed to the agent and the budget it runs under.

    ``files`` are written into the workdir before the agent's first step (the scenario's
    starting state); ``{{ name }}`` in the goal and in the files is replaced by
    ``vars[name]`` (other ``{{ ... }}``, such as Ansible's, are left alone). ``host``
    (``ssh://USER@HOST[:PORT]``) and ``host_key`` (a pinned public key) name a remote
    target for the command line's SSH executor.

    Commands see only an allow-listed environment (``PATH``, ``LANG``, ``LC_*``, ``TERM``,
    ``TZ``) plus ``env`` (values, ``{{ var }}`` filled) and the operator's variables named
    in ``pass_env`` (``KUBECONFIG``, say); ``network: none`` cuts sandboxed commands off
    the network; ``readable`` lists host paths a sandboxed command may read although they
    lie in a hidden place (the operator's home, the private ``/tmp``): an SSH key for the
    target host, say.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str = Field(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    goal: str = Field(min_length=1)
    vars: dict[str, str | int | float | bool] = Field(default_factory=dict)
    workdir: str | None = None
    deadline_s: float = Field(default=200.0, gt=0)
    max_steps: int = Field(default=50, ge=1)
    command_timeout_s: float | None = Field(default=None, gt=0)
    profile: str = "ciso"
    files: dict[str, str] = Field(default_factory=dict)
    host: str | None = Field(default=None, pattern=r"^ssh://")
    host_key: str | None = None
    env: dict[Annotated[str, Field(pattern=ENV_NAME)], str] = Field(default_factory=dict)
    pass_env: tuple[Annotated[str, Field(pattern=ENV_NAME)], ...] = ()
    network: Literal["on", "none"] = "on"
    readable: tuple[str, ...] = ()

    def rendered_goal(self) -> str:
        """The goal with ``{{ var }}`` placeholders filled in; unknown names stay as written."""
        return self._render(self.goal)

    def rendered_files(self) -> dict[str, str]:
        """The starting files, with ``{{ var }}`` filled in the same way."""
        return {path: self._render(content) for path, content in self.files.items()}

    def command_env(self) -> CommandEnv:
        """What the executor gives every command of this scenario besides the allow-list."""
        return CommandEnv(
            values={name: self._render(value) for name, value in self.env.items()},
            pass_env=self.pass_env,
            network=self.network == "on",
            readable=tuple(os.path.expanduser(self._render(path)) for path in self.readable),
        )

    def _render(self, text: str) -> str:
        def fill(match: re.Match[str]) -> str:
            name = match.group(1)
            return str(self.vars[name]) if name in self.vars else match.group(0)

        return _VAR.sub(fill, text)


def load_scenario(path: str | Path) -> ScenarioSpec:
    """Read a scenario file (``.json``, otherwise YAML); errors are one-line ScenarioErrors."""
    path = Path(path)
    try:
        text = path.read_text("utf-8")
    except OSError as exc:
        raise ScenarioError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    try:
        data: Any = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as exc:
        raise ScenarioError(f"{path}: not valid {_format(path)}: {one_line(str(exc))}") from exc
    if not isinstance(data, dict):
        raise ScenarioError(f"{path}: a scenario must be a mapping of fields")
    try:
        return ScenarioSpec.model_validate(data)
    except ValidationError as exc:
        raise ScenarioError(f"{path}: {validation_reason(exc)}") from exc


def _format(path: Path) -> str:
    return "JSON" if path.suffix == ".json" else "YAML"
