"""Where a posture signal may come from: an evaluator run as a plain command, over input
the agent did not write itself.

Domain-free: the profile names the evaluator programs and the options that name their
input file; this module only reads a command line. A posture signal in the output of
anything else (``echo true``, ``cat``, a script the agent wrote, ``opa eval ...; echo
true``) moves no posture, whatever it prints.
"""

from __future__ import annotations

import posixpath
import shlex
from collections.abc import Collection, Iterable

__all__ = ["evaluator_refusal", "plain_words", "written_path"]

#: Characters that compose commands or expand to something else when unquoted.
_COMPOSING = frozenset(";|&<>()`$*?[\n\r")


def plain_words(command: str) -> list[str] | None:
    """The words of ``command`` if it is one plain command, else ``None``.

    Plain: one line, no operator (``;``, ``|``, ``&``, redirection, subshell), no
    expansion (``$``, backticks, globs) outside single quotes, every quote closed.
    """
    quote: str | None = None
    chars = iter(command)
    for char in chars:
        if char in "\n\r":
            return None
        if quote == "'":
            if char == "'":
                quote = None
        elif char == "\\":
            escaped = next(chars, "\n")
            if escaped in "\n\r":
                return None
        elif quote == '"':
            if char == '"':
                quote = None
            elif char in "$`":
                return None
        elif char in "'\"":
            quote = char
        elif char in _COMPOSING:
            return None
    if quote is not None:
        return None
    try:
        words = shlex.split(command)
    except ValueError:
        return None
    return words or None


def written_path(path: str) -> str:
    """A workdir path as the agent's write actions are remembered by."""
    return posixpath.normpath(path.strip())


def evaluator_refusal(
    command: str | None,
    *,
    programs: Collection[str],
    input_options: Iterable[str],
    written: Collection[str],
) -> str | None:
    """Why ``command``'s output may not carry a posture signal, or ``None`` if it may.

    ``programs`` are the evaluators (bare names, found on ``PATH``); ``input_options``
    the options that name an evaluator's input file; ``written`` the workdir paths the
    agent wrote with write actions (as :func:`written_path` gives them).
    """
    if not programs:
        return None
    words = plain_words(command or "")
    if words is None:
        return "not a plain command"
    if words[0] not in programs:
        return f"{words[0][:60]!r} is not an evaluator"
    for path in _inputs(words[1:], tuple(input_options)):
        if _agent_wrote(written_path(path), written):
            return f"its input {path[:60]!r} was written by the agent"
    return None


def _inputs(args: list[str], options: tuple[str, ...]) -> Iterable[str]:
    """The values given to ``options`` (``-i F``, ``-iF``, ``--input F``, ``--input=F``)."""
    for i, arg in enumerate(args):
        for option in options:
            if arg == option:
                if i + 1 < len(args):
                    yield args[i + 1]
            elif option.startswith("--") and arg.startswith(option + "="):
                yield arg[len(option) + 1 :]
            elif len(option) == 2 and arg.startswith(option) and not arg.startswith("--"):
                yield arg[2:].removeprefix("=")


def _agent_wrote(path: str, written: Collection[str]) -> bool:
    """``path`` is, or may be (ending in its name, from elsewhere), a file the agent wrote."""
    return path in written or any(path.endswith("/" + w) for w in written)
