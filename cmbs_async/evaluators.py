"""Evaluators as argument templates: the only commands whose output may carry a posture.

A profile declares each evaluator as the programs that may run it and an argument
template (``[eval, --data, "{policy}", --input, "{input}", data.check.result, --format,
raw]``): literal words, options with a literal value or a placeholder, flags. An
evaluation runs as an argument vector, with no shell, so that what the gate judged is
exactly what ran. It comes from an action that names the placeholders' values
(:meth:`Evaluator.build`), or from a free-form command that parses exactly into the
template (:meth:`Evaluator.fit`), in any of the spellings a command line allows: options
in any order, by any of their names, ``--name value``, ``--name=value``, ``-nvalue``.

Domain-free: what the words mean is the profile's business, never this module's.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["Evaluation", "Evaluator", "plain_words"]

#: Characters that compose commands or expand to something else when unquoted.
_COMPOSING = frozenset(";|&<>()`$*?[]{}~\n\r\t")


def plain_words(command: str) -> list[str] | None:
    """The words of ``command`` if it is one plain command, else ``None``.

    Plain: one line of words separated by spaces, no operator (``;``, ``|``, ``&``,
    redirection, subshell), no expansion (``$``, backticks, globs, braces, ``~``) and no
    backslash outside single quotes, every quote closed. Read that way, ``sh`` and this
    function split it into the same words.
    """
    quote: str | None = None
    for char in command:
        if quote == "'":
            if char == "'":
                quote = None
        elif char in "\n\r\x00":
            return None
        elif quote == '"':
            if char == '"':
                quote = None
            elif char in "$`\\":
                return None
        elif char in "'\"":
            quote = char
        elif char == "\\" or char in _COMPOSING:
            return None
    if quote is not None:
        return None
    try:
        words = shlex.split(command)
    except ValueError:
        return None
    return words or None


@dataclass(frozen=True, slots=True)
class Evaluation:
    """An evaluation the gate judged: exactly the vector that must run.

    ``argv`` starts with the program's bare name (the executor runs the file it resolves
    that name to); ``programs`` the names that may stand there instead (an action that
    named no program: the first found runs); ``inputs`` are the arguments that name input
    files, whose provenance is judged; ``files`` those that must be regular files in the
    workdir; ``variables`` the environment variables that name input files too;
    ``values`` the placeholders' values.
    """

    evaluator: str
    argv: tuple[str, ...]
    inputs: tuple[str, ...]
    values: Mapping[str, str]
    programs: tuple[str, ...]
    files: tuple[str, ...] = ()
    variables: tuple[str, ...] = ()

    def run_by(self, program: str) -> Evaluation:
        """The same evaluation, run by ``program`` (one of :attr:`programs`)."""
        if program not in self.programs:
            raise ValueError(f"{program} does not run this evaluation")
        return replace(self, argv=(program, *self.argv[1:]), programs=(program,))


@dataclass(frozen=True, slots=True)
class _Option:
    names: tuple[str, ...]
    value: str | None  # a literal, "{placeholder}", or None for a flag
    required: bool


def _placeholder(word: str) -> str | None:
    if len(word) > 2 and word[0] == "{" and word[-1] == "}":
        return word[1:-1]
    return None


class Evaluator(BaseModel):
    """One evaluator of a profile (see the module)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    #: bare program names that run it, in the order they are looked for
    programs: tuple[str, ...] = Field(min_length=1)
    #: the template: words, options with their value (a literal or ``{placeholder}``)
    argv: tuple[str, ...] = Field(min_length=1)
    #: options that may be left out, with their values, in the same form
    optional: tuple[str, ...] = ()
    #: options that take no value
    flags: tuple[str, ...] = ()
    #: other names of an option: ``{"--data": ["-d"]}``
    aliases: dict[str, tuple[str, ...]] = Field(default_factory=dict)
    #: the words a positional placeholder may be: ``{"kind": ["policyreport", "polr"]}``
    choices: dict[str, tuple[str, ...]] = Field(default_factory=dict)
    #: what a placeholder's value must be, as a regular expression it matches whole:
    #: ``{"policy": '.+\\.rego'}`` (a policy, never a data document holding the answer)
    patterns: dict[str, re.Pattern[str]] = Field(default_factory=dict)
    #: placeholders that name input files: an evaluation over the agent's own writing
    #: carries no posture
    inputs: tuple[str, ...] = ()
    #: placeholders that must name a regular file inside the workdir (a policy: never a
    #: directory of documents, nor a file elsewhere)
    files: tuple[str, ...] = ()
    #: environment variables that name input files the program reads by itself
    #: (``KUBECONFIG``): judged as inputs are
    variables: tuple[str, ...] = ()

    @model_validator(mode="after")
    def _check(self) -> Evaluator:
        for name in self.programs:
            if not name or "/" in name or name != name.strip():
                raise ValueError(f"an evaluator program is a bare name, not {name!r}")
        self._parsed()  # raises on a template that cannot be read
        names = self._placeholders()
        for name in (*self.inputs, *self.files, *self.choices, *self.patterns):
            if name not in names:
                raise ValueError(f"{name!r} is not a placeholder of the template")
        return self

    def _parsed(self) -> tuple[tuple[str, ...], dict[str, _Option]]:
        """The template's positional words and options (by their first name)."""
        positional: list[str] = []
        options: dict[str, _Option] = {}
        for part, required in ((self.argv, True), (self.optional, False)):
            words = iter(part)
            for word in words:
                if not word.startswith("-"):
                    if not required:
                        raise ValueError(f"optional parts are options, not {word!r}")
                    positional.append(word)
                    continue
                value = None if word in self.flags else next(words, None)
                if word not in self.flags and value is None:
                    raise ValueError(f"option {word} has no value in the template")
                names = (word, *self.aliases.get(word, ()))
                if any(name in o.names for o in options.values() for name in names):
                    raise ValueError(f"option {word} appears twice in the template")
                options[word] = _Option(names, value, required)
        return tuple(positional), options

    def _placeholders(self) -> set[str]:
        positional, options = self._parsed()
        words = [*positional, *(o.value for o in options.values() if o.value is not None)]
        return {name for word in words if (name := _placeholder(word)) is not None}

    def payload_schema(self) -> dict[str, Any]:
        """The JSON Schema of an action's payload that names the placeholders' values."""
        positional, options = self._parsed()
        required = [*positional, *(o.value for o in options.values() if o.required and o.value)]
        properties: dict[str, Any] = {}
        for name in sorted(self._placeholders()):
            choices = self.choices.get(name)
            properties[name] = {"type": "string", "minLength": 1} | (
                {"enum": list(choices)} if choices else {}
            )
        return {
            "type": "object",
            "properties": properties,
            "required": sorted({key for w in required if (key := _placeholder(w))}),
            "additionalProperties": False,
        }

    # -- from a structured action --------------------------------------------------------
    def build(self, name: str, values: Mapping[str, Any]) -> Evaluation:
        """The evaluation an action naming the placeholders' ``values`` asks for, run by
        the first of the programs found. :class:`ValueError` (one line) if a value is
        missing, unknown or not what the template allows."""
        known = self._placeholders()
        for key, value in values.items():
            if key not in known:
                raise ValueError(
                    f"{key}: not a value of this evaluation (it takes {sorted(known)})"
                )
            if not isinstance(value, str) or not value or "\x00" in value:
                raise ValueError(f"{key}: a non-empty string")
            if value.startswith("-"):
                raise ValueError(f"{key}: {value[:60]!r} would be read as an option")
        argv: list[str] = [self.programs[0]]
        argv += (self._value(word, values) for word in self.argv)
        words = iter(self.optional)
        for word in words:
            if word in self.flags:
                continue  # flags are for free-form commands only
            value = next(words)
            wanted = _placeholder(value)
            if wanted is None or wanted in values:
                argv += [word, self._value(value, values)]
        return self._evaluation(name, tuple(argv), values, self.programs)

    def _value(self, word: str, values: Mapping[str, Any]) -> str:
        key = _placeholder(word)
        if key is None:
            return word
        if key not in values:
            raise ValueError(f"{key}: missing")
        value = str(values[key])
        if not _allowed(key, value, self.choices, self.patterns):
            wanted = self.choices.get(key) or self.patterns[key].pattern
            raise ValueError(f"{key}: {value[:60]!r} is not {wanted}")
        return value

    # -- from a free-form command --------------------------------------------------------
    def fit(self, name: str, command: str) -> Evaluation | None:
        """The evaluation ``command`` is, if it is one plain command that parses exactly
        into the template (run as the vector it parsed into), else ``None``."""
        words = plain_words(command)
        if words is None or words[0] not in self.programs:
            return None
        positional, options = self._parsed()
        values: dict[str, str] = {}
        seen: set[str] = set()
        given: list[str] = []
        args = words[1:]
        i = 0
        while i < len(args):
            arg = args[i]
            i += 1
            if not arg.startswith("-") or arg == "-":
                given.append(arg)
                continue
            if arg == "--":
                return None
            found = _match(arg, options)
            if found is None:
                return None
            first, value = found
            option = options[first]
            if first in seen:
                return None
            seen.add(first)
            if option.value is None:
                if value is not None:
                    return None
                continue
            if value is None:
                if i >= len(args):
                    return None
                value, i = args[i], i + 1
            if not _bind(option.value, value, values, self.choices, self.patterns):
                return None
        if any(option.required and first not in seen for first, option in options.items()):
            return None
        if len(given) != len(positional):
            return None
        for word, arg in zip(positional, given, strict=True):
            if not _bind(word, arg, values, self.choices, self.patterns):
                return None
        return self._evaluation(name, tuple(words), values, (words[0],))

    def _evaluation(
        self,
        name: str,
        argv: tuple[str, ...],
        values: Mapping[str, str],
        programs: tuple[str, ...],
    ) -> Evaluation:
        inputs = tuple(str(values[key]) for key in self.inputs if key in values)
        files = tuple(str(values[key]) for key in self.files if key in values)
        return Evaluation(name, argv, inputs, dict(values), programs, files, self.variables)


def _match(arg: str, options: Mapping[str, _Option]) -> tuple[str, str | None] | None:
    """Which option ``arg`` is (by its first name) and the value glued to it, if any."""
    for first, option in options.items():
        for name in option.names:
            if arg == name:
                return first, None
            if option.value is None:
                continue
            if name.startswith("--"):
                if arg.startswith(name + "="):
                    return first, arg[len(name) + 1 :]
            elif len(name) == 2 and arg.startswith(name) and not arg.startswith("--"):
                return first, arg[2:].removeprefix("=")
    return None


def _allowed(
    key: str,
    value: str,
    choices: Mapping[str, tuple[str, ...]],
    patterns: Mapping[str, re.Pattern[str]],
) -> bool:
    """Whether ``value`` may fill the placeholder ``key``: never a word a program could
    read as an option (``-x``, ``--``), whatever the template allows."""
    if value.startswith("-") or (key in choices and value not in choices[key]):
        return False
    return key not in patterns or patterns[key].fullmatch(value) is not None


def _bind(
    template: str,
    word: str,
    values: dict[str, str],
    choices: Mapping[str, tuple[str, ...]],
    patterns: Mapping[str, re.Pattern[str]],
) -> bool:
    """Whether ``word`` fits ``template`` (a literal, or a placeholder it then fills)."""
    key = _placeholder(template)
    if key is None:
        return word == template
    if not word or not _allowed(key, word, choices, patterns):
        return False
    values[key] = word
    return True
