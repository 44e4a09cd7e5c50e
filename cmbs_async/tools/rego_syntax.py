"""The Rego forms ``cmbs-opa`` refuses: the two v0 forms OPA 1.x refuses, found the way
OPA's parser reports them, and a form ``regopy`` evaluates wrongly.

``regopy`` accepts v0 and v1 alike; OPA 1.0 (what IT-Bench's evaluator runs) parses v1
only and rejects a rule body without ``if`` (``allow { ... }``) and a partial set rule
without ``contains`` (``deny[msg] { ... }``). This scanner reads a module's top level
(strings, raw strings and comments skipped) and names the first such form, so that
``cmbs-opa`` refuses what OPA would.

``regopy`` (1.5.2, the newest) gets ``not`` inside an ``every`` body wrong: ``every x in
[1, 2] { not x == 2 }`` comes out true. An evaluator that answers wrongly would let an
agent earn the wrong posture, so ``cmbs-opa`` refuses such a policy (a rule of its own
that the body calls is evaluated rightly).
"""

from __future__ import annotations

import re

__all__ = ["V1_IF_REQUIRED", "V1_CONTAINS_REQUIRED", "negation_in_every", "v0_form"]

V1_IF_REQUIRED = "`if` keyword is required before rule body"
V1_CONTAINS_REQUIRED = "`contains` keyword is required for partial set rules"

_TOKEN = re.compile(
    r'(?P<skip>"(?:\\.|[^"\\\n])*"|`[^`]*`|#[^\n]*|[ \t\r]+)'
    r"|(?P<newline>\n)"
    r"|(?P<word>[A-Za-z_][A-Za-z0-9_]*)"
    r"|(?P<op>:=|==|!=|<=|>=|.)",
    re.S,
)
_OPEN, _CLOSE = "([{", ")]}"
#: what may come right before a top-level ``{`` that is a value, not a rule body
_BEFORE_A_VALUE = {"if", "else", ":=", "=", "==", "!=", ",", "(", "[", "{", "contains", "in"}
_NOT_RULES = {"package", "import", "default"}


def v0_form(module: str) -> tuple[int, str] | None:
    """The line and OPA's message for the first v0-only form in ``module``, or ``None``."""
    depth, line = 0, 1
    statement: list[str] = []  # the top-level tokens of the statement being read
    for match in _TOKEN.finditer(module):
        kind, text = match.lastgroup, match.group()
        if kind == "skip":
            line += text.count("\n")
            continue
        if kind == "newline":
            line += 1
            if depth == 0:
                statement = []
            continue
        if text in _CLOSE:  # the bracket that closes back to the top level is part of it
            depth = max(depth - 1, 0)
            if depth == 0:
                statement.append(text)
            continue
        if depth == 0:
            found = _at_top_level(statement, text)
            if found is not None:
                return line, found
            statement.append(text)
        if text in _OPEN:
            depth += 1
    return None


def negation_in_every(module: str) -> int | None:
    """The line of the first ``not`` inside an ``every`` body in ``module``, or ``None``."""
    depth, line = 0, 1
    every_at: list[int] = []  # the depths of the ``every`` bodies open around here
    waiting = False  # an ``every`` was read, its body's ``{`` not yet
    for match in _TOKEN.finditer(module):
        kind, text = match.lastgroup, match.group()
        if kind in ("skip", "newline"):
            line += text.count("\n")
            continue
        if text == "every":
            waiting = True
        elif text == "not" and every_at:
            return line
        elif text in _OPEN:
            depth += 1
            if waiting and text == "{":
                every_at.append(depth)
                waiting = False
        elif text in _CLOSE:
            if every_at and every_at[-1] == depth:
                every_at.pop()
            depth = max(depth - 1, 0)
    return None


def _at_top_level(statement: list[str], token: str) -> str | None:
    """What is wrong, if anything, with ``token`` following ``statement`` at top level."""
    if token not in ("{", "if") or not statement or statement[0] in _NOT_RULES:
        return None
    if _partial_set_head(statement):
        return V1_CONTAINS_REQUIRED
    if token == "{" and statement[-1] not in _BEFORE_A_VALUE:
        return V1_IF_REQUIRED
    return None


def _partial_set_head(statement: list[str]) -> bool:
    """``name[term]`` and nothing after the bracket: a v0 partial set rule's head."""
    if len(statement) < 3 or statement[1] != "[" or statement[-1] != "]":
        return False
    return re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", statement[0]) is not None and not any(
        token in (":=", "=", "contains", "if") for token in statement
    )
