"""A batch: every scenario file times every agent spec times every repeat."""

from __future__ import annotations

import glob
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from .._errors import CmbsError
from .._reading import ReadError, read_json, read_yaml
from ..profile import builtin_profiles as builtins
from ..scenario import SCENARIO_MAX_BYTES, ScenarioError, ScenarioSpec, load_scenario

__all__ = ["BatchError", "Job", "expand_scenarios", "keyword_filter", "plan", "select"]

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


def plan(
    inputs: Sequence[str],
    agents: Sequence[str],
    repeat: int,
    *,
    skipped: list[str] | None = None,
) -> list[Job]:
    """Load and validate every scenario before anything runs.

    A file that is no scenario at all (one that does not parse, is not a mapping, or has
    neither ``id`` nor ``goal``: a results file, a ``--head-out`` checkpoint) is skipped,
    with a one-line note appended to ``skipped``; one that is meant as a scenario (it has an
    ``id`` or a ``goal``) but is invalid is an error. When nothing is left, the first
    file's problem is the error.
    """
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
    notes = []
    for path, problem in invalid.items():
        if path in profiles:
            continue
        why = _not_a_scenario(path)
        if why is None:
            raise problem
        notes.append(f"skipped {path}: not a scenario ({why})")
    specs = [(str(path), spec) for path, spec in loaded.items() if path not in profiles]
    if not specs:
        first = next((e for path, e in invalid.items() if path not in profiles), None)
        raise first or BatchError(f"no scenario files at {', '.join(inputs)}")
    if skipped is not None:
        skipped += notes
    return [
        Job(scenario_file=file, spec=spec, agent=agent, repeat=r)
        for file, spec in specs
        for agent in agents
        for r in range(repeat)
    ]


def _not_a_scenario(path: Path) -> str | None:
    """Why ``path`` is no scenario at all, or None for a file meant as one (a mapping with
    an ``id`` or a ``goal``), whose problem is then the user's to fix."""
    read = read_json if path.suffix == ".json" else read_yaml
    try:
        data = read(path, what="a scenario file", max_bytes=SCENARIO_MAX_BYTES)
    except ReadError as exc:
        return str(exc).removeprefix(f"{path}: ")
    if not isinstance(data, dict):
        return "not a mapping of fields"
    if "id" in data or "goal" in data:
        return None
    return "neither id nor goal"


_TOKEN = re.compile(r"\s*(\(|\)|[^\s()]+)")


def keyword_filter(pattern: str) -> Callable[[Sequence[str]], bool]:
    """``-k PATTERN`` as pytest reads it: words matched as case-insensitive substrings of
    any of the names given, combined with ``and``, ``or``, ``not`` and parentheses
    (``kyverno and not update``). A pattern that does not parse is a BatchError."""
    tokens: list[str] = []
    position = 0
    while position < len(pattern):
        match = _TOKEN.match(pattern, position)
        if match is None:  # only trailing blanks are left
            break
        tokens.append(match.group(1))
        position = match.end()
    where = 0

    def peek() -> str | None:
        return tokens[where] if where < len(tokens) else None

    def take() -> str:
        nonlocal where
        token = peek()
        if token is None:
            raise BatchError(f"-k {pattern!r}: unexpected end of the pattern")
        where += 1
        return token

    Match = Callable[[Sequence[str]], bool]

    def either() -> Match:
        left = both()
        while peek() == "or":
            take()
            left = _or(left, both())
        return left

    def both() -> Match:
        left = negated()
        while peek() == "and":
            take()
            left = _and(left, negated())
        return left

    def negated() -> Match:
        token = take()
        if token == "not":
            inner = negated()
            return lambda names: not inner(names)
        if token == "(":
            inner = either()
            if take() != ")":
                raise BatchError(f"-k {pattern!r}: a ( is not closed")
            return inner
        if token in (")", "and", "or"):
            raise BatchError(f"-k {pattern!r}: unexpected {token!r}")
        word = token.casefold()
        return lambda names: any(word in name.casefold() for name in names)

    if not tokens:
        raise BatchError("-k: the pattern is empty")
    matcher = either()
    if peek() is not None:
        raise BatchError(f"-k {pattern!r}: unexpected {peek()!r}")
    return matcher


def _and(
    left: Callable[[Sequence[str]], bool], right: Callable[[Sequence[str]], bool]
) -> Callable[[Sequence[str]], bool]:
    return lambda names: left(names) and right(names)


def _or(
    left: Callable[[Sequence[str]], bool], right: Callable[[Sequence[str]], bool]
) -> Callable[[Sequence[str]], bool]:
    return lambda names: left(names) or right(names)


def select(jobs: Sequence[Job], pattern: str) -> list[Job]:
    """The jobs whose scenario's id or file name (without its suffix, which every
    scenario file has) matches ``pattern`` (see :func:`keyword_filter`); none selected is a
    BatchError."""
    matches = keyword_filter(pattern)
    chosen = [j for j in jobs if matches((j.spec.id, Path(j.scenario_file).stem))]
    if jobs and not chosen:
        count = len({job.scenario_file for job in jobs})
        raise BatchError(f"-k {pattern!r} selects none of the {count} scenarios")
    return chosen
