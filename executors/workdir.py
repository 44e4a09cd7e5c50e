"""Workdirs held open by a directory descriptor, and artifact writes that cannot leave them.

Checking a path and then writing by that path is a race a hostile command wins (swap a
directory for a symbolic link in between, or hard-link a file from outside). So every
write walks from the workdir's held descriptor one component at a time, never through a
link, and puts its content in place with a rename: whatever sat at the final name (a
hard link, a symbolic link) is replaced, never written through. Before each write the
workdir's path must still name the directory that was prepared.
"""

from __future__ import annotations

import errno
import os
import secrets
import shutil
import stat
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import PurePosixPath

from .base import CleanupFailed, ExecutorError, PathRefused, confine
from .sandbox import FRESH_UIDS

__all__ = ["MAX_DEPTH", "Workdirs"]

#: Deepest artifact path accepted (components, the file included).
MAX_DEPTH = 64

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


@dataclass
class _Held:
    """One workdir's open descriptor and its owner; ``lock`` guards every use and the close."""

    fd: int
    identity: tuple[int, int]
    owner: tuple[int, int] | None = None
    users: int = 1
    lock: threading.Lock = field(default_factory=threading.Lock)


class Workdirs:
    """The workdirs an executor prepared, each held open until its last release.

    Keyed by the (real) path handed out; preparing the same path twice shares one
    descriptor. A workdir's ``owner`` (uid, gid), where commands run as another user, is
    given the workdir, and each file and directory an artifact write makes there. The
    methods block: call them from a worker thread.
    """

    def __init__(self) -> None:
        self._held: dict[str, _Held] = {}
        self._lock = threading.Lock()

    def open(
        self, path: str | None, *, root: str | None = None, owner: tuple[int, int] | None = None
    ) -> str:
        """Create the workdir (a fresh temporary one in ``root`` for ``None``), hold it,
        return its path.

        With an ``owner``, a directory that already exists must be empty, theirs already,
        or a workdir an earlier sandbox's user left (kept from an earlier run: handed over
        whole); anything else is refused, since handing it over would let commands change
        what someone else put there.
        """
        try:
            if path is None:
                path = tempfile.mkdtemp(prefix="cmbs-", dir=root)
            else:
                os.makedirs(path, exist_ok=True)
            path = os.path.realpath(path)
            fd = os.open(path, _DIR)
        except OSError as exc:
            raise ExecutorError(f"cannot create workdir {path}: {exc.strerror}") from exc
        try:
            if owner is not None:
                _hand_over(fd, path, owner)
        except BaseException:
            os.close(fd)
            raise
        identity = _identity(os.fstat(fd))
        with self._lock:
            held = self._held.get(path)
            if held is None:
                self._held[path] = _Held(fd, identity, owner)
                return path
            held.users += 1
        with held.lock:  # already held: keep one descriptor, of the directory there now
            if held.identity == identity:
                os.close(fd)
            else:
                os.close(held.fd)
                held.fd, held.identity = fd, identity
        return path

    def holds(self, path: str) -> bool:
        """Whether ``path`` is a workdir prepared here and not yet let go."""
        with self._lock:
            return path in self._held

    def release(self, path: str, *, remove: bool) -> None:
        """Drop one hold on ``path``; at the last, close it and, if ``remove``, delete it.

        Only the directory that was prepared is deleted, through its descriptor: a link or
        another directory put at ``path`` meanwhile is left alone. What cannot be deleted
        stays, and :class:`CleanupFailed` says so.
        """
        with self._lock:
            held = self._held.get(path)
            if held is not None:
                held.users -= 1
                if held.users > 0:
                    return
                del self._held[path]
        if held is None:
            if remove:  # not prepared here; rmtree refuses a symbolic link at the top
                shutil.rmtree(path, ignore_errors=True)
            return
        with held.lock:
            try:
                if remove:
                    _empty(held.fd)
                    if _is_still(path, held):
                        os.rmdir(path)
            except OSError as exc:
                raise CleanupFailed(f"workdir {path} could not be removed: {_why(exc)}") from None
            finally:
                os.close(held.fd)
                held.fd = -1

    def release_all(self) -> None:
        """Close every workdir still held, deleting none."""
        with self._lock:
            paths = list(self._held)
        for path in paths:
            with self._lock:
                held = self._held.get(path)
                if held is not None:
                    held.users = 1  # whoever else holds it, the executor is closing
            self.release(path, remove=False)

    def write(self, workdir: str, path: str, data: bytes) -> None:
        """Write ``data`` to ``path`` inside ``workdir``, or raise :class:`PathRefused`.

        Raises :class:`ExecutorError` if the prepared workdir was deleted or replaced.
        """
        relative = confine(path)
        if len(relative.parts) > MAX_DEPTH:
            raise PathRefused(
                f"artifact path has {len(relative.parts)} components; at most {MAX_DEPTH}"
            )
        with self._lock:
            held = self._held.get(workdir)
        owner = held.owner if held is not None else None
        with self._root(workdir) as root:
            _write_under(root, relative, path, data, owner)

    @contextmanager
    def _root(self, workdir: str) -> Iterator[int]:
        """The workdir's descriptor, checked to be the one prepared, for one write."""
        with self._lock:
            held = self._held.get(workdir)
        if held is None:  # not prepared here: open it for this write only
            try:
                fd = os.open(workdir, _DIR)
            except OSError as exc:
                raise ExecutorError(f"cannot open workdir {workdir}: {_why(exc)}") from exc
            try:
                yield fd
            finally:
                os.close(fd)
            return
        with held.lock:
            if held.fd < 0 or not _is_still(workdir, held):
                raise ExecutorError(f"workdir {workdir} was deleted or replaced during the run")
            yield held.fd


def _hand_over(fd: int, path: str, owner: tuple[int, int]) -> None:
    """Give the workdir open as ``fd`` to ``owner`` (see :meth:`Workdirs.open`)."""
    status = os.fstat(fd)
    if status.st_uid == owner[0]:
        return
    with os.scandir(fd) as entries:
        empty = next(entries, None) is None
    if not empty and status.st_uid not in FRESH_UIDS:
        raise ExecutorError(
            f"workdir {path} already holds files that are not the sandbox user's: "
            "name a new or empty directory"
        )
    try:
        os.fchown(fd, *owner)
        if not empty:
            _chown_tree(fd, owner, status.st_dev)
    except OSError as exc:
        raise ExecutorError(f"cannot give workdir {path} to the sandbox user: {_why(exc)}") from exc


def _chown_tree(fd: int, owner: tuple[int, int], device: int) -> None:
    """Hand what an earlier sandbox left in the directory ``fd`` to ``owner``: never
    through a link, never onto another file system."""
    with os.scandir(fd) as entries:
        found = [(entry.name, entry.is_dir(follow_symlinks=False)) for entry in entries]
    for name, is_dir in found:
        os.chown(name, *owner, dir_fd=fd, follow_symlinks=False)
        if is_dir:
            child = os.open(name, _DIR, dir_fd=fd)
            try:
                if os.fstat(child).st_dev == device:
                    _chown_tree(child, owner, device)
            finally:
                os.close(child)


def _write_under(
    root: int, relative: PurePosixPath, path: str, data: bytes, owner: tuple[int, int] | None
) -> None:
    """Walk to the parent from ``root`` (making directories), then rename a new file in."""
    parent = root
    try:
        for depth, name in enumerate(relative.parts[:-1], start=1):
            made = False
            with _suppressed(errno.EEXIST):
                os.mkdir(name, dir_fd=parent)
                made = True
            try:
                child = os.open(name, _DIR, dir_fd=parent)
            except OSError as exc:
                prefix = str(PurePosixPath(*relative.parts[:depth]))
                raise _refusal(path, prefix, exc, name, parent) from exc
            if made and owner is not None:
                os.fchown(child, *owner)
            if parent != root:
                os.close(parent)
            parent = child
        _replace(parent, relative.name, path, data, owner)
    finally:
        if parent != root:
            os.close(parent)


def _refusal(path: str, prefix: str, exc: OSError, name: str, parent: int) -> PathRefused:
    """Why the directory ``prefix`` of ``path`` could not be opened."""
    if exc.errno not in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
        return PathRefused(f"cannot write {path!r}: {prefix!r}: {_why(exc)}")
    try:
        mode = os.stat(name, dir_fd=parent, follow_symlinks=False).st_mode
    except OSError:
        mode = None
    if mode is not None and stat.S_ISLNK(mode):
        return PathRefused(
            f"artifact path {path!r} could lead outside the workdir: {prefix!r} is a symbolic link"
        )
    if mode is not None and not stat.S_ISDIR(mode):
        return PathRefused(f"cannot write {path!r}: {prefix!r} is not a directory")
    return PathRefused(f"cannot write {path!r}: {prefix!r} changed while it was being opened")


def _replace(parent: int, name: str, path: str, data: bytes, owner: tuple[int, int] | None) -> None:
    """Put ``data`` at ``name`` by renaming a fresh file over it; keep a file's mode bits."""
    try:
        existing: os.stat_result | None = os.stat(name, dir_fd=parent, follow_symlinks=False)
    except FileNotFoundError:
        existing = None
    if existing is not None and stat.S_ISLNK(existing.st_mode):
        raise PathRefused(f"artifact path {path!r} is a symbolic link")
    temporary = f".cmbs-{secrets.token_hex(8)}.tmp"
    fd = os.open(temporary, _NEW_FILE, 0o644, dir_fd=parent)
    try:
        with open(fd, "wb") as handle:
            if owner is not None:
                os.fchown(handle.fileno(), *owner)
            if existing is not None and stat.S_ISREG(existing.st_mode):
                os.fchmod(handle.fileno(), stat.S_IMODE(existing.st_mode) & 0o777)
            handle.write(data)
        os.replace(temporary, name, src_dir_fd=parent, dst_dir_fd=parent)
    except BaseException:
        with _suppressed(errno.ENOENT):
            os.unlink(temporary, dir_fd=parent)
        raise


def _empty(fd: int) -> None:
    """Delete everything in the directory open as ``fd``, never following a link."""
    with os.scandir(fd) as entries:
        names = [(entry.name, entry.is_dir(follow_symlinks=False)) for entry in entries]
    for name, is_dir in names:
        if is_dir:
            shutil.rmtree(name, dir_fd=fd, ignore_errors=True)
        else:
            with _suppressed(errno.ENOENT):
                os.unlink(name, dir_fd=fd)


def _is_still(path: str, held: _Held) -> bool:
    """Whether ``path`` (not followed if a link) is the directory ``held`` was opened on."""
    try:
        return _identity(os.stat(path, follow_symlinks=False)) == held.identity
    except OSError:
        return False


def _identity(status: os.stat_result) -> tuple[int, int]:
    return status.st_dev, status.st_ino


def _why(exc: OSError) -> str:
    return exc.strerror or str(exc)


@contextmanager
def _suppressed(code: int) -> Iterator[None]:
    """Ignore an :class:`OSError` with this errno only."""
    try:
        yield
    except OSError as exc:
        if exc.errno != code:
            raise
