"""A batch: every scenario file times every agent spec times every repeat."""

from __future__ import annotations

import glob
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from .._errors import CmbsError
from ..profile import builtin_profiles as builtins
from ..scenario import ScenarioError, ScenarioSpec, load_scenario

__all__ = ["BatchError", "Job", "expand_scenarios", "plan"]

_SUFFIXES = (".yaml", ".yml", ".json")


class BatchError(CmbsError, ValueError):
    """A batch that cannot be planned or run; the message is one line."""


@dataclass(frozen=True)
class Job:
    """One run of a batch. ``key`` names it in the results file, for resuming."""

    scenario_file: str
    spec: ScenarioSpec
    agent: str
    repeat: int

    @property
    def key(self) -> str:
        return f"{self.scenario_file}|{self.agent}|{self.repeat}"


def expand_scenarios(inputs: Sequence[str]) -> list[Path]:
    """Files as given, directories searched for scenario files, globs expanded; each once,
    as its resolved path (what a job is keyed by, however it was spelt)."""
    found: list[Path] = []
    for item in inputs:
        path = Path(item)
        if path.is_dir():
            matches = sorted(p for p in path.rglob("*") if p.suffix in _SUFFIXES and p.is_file())
        elif path.is_file():
            matches = [path]
        else:
            matches = sorted(Path(p) for p in glob.glob(item, recursive=True) if Path(p).is_file())
        if not matches:
            raise BatchError(f"no scenario files at {item}")
        found += [m for m in (m.resolve() for m in matches) if m not in found]
    return found


def plan(inputs: Sequence[str], agents: Sequence[str], repeat: int) -> list[Job]:
    """Load and validate every scenario before anything runs."""
    if repeat < 1:
        raise BatchError("--repeat must be at least 1")
    if not agents:
        raise BatchError("at least one --agent is needed")
    loaded: dict[Path, ScenarioSpec] = {}
    invalid: dict[Path, ScenarioError] = {}
    for path in expand_scenarios(inputs):
        try:
            loaded[path] = load_scenario(path)
        except ScenarioError as error:
            invalid[path] = error
    # a profile file found among the scenarios (a directory holds both) is not one of them
    named = {spec.profile for spec in loaded.values()} - set(builtins())
    profiles = {Path(name).resolve() for name in named}
    for path, problem in invalid.items():
        if path not in profiles:
            raise problem
    specs = [(str(path), spec) for path, spec in loaded.items() if path not in profiles]
    return [
        Job(scenario_file=file, spec=spec, agent=agent, repeat=r)
        for file, spec in specs
        for agent in agents
        for r in range(repeat)
    ]
