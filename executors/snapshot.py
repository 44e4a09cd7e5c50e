"""What a workdir holds, file by file, and what an action changed in it.

The gate judges an evaluation's input by the file it is, not by how its name is spelled:
each file is known by its inode and the SHA-256 of its content. A snapshot is taken after
every action; a file whose inode, size and times are unchanged keeps its hash, so a step
that touches nothing costs one ``stat`` per file.

Standard library only, and code Python 3.6 runs: the SSH executor's remote launcher takes
its snapshots with this module too (sent inlined with it).
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
from typing import TYPE_CHECKING

__all__ = ["MAX_ENTRIES", "Snapshot", "diff", "identify", "locate", "take"]

#: Most files a snapshot records; a workdir with more is recorded up to here, marked.
MAX_ENTRIES = 100000
#: Deepest directory a snapshot descends into (as deep as artifact paths go).
MAX_TREE_DEPTH = 64
#: Symbolic links followed when a path is identified, at most.
MAX_LINKS = 40
_CHUNK = 1 << 20

if TYPE_CHECKING:
    from typing import Any

    # An entry: [kind, inode, size, mtime_ns, ctime_ns, sha256 or None, link target or
    # None]; kind "f" (regular file), "l" (link), "d" (directory), "o" (anything else).
    Entry = list[Any]
    Snapshot = dict[str, Any]  # {relative path: Entry}, "" -> None when cut at MAX_ENTRIES


def _sha256(fd: int) -> str:
    digest = hashlib.sha256()
    while True:
        chunk = os.read(fd, _CHUNK)
        if not chunk:
            return digest.hexdigest()
        digest.update(chunk)


def _hash_at(dir_fd: int, name: str, expected: os.stat_result) -> str | None:
    """The content hash of the regular file ``name``, if it is still the file ``expected``."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        now = os.fstat(fd)
        if not stat.S_ISREG(now.st_mode) or now.st_ino != expected.st_ino:
            return None
        return _sha256(fd)
    except OSError:
        return None
    finally:
        os.close(fd)


def _entry(dir_fd: int, name: str, info: os.stat_result, previous: Entry | None) -> Entry:
    mode = info.st_mode
    key = [info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns]
    if stat.S_ISREG(mode):
        if previous is not None and previous[0] == "f" and previous[1:5] == key:
            return previous
        return ["f", *key, _hash_at(dir_fd, name, info), None]
    if stat.S_ISLNK(mode):
        try:
            target = os.readlink(name, dir_fd=dir_fd)
        except OSError:
            target = None
        return ["l", *key, None, target]
    return ["d" if stat.S_ISDIR(mode) else "o", *key, None, None]


def take(root: str, previous: Snapshot | None = None) -> Snapshot:
    """Every file, link and directory under ``root`` (not following links), by relative path.

    ``previous`` (an earlier snapshot of the same root) spares hashing what did not change.
    """
    previous = previous or {}
    found: Snapshot = {}
    try:
        top = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return found
    pending = [("", top, 0)]
    try:
        while pending:
            prefix, dir_fd, depth = pending.pop()
            try:
                names = sorted(os.listdir(dir_fd))
            except OSError:
                names = []
            for name in names:
                if len(found) >= MAX_ENTRIES:
                    found[""] = None
                    break
                path = prefix + name
                try:
                    info = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
                except OSError:
                    continue
                entry = _entry(dir_fd, name, info, previous.get(path))
                found[path] = entry
                if entry[0] == "d" and depth < MAX_TREE_DEPTH:
                    try:
                        child = os.open(
                            name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dir_fd
                        )
                    except OSError:
                        continue
                    pending.append((path + "/", child, depth + 1))
            os.close(dir_fd)
    finally:
        for _prefix, dir_fd, _depth in pending:
            os.close(dir_fd)
    return found


def diff(before: Snapshot, after: Snapshot) -> list[dict[str, Any]]:
    """The files (not directories) created, changed, renamed, linked or removed from
    ``before`` to ``after``: a rename is a path gone and one come with its inode (said once,
    as ``renamed`` from its ``source``); a link, a new path with the inode of one that
    stays (``linked``)."""
    gone = {
        path: entry
        for path, entry in before.items()
        if path and entry[0] != "d" and path not in after
    }
    by_inode: dict[int, str] = {}  # a path that has each inode, to name as a link's source
    for path, entry in after.items():
        if path and entry[0] != "d" and path in before:
            by_inode.setdefault(entry[1], path)
    moved: dict[int, str] = {}
    for path, entry in gone.items():
        moved.setdefault(entry[1], path)
    changes = []
    for path, entry in sorted(after.items()):
        if not path or entry[0] == "d":
            continue
        old = before.get(path)
        source = None
        if old is None or old[0] == "d":
            change = "created"
            if entry[1] in moved and _same(gone[moved[entry[1]]], entry):
                change, source = "renamed", moved.pop(entry[1])
                gone.pop(source, None)
            elif entry[1] in by_inode:
                change, source = "linked", by_inode[entry[1]]
        elif old[:3] != entry[:3] or old[5:] != entry[5:]:
            change = "changed"
        else:
            continue
        by_inode.setdefault(entry[1], path)
        changes.append(_change(path, change, entry, source))
    for path, entry in sorted(gone.items()):
        changes.append(_change(path, "removed", entry, None))
    return changes


def _same(old: Entry, new: Entry) -> bool:
    """Whether ``new`` is ``old`` moved, not a new file that got a freed inode number."""
    return old[0] == new[0] and old[2:4] == new[2:4] and old[5:] == new[5:]


def _change(path: str, change: str, entry: Entry, source: str | None) -> dict[str, Any]:
    kind = {"f": "file", "l": "link"}.get(entry[0], "other")
    return {
        "path": path,
        "change": change,
        "kind": kind,
        "inode": entry[1],
        "sha256": entry[5],
        "target": entry[6],
        "source": source,
    }


def identify(root: str, path: str) -> dict[str, Any]:
    """The file ``path`` names for a program whose working directory is ``root`` (where
    ``root`` is at the same path), as the kernel would resolve it, links followed.

    ``{"path": relative path, "inode": ..., "sha256": ...}`` for a regular file inside
    ``root``; otherwise ``{"outside": why}``: a path that leaves ``root`` (through ``..``,
    an absolute path elsewhere, or a link), one that does not exist, or not a regular file.
    """
    if not path or "\x00" in path:
        return {"outside": "no such file"}
    root = root.rstrip("/") or "/"
    if path.startswith("/"):
        if path != root and not path.startswith(root + "/"):
            return {"outside": "an absolute path outside the workdir"}
        path = path[len(root) :]
    parts = [part for part in path.split("/") if part not in ("", ".")]
    resolved: list[str] = []
    links = 0
    while parts:
        part = parts.pop(0)
        if part == "..":
            if not resolved:
                return {"outside": "a path that leaves the workdir"}
            resolved.pop()
            continue
        here = os.path.join(root, *resolved, part)
        try:
            info = os.lstat(here)
        except OSError as exc:
            return {"outside": "no such file" if exc.errno == errno.ENOENT else exc.strerror}
        if stat.S_ISLNK(info.st_mode):
            links += 1
            if links > MAX_LINKS:
                return {"outside": "too many links"}
            target = os.readlink(here)
            if target.startswith("/"):
                if target != root and not target.startswith(root + "/"):
                    return {"outside": "a link that leaves the workdir"}
                resolved = []
                target = target[len(root) :]
            parts = [p for p in target.split("/") if p not in ("", ".")] + parts
            continue
        resolved.append(part)
    relative = "/".join(resolved)
    here = os.path.join(root, relative)
    try:
        fd = os.open(here, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        return {"outside": exc.strerror or "cannot be opened"}
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            return {"outside": "not a regular file"}
        return {"path": relative, "inode": info.st_ino, "sha256": _sha256(fd)}
    finally:
        os.close(fd)


def locate(
    name: str, search: str, writable: list[str], owner: int | None, *, inside: bool = False
) -> dict[str, Any] | None:
    """The program ``name`` as a shell would find it on ``search`` (a ``PATH``), resolved
    to its real path and hashed: ``{"name", "path", "sha256"}``, or ``None``.

    Found only outside every place commands may write: not under one of ``writable``, and
    (where commands run as ``owner``) neither the file nor a directory above it owned by
    that user or writable by everybody; ``inside`` (run as a command would be, in its
    sandbox), nor writable by this process. A name with a ``/`` is never looked up.
    """
    if not name or "/" in name or name in (".", ".."):
        return None
    for folder in search.split(":"):
        if not folder.startswith("/"):
            continue
        candidate = os.path.join(folder, name)
        if not (os.path.isfile(candidate) and os.access(candidate, os.X_OK)):
            continue
        real = os.path.realpath(candidate)
        if not _out_of_reach(real, writable, owner, inside):
            return None  # the first one found is what a shell would run: no other
        try:
            fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            return None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return None
            return {"name": name, "path": real, "sha256": _sha256(fd)}
        finally:
            os.close(fd)
    return None


def _out_of_reach(real: str, writable: list[str], owner: int | None, inside: bool) -> bool:
    for place in writable:
        place = place.rstrip("/")
        if place and (real == place or real.startswith(place + "/")):
            return False
    path = real
    while True:
        try:
            info = os.stat(path)
        except OSError:
            return False
        # a sticky directory (/tmp) lets nobody replace what others own in it
        sticky = stat.S_ISDIR(info.st_mode) and info.st_mode & stat.S_ISVTX and path != real
        if not sticky and (info.st_mode & stat.S_IWOTH or (inside and os.access(path, os.W_OK))):
            return False
        if owner is not None and info.st_uid == owner:
            return False
        if path == "/":
            return True
        path = os.path.dirname(path)


if __name__ == "__main__":  # run in a sandbox: where its commands would find a program
    import json
    import sys

    found = locate(sys.argv[1], sys.argv[2], sys.argv[3:], os.getuid(), inside=True)
    print(json.dumps(found))
