"""Bounded reads: every file a user or an agent hands cmbs-async, read with caps.

A file is read through :func:`read_bytes` (and the text and format readers built on it):
at most ``max_bytes + 1`` bytes are ever taken, so ``/dev/zero``, a FIFO that never ends
or a file of gigabytes costs no more memory than the cap, and each ends in one line
naming the file and the cap. Nesting is checked before a parser recurses (a cheap scan of
brackets for JSON and TOML, the event stream for YAML, with aliases counted as what they
expand to), so no parser ever raises ``RecursionError``. Every failure is a
:class:`ReadError`, one line, beginning with the file's name.
"""

from __future__ import annotations

import json
import os
import re
import stat
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ._errors import CmbsError, one_line

__all__ = [
    "DEFAULT_MAX_BYTES",
    "DEFAULT_MAX_DEPTH",
    "DEFAULT_MAX_NODES",
    "ReadError",
    "json_depth_error",
    "loads_json",
    "loads_toml",
    "loads_yaml",
    "read_bytes",
    "read_upto",
    "read_json",
    "read_text",
    "read_toml",
    "read_yaml",
    "size_text",
]

#: The most bytes read from a file unless a caller says otherwise.
DEFAULT_MAX_BYTES = 8 * 1024 * 1024
#: The deepest nesting of lists and mappings a structured file may have.
DEFAULT_MAX_DEPTH = 64
#: The most nodes the aliases of a YAML document may repeat (each counted as what it
#: repeats): the nodes written out are bounded by the size cap already.
DEFAULT_MAX_NODES = 1_000_000

_CHUNK = 1024 * 1024


class ReadError(CmbsError, ValueError):
    """A file that could not be read within its caps, or parsed; the message is one line
    beginning with the file's name."""


def size_text(size: int) -> str:
    """``8 MiB``, ``64 KiB``, ``100 bytes``: a cap as a person reads it."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= scale and size % scale == 0:
            return f"{size // scale} {unit}"
    return f"{size} bytes"


def read_upto(fd: int, limit: int, *, offset: int | None = None) -> bytes:
    """At most ``limit`` bytes of ``fd``, in chunks: from ``offset`` (``pread``: the file's
    position stays where it is), else from its position."""
    chunks: list[bytes] = []
    taken = 0
    while taken < limit:
        size = min(_CHUNK, limit - taken)
        chunk = os.read(fd, size) if offset is None else os.pread(fd, size, offset + taken)
        if not chunk:
            break
        chunks.append(chunk)
        taken += len(chunk)
    return b"".join(chunks)


def read_bytes(path: str | Path, *, what: str, max_bytes: int = DEFAULT_MAX_BYTES) -> bytes:
    """At most ``max_bytes`` of ``path``; :class:`ReadError` if there are more.

    ``what`` names the kind of file for the message (``"a scenario file"``). The file is
    opened without blocking (a FIFO with no writer reads as empty, it never hangs the
    open), then read in chunks up to one byte past the cap, whatever kind of file it is.
    """
    name = str(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise ReadError(f"{name}: cannot read: {exc.strerror or exc}") from None
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise ReadError(f"{name}: cannot read: Is a directory")
        if not stat.S_ISREG(mode):  # a FIFO or a device: block on reads, as a file would
            os.set_blocking(fd, True)
        elif os.fstat(fd).st_size > max_bytes:  # known before reading it
            raise ReadError(_too_large(name, max_bytes, what))
        data = read_upto(fd, max_bytes + 1)  # one byte past the cap says there is more
    except OSError as exc:
        raise ReadError(f"{name}: cannot read: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    if len(data) > max_bytes:
        raise ReadError(_too_large(name, max_bytes, what))
    return data


def read_text(path: str | Path, *, what: str, max_bytes: int = DEFAULT_MAX_BYTES) -> str:
    """The UTF-8 text of ``path``, read as :func:`read_bytes` reads it."""
    data = read_bytes(path, what=what, max_bytes=max_bytes)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ReadError(f"{path}: not UTF-8 text (byte {exc.start})") from None


def read_json(
    path: str | Path,
    *,
    what: str,
    max_bytes: int = DEFAULT_MAX_BYTES,
    max_depth: int = DEFAULT_MAX_DEPTH,
) -> Any:
    """The JSON document in ``path``, size and nesting checked before it is parsed."""
    return loads_json(
        read_text(path, what=what, max_bytes=max_bytes), origin=str(path), max_depth=max_depth
    )


def read_yaml(
    path: str | Path,
    *,
    what: str,
    max_bytes: int = DEFAULT_MAX_BYTES,
    max_depth: int = DEFAULT_MAX_DEPTH,
    max_nodes: int = DEFAULT_MAX_NODES,
) -> Any:
    """The YAML document in ``path`` (safe tags only), with its size, nesting and
    expansion (aliases) checked before it is built."""
    text = read_text(path, what=what, max_bytes=max_bytes)
    return loads_yaml(text, origin=str(path), max_depth=max_depth, max_nodes=max_nodes)


def read_toml(
    path: str | Path,
    *,
    what: str,
    max_bytes: int = DEFAULT_MAX_BYTES,
    max_depth: int = DEFAULT_MAX_DEPTH,
) -> dict[str, Any]:
    """The TOML document in ``path``, size and nesting checked before it is parsed."""
    return loads_toml(
        read_text(path, what=what, max_bytes=max_bytes), origin=str(path), max_depth=max_depth
    )


# --- parsing text already in memory ---------------------------------------------------

_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_BRACKETS = re.compile(r"[\[\]{}]")


def json_depth_error(text: str, max_depth: int = DEFAULT_MAX_DEPTH) -> str | None:
    """``nested deeper than N levels`` if ``text`` (JSON) opens more than ``max_depth``
    lists and objects at once, else ``None``; strings are skipped, nothing is parsed."""
    if text.count("[") + text.count("{") <= max_depth:
        return None
    depth = 0
    for match in _BRACKETS.finditer(_JSON_STRING.sub('""', text)):
        if match.group() in "[{":
            depth += 1
            if depth > max_depth:
                return f"nested deeper than {max_depth} levels"
        else:
            depth -= 1
    return None


def loads_json(text: str, *, origin: str, max_depth: int = DEFAULT_MAX_DEPTH) -> Any:
    """``text`` parsed as JSON; :class:`ReadError` (``ORIGIN: ...``) if it is nested too
    deeply or is not JSON."""
    too_deep = json_depth_error(text, max_depth)
    if too_deep:
        raise ReadError(f"{origin}: {too_deep}")
    try:
        return json.loads(text)
    except ValueError as exc:
        raise ReadError(f"{origin}: not valid JSON: {one_line(str(exc))}") from None
    except RecursionError:  # not reached after the scan; kept so none ever escapes
        raise ReadError(f"{origin}: nested deeper than {max_depth} levels") from None


try:  # libyaml when it is there: the Python parser is slow on large files
    _SafeLoader: type[yaml.SafeLoader] = yaml.CSafeLoader  # type: ignore[assignment]
except AttributeError:  # pragma: no cover - PyYAML built without libyaml
    _SafeLoader = yaml.SafeLoader


@dataclass
class _Open:
    anchor: str | None
    nodes: int = 1
    depth: int = field(default=0)


def _check_yaml_events(text: str, origin: str, max_depth: int, max_nodes: int) -> None:
    """Walk the event stream (no recursion, nothing built) and refuse a document that
    nests more than ``max_depth`` deep or whose aliases repeat more than ``max_nodes``
    nodes, each alias counted as the node it repeats (so "a billion laughs" is refused
    early, before a structure is built that a walk over it would never finish)."""
    sizes: dict[str, tuple[int, int]] = {}  # anchor -> (nodes, depth below it)
    stack: list[_Open] = [_Open(None, 0)]
    total = 0

    def add(nodes: int, below: int, *, repeated: bool = False) -> None:
        nonlocal total
        total += nodes if repeated else 0
        if total > max_nodes:
            raise ReadError(f"{origin}: aliases repeat more than {max_nodes} nodes")
        if len(stack) - 1 + below > max_depth:
            raise ReadError(f"{origin}: nested deeper than {max_depth} levels")
        stack[-1].nodes += nodes
        stack[-1].depth = max(stack[-1].depth, below)

    for event in yaml.parse(text, Loader=_SafeLoader):
        if isinstance(event, yaml.CollectionStartEvent):
            if len(stack) > max_depth:
                raise ReadError(f"{origin}: nested deeper than {max_depth} levels")
            stack.append(_Open(event.anchor))
        elif isinstance(event, yaml.CollectionEndEvent):
            done = stack.pop()
            if done.anchor is not None:
                sizes[done.anchor] = (done.nodes, done.depth + 1)
            add(done.nodes, done.depth + 1)
        elif isinstance(event, yaml.ScalarEvent):
            if event.anchor is not None:
                sizes[event.anchor] = (1, 0)
            add(1, 0)
        elif isinstance(event, yaml.AliasEvent):
            nodes, below = sizes.get(event.anchor or "", (1, 0))
            add(nodes, below, repeated=True)


def loads_yaml(
    text: str,
    *,
    origin: str,
    max_depth: int = DEFAULT_MAX_DEPTH,
    max_nodes: int = DEFAULT_MAX_NODES,
) -> Any:
    """``text`` parsed as one YAML document with safe tags; :class:`ReadError`
    (``ORIGIN: ...``) if it nests or expands past the caps or is not YAML."""
    try:
        _check_yaml_events(text, origin, max_depth, max_nodes)
        return yaml.load(text, Loader=_SafeLoader)  # noqa: S506 - a safe loader
    except yaml.YAMLError as exc:
        if "maximum nesting depth" in str(exc):  # libyaml's own limit, met first in a flow
            raise ReadError(f"{origin}: nested deeper than {max_depth} levels") from None
        raise ReadError(f"{origin}: not valid YAML: {one_line(str(exc))}") from None
    except RecursionError:  # not reached after the walk; kept so none ever escapes
        raise ReadError(f"{origin}: nested deeper than {max_depth} levels") from None


_TOML_SKIPPED = re.compile(
    r'"""(?:[^\\]|\\.)*?"""|\'\'\'.*?\'\'\'|"[^"\\\n]*(?:\\.[^"\\\n]*)*"|\'[^\'\n]*\'|#[^\n]*',
    re.DOTALL,
)


def loads_toml(text: str, *, origin: str, max_depth: int = DEFAULT_MAX_DEPTH) -> dict[str, Any]:
    """``text`` parsed as TOML; :class:`ReadError` (``ORIGIN: ...``) if its arrays and
    inline tables nest too deeply or it is not TOML."""
    if text.count("[") + text.count("{") > max_depth:
        too_deep = json_depth_error(_TOML_SKIPPED.sub("", text), max_depth)
        if too_deep:
            raise ReadError(f"{origin}: {too_deep}")
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ReadError(f"{origin}: not valid TOML: {one_line(str(exc))}") from None
    except RecursionError:
        raise ReadError(f"{origin}: nested deeper than {max_depth} levels") from None


def _too_large(name: str, max_bytes: int, what: str) -> str:
    return f"{name}: larger than {size_text(max_bytes)} (the cap for {what})"
