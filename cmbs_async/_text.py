"""Untrusted text made safe for a terminal, and the tables the CLI prints it in."""

from __future__ import annotations

import unicodedata
from collections.abc import Iterable, Sequence

__all__ = ["escape_controls", "table"]

_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}

#: Unicode categories never shown as themselves: controls (C0, C1, DEL), formats (bidi
#: marks, overrides and isolates, zero-width characters), private use, lone surrogates,
#: unassigned code points, and line and paragraph separators.
_HIDDEN = frozenset({"Cc", "Cf", "Co", "Cs", "Cn", "Zl", "Zp"})


class _Escapes(dict[int, str]):
    """``str.translate``'s table, filled in as code points are met."""

    def __missing__(self, code: int) -> str:
        char = chr(code)
        if unicodedata.category(char) not in _HIDDEN:
            shown = char
        else:
            shown = _NAMED.get(char) or _numbered(code)
        if code < 0x10000:  # the basic plane is kept; the rest, rare, is looked up again
            self[code] = shown
        return shown


def _numbered(code: int) -> str:
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


_ESCAPES = _Escapes()


def escape_controls(text: str) -> str:
    """``text`` with every control character shown as a visible escape (``\\n``, ``\\x1b``,
    ``\\u202e``): an agent's or a command's string stays on its line and cannot steer the
    terminal (colours, cursor moves, a fake ``outcome`` line, text reversed)."""
    return text.translate(_ESCAPES)


def table(rows: Iterable[Sequence[str]], *, rule: bool = False) -> list[str]:
    """Rows as aligned lines, every cell escaped; the last column is left ragged.

    ``rule`` underlines the first row (the header) with dashes.
    """
    cells = [[escape_controls(cell) for cell in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]) - 1)]
    if rule:
        cells.insert(1, ["-" * width for width in widths] + ["-" * 8])
    return [
        "  ".join([*(c.ljust(w) for c, w in zip(row[:-1], widths, strict=True)), row[-1]]).rstrip()
        for row in cells
    ]
