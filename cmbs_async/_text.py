"""Untrusted text made safe for a terminal, and the tables the CLI prints it in."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

__all__ = ["escape_controls", "table"]

_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}

#: C0 and C1 controls, DEL, line and paragraph separators, bidi marks, embeddings,
#: overrides and isolates, and lone surrogates (which cannot even be encoded).
_CONTROLS = [
    *range(0x00, 0x20),
    *range(0x7F, 0xA0),
    0x061C,
    0x200E,
    0x200F,
    *range(0x2028, 0x202F),
    *range(0x2066, 0x206A),
    *range(0xD800, 0xE000),
]


def _visible(code: int) -> str:
    char = chr(code)
    return _NAMED.get(char) or (f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")


_ESCAPES = {code: _visible(code) for code in _CONTROLS}


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
