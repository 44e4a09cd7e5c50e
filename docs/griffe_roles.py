"""A griffe extension for the API reference: the docstrings use Sphinx's inline markup
(``:class:`Gate```, ``:func:`~cmbs_async.run_scenario```, double backquotes), which
Markdown would show as written. Each role becomes inline code, linked to its entry in the
reference where it names a public name (one in ``cmbs_async.__all__`` or
``executors.__all__``, every one of which the reference documents): a cross-reference
that did not resolve would fail the strict build, so nothing else is linked.

``public_names()`` is also what ``docs/hooks.py`` builds the API pages from."""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

import griffe

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("cmbs_async", "executors")
ROLE = re.compile(r":(class|func|meth|attr|data|mod|exc|obj):`(~?)([^`]+?)`")
LITERAL = re.compile(r"``(.+?)``", re.S)  # Sphinx's ``code`` is Markdown's `code`


def public_names(package: str) -> list[str]:
    """The names in a package's ``__all__``, read from its source (nothing is imported)."""
    tree = ast.parse((ROOT / package / "__init__.py").read_text())
    for node in tree.body:
        target = node.targets[0] if isinstance(node, ast.Assign) else None
        if isinstance(target, ast.Name) and target.id == "__all__":
            return [name for name in ast.literal_eval(node.value) if not name.startswith("_")]
    raise ValueError(f"{package}/__init__.py has no __all__")


def documented() -> dict[str, str]:
    """Each public name and the identifier its entry has in the reference: a name both
    packages export (``CmbsError``) is documented once, as ``cmbs_async``'s."""
    where: dict[str, str] = {}
    for package in reversed(PACKAGES):
        where |= {name: f"{package}.{name}" for name in public_names(package)}
    return where


class SphinxRoles(griffe.Extension):
    """Rewrite Sphinx roles and literals in every docstring as Markdown."""

    def __init__(self) -> None:
        super().__init__()
        self.targets = documented()

    def on_object(self, *, obj: griffe.Object, loader: griffe.GriffeLoader, **_: Any) -> None:
        if obj.docstring is None:
            return
        text = LITERAL.sub(r"`\1`", obj.docstring.value)
        obj.docstring.value = ROLE.sub(self._code, text)

    def _code(self, match: re.Match[str]) -> str:
        role, short, target = match.groups()
        target = target.strip()
        shown = target.rsplit(".", 1)[-1] if short else target
        if role in ("func", "meth") and not shown.endswith(")"):
            shown += "()"
        name = target.rstrip("()").rsplit(".", 1)[-1]
        package = target.split(".", 1)[0]
        identifier = self.targets.get(name)
        if identifier is not None and (package == name or package in PACKAGES):
            return f"[`{shown}`][{identifier}]"
        return f"`{shown}`"
