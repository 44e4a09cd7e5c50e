"""A batch: every scenario file times every agent spec times every repeat."""

from __future__ import annotations

import glob
import re
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from functools import cached_property
from pathlib import Path

from .. import __version__
from .._errors import CmbsError
from .._reading import ReadError, read_bytes, read_json, read_yaml
from .._text import escape_controls
from ..agents.scripted import STEPS_MAX_BYTES
from ..audit.signing import canonical, digest
from ..profile import Profile, load_profile
from ..profile import builtin_profiles as builtins
from ..scenario import SCENARIO_MAX_BYTES, ScenarioError, ScenarioSpec, load_scenario

__all__ = [
    "BatchError",
    "Inputs",
    "Job",
    "expand_scenarios",
    "keyword_filter",
    "plan",
    "select",
    "shown",
    "utf8_or_refused",
]

_SUFFIXES = (".yaml", ".yml", ".json")


class BatchError(CmbsError, ValueError):
    """A batch that cannot be planned or run; the message is one line."""


def shown(text: str) -> str:
    """``text`` (a path, an agent spec) for a one-line message: bytes of a file name that
    are not UTF-8 as ``\\xff``, every control character escaped."""
    try:
        raw = text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:  # a lone surrogate no file name gave: shown as one
        return escape_controls(text)
    return escape_controls(raw.decode("utf-8", "backslashreplace"))


def utf8_or_refused(text: str, what: str) -> str:
    """``text`` if it is UTF-8 text, else a :class:`BatchError` naming it (``what``, then
    ``text`` with escapes): a result line, signed as UTF-8 JSON, could not hold it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise BatchError(
            f"{what} {shown(text)} is not UTF-8 text, which a result line cannot hold"
        ) from None
    return text


@dataclass(frozen=True)
class Inputs:
    """What a job runs, by content: SHA-256 digests of the scenario (its validated spec as
    canonical JSON, less what no run sees: ``expected`` and where its profile lives), the
    agent (its spec, and a ``script:``'s file), the profile (its validated content); where
    its commands run (``local`` or an ``ssh://`` target); the cmbs version."""

    scenario: str
    agent: str
    profile: str
    executor: str
    cmbs: str

    @classmethod
    def of(
        cls,
        spec: ScenarioSpec,
        agent: str,
        *,
        agent_digest: str | None = None,
        profile: Profile | None = None,
        executor: str | None = None,
    ) -> Inputs:
        """The inputs of ``spec`` run by ``agent``; without ``agent_digest`` the agent is
        known by its spec alone, without ``profile`` the profile by its name."""

        scenario = spec.model_dump(mode="json", exclude={"expected", "profile"})
        shown = profile.model_dump(mode="json") if profile is not None else spec.profile
        return cls(
            scenario=digest(canonical(scenario)),
            agent=agent_digest or digest(canonical([agent])),
            profile=digest(canonical(shown)),
            executor=executor or spec.host or "local",
            cmbs=__version__,
        )

    @property
    def digest(self) -> str:
        return digest(canonical(asdict(self)))

    def changed(self, before: object) -> list[str]:
        """The parts that differ from ``before`` (a result line's ``inputs``), in words."""
        if not isinstance(before, dict):
            return ["scenario", "agent", "profile"]  # a line of an older cmbs: unknown
        names = {"cmbs": "cmbs version"}
        return [names.get(k, k) for k, v in asdict(self).items() if before.get(k) != v]


@dataclass(frozen=True)
class Job:
    """One run of a batch. ``key`` names it in the results file, for resuming: a digest
    of its ``inputs`` (what it runs, see :class:`Inputs`; :func:`plan` reads every file
    they name) and its repeat number. A job made without ``inputs`` is keyed by its spec
    and agent spec alone."""

    scenario_file: str
    spec: ScenarioSpec
    agent: str
    repeat: int
    inputs: Inputs | None = None

    @cached_property
    def key(self) -> str:
        return f"{self.what.digest}#{self.repeat}"

    @property
    def what(self) -> Inputs:
        """Its inputs, as given or as known from the spec alone."""
        return self.inputs or Inputs.of(self.spec, self.agent)

    @property
    def where(self) -> str:
        """Where its commands run: ``local`` or an ``ssh://`` target."""
        return self.what.executor


def expand_scenarios(inputs: Sequence[str]) -> list[Path]:
    """Files as given, directories searched for scenario files, globs expanded; each once,
    as its resolved path (a job's ``scenario_file``, however it was spelt)."""
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
            raise BatchError(f"no scenario files at {shown(item)}")
        found += [m for m in (m.resolve() for m in matches) if m not in found]
    return found


def plan(
    inputs: Sequence[str],
    agents: Sequence[str],
    repeat: int,
    *,
    skipped: list[str] | None = None,
    executor: str | None = None,
) -> list[Job]:
    """Load and validate every scenario before anything runs, and key each job by what it
    runs (:class:`Inputs`: the files of its scenario, agent and profile are read now).

    A file that is no scenario at all (one that does not parse, is not a mapping, or has
    neither ``id`` nor ``goal``: a results file, a ``--head-out`` checkpoint) is skipped,
    with a one-line note appended to ``skipped``; one that is meant as a scenario (it has an
    ``id`` or a ``goal``) but is invalid is an error. When nothing is left, the first
    file's problem is the error. Two files with one scenario id are an error (their runs
    would be one row of the summary). ``executor`` (``--executor``) is where every job's
    commands run; without it, each scenario's ``host`` or ``local``.
    """
    if repeat < 1:
        raise BatchError("--repeat must be at least 1")
    if not agents:
        raise BatchError("at least one --agent is needed")
    for agent in agents:  # every result line names its agent spec
        utf8_or_refused(agent, "--agent")
    if executor is not None:
        utf8_or_refused(executor, "--executor")
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
        notes.append(f"skipped {shown(str(path))}: not a scenario ({why})")
    specs = [(str(path), spec) for path, spec in loaded.items() if path not in profiles]
    if not specs:
        first = next((e for path, e in invalid.items() if path not in profiles), None)
        raise first or BatchError(f"no scenario files at {', '.join(map(shown, inputs))}")
    for file, _ in specs:  # every result line names its scenario file
        utf8_or_refused(file, "scenario file")
    _unique_ids(specs)
    if skipped is not None:
        skipped += notes
    of_profile = {name: load_profile(name) for name in dict.fromkeys(s.profile for _, s in specs)}
    of_agent = {agent: _agent_digest(agent) for agent in agents}
    jobs = []
    for file, spec in specs:
        for agent in agents:
            what = Inputs.of(
                spec,
                agent,
                agent_digest=of_agent[agent],
                profile=of_profile[spec.profile],
                executor=executor,
            )
            jobs += [Job(file, spec, agent, r, what) for r in range(repeat)]
    return jobs


def _unique_ids(specs: Sequence[tuple[str, ScenarioSpec]]) -> None:
    """Refuse two files that give one scenario id."""
    first: dict[str, str] = {}
    for file, spec in specs:
        other = first.setdefault(spec.id, file)
        if other != file:
            raise BatchError(
                escape_controls(
                    f"scenario id {spec.id!r} is given by both {other} and {file}: "
                    "each scenario of a batch needs an id of its own"
                )
            )


def _agent_digest(agent: str) -> str:
    """The agent by what it runs: its spec, and a ``script:``'s file as it is now."""
    kind, sep, rest = agent.partition(":")
    if kind != "script" or not sep or not rest:
        return digest(canonical([agent]))
    try:
        content = read_bytes(rest, what="a steps file", max_bytes=STEPS_MAX_BYTES)
    except ReadError as exc:  # as the agent itself would say it
        raise BatchError(escape_controls(f"--agent {agent}: {exc}")) from None
    return digest(canonical([agent, digest(content)]))


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
