"""One control group per sandbox: the limits on its processes and memory, and the counts
that say when a command ran into them.

Where the machine mounts cgroup v1 (a ``pids`` and a ``memory`` hierarchy, as these
machines do) the sandbox gets a group in each, under ``cmbs/``; on a cgroup v2 machine one
group under ``/sys/fs/cgroup/cmbs`` with both controllers. Making groups takes root; where
it cannot be done, :func:`open_cgroup` says why and the caller decides whether that is an
error (a limit the operator asked for) or a note (a default).
"""

from __future__ import annotations

import errno
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from .errors import ExecutorError

__all__ = ["Cgroup", "CgroupUnavailable", "open_cgroup"]

_ROOT = Path("/sys/fs/cgroup")


class CgroupUnavailable(ExecutorError):
    """No control group can be made here; the message says why, in a few words."""


@dataclass
class Cgroup:
    """The groups of one sandbox; every process written to :attr:`procs` is in all of them.

    :attr:`commands_only`: only the commands join (cgroup v1: each one's namespace init
    writes itself in), so the limits, and the out-of-memory killer they call, never reach
    the sandbox's own processes (bwrap, the launcher); on cgroup v2, whose rules would
    not let a command move itself there, the whole sandbox joins.
    """

    dirs: tuple[Path, ...]
    procs: tuple[Path, ...]
    #: which limit each counter file and key stands for: (file, key, limit name)
    counters: tuple[tuple[Path, str, str], ...]
    enforced: dict[str, int] = field(default_factory=dict)
    commands_only: bool = True
    _last: dict[str, int] = field(default_factory=dict)

    def hits(self) -> tuple[str, ...]:
        """The limits run into since the last call (``"pids"``, ``"memory"``)."""
        now: dict[str, int] = {}
        for path, key, name in self.counters:
            now[name] = now.get(name, 0) + _counter(path, key)
        hit = tuple(name for name, count in now.items() if count > self._last.get(name, 0))
        self._last = now
        return hit

    def remove(self, *, wait: float = 2.0) -> None:
        """Remove the groups once their processes are gone (a killed sandbox's take a moment)."""
        ends = time.monotonic() + wait
        for path in self.dirs:
            while True:
                try:
                    path.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError as exc:
                    if exc.errno != errno.EBUSY or time.monotonic() > ends:
                        break
                    time.sleep(0.01)


def open_cgroup(name: str, *, pids: int | None, memory: int | None) -> Cgroup:
    """Groups named ``name`` with these limits (``None``: none), or :class:`CgroupUnavailable`.

    Names start ``s<pid>-``, the pid of the cmbs process that made them: the empty groups
    of a process that is gone (killed before it could remove them) are removed first.
    """
    if os.geteuid() != 0:
        raise CgroupUnavailable("making control groups needs root")
    _sweep_once()
    if (_ROOT / "cgroup.controllers").exists():
        return _v2(name, pids, memory)
    return _v1(name, pids, memory)


def _v1(name: str, pids: int | None, memory: int | None) -> Cgroup:
    missing = [c for c in ("pids", "memory") if not (_ROOT / c / "cgroup.procs").exists()]
    if missing:
        raise CgroupUnavailable(f"no cgroup v1 {' or '.join(missing)} hierarchy is mounted")
    pid_dir, mem_dir = _ROOT / "pids" / "cmbs" / name, _ROOT / "memory" / "cmbs" / name
    made: list[Path] = []
    try:
        for path in (pid_dir, mem_dir):
            path.mkdir(parents=True)
            made.append(path)
        enforced = {}
        if pids is not None:
            _write(pid_dir / "pids.max", pids)
            enforced["pids"] = pids
        if memory is not None:
            _write(mem_dir / "memory.limit_in_bytes", memory)
            swap = mem_dir / "memory.memsw.limit_in_bytes"
            if swap.exists():
                _write(swap, memory)
            enforced["memory"] = memory
    except OSError as exc:
        _remove(made)
        raise CgroupUnavailable(f"cannot set up a control group: {exc.strerror}") from None
    counters = (
        (pid_dir / "pids.events", "max", "pids"),
        (mem_dir / "memory.oom_control", "oom_kill", "memory"),
    )
    return _started(made, [p / "cgroup.procs" for p in made], counters, enforced)


def _v2(name: str, pids: int | None, memory: int | None) -> Cgroup:
    parent = _ROOT / "cmbs"
    path = parent / name
    try:
        available = (_ROOT / "cgroup.controllers").read_text().split()
        if not {"pids", "memory"} <= set(available):
            raise CgroupUnavailable("the pids and memory controllers are not available")
        parent.mkdir(exist_ok=True)
        for where in (_ROOT, parent):
            (where / "cgroup.subtree_control").write_text("+pids +memory")
        path.mkdir()
    except OSError as exc:
        raise CgroupUnavailable(f"cannot set up a control group: {exc.strerror}") from None
    enforced = {}
    try:
        if pids is not None:
            _write(path / "pids.max", pids)
            enforced["pids"] = pids
        if memory is not None:
            _write(path / "memory.max", memory)
            _write(path / "memory.swap.max", 0)
            enforced["memory"] = memory
    except OSError as exc:
        _remove([path])
        raise CgroupUnavailable(f"cannot set a limit: {exc.strerror}") from None
    counters = (
        (path / "pids.events", "max", "pids"),
        (path / "memory.events", "oom_kill", "memory"),
    )
    group = _started([path], [path / "cgroup.procs"], counters, enforced)
    group.commands_only = False
    return group


def _started(
    dirs: list[Path],
    procs: list[Path],
    counters: tuple[tuple[Path, str, str], ...],
    enforced: dict[str, int],
) -> Cgroup:
    group = Cgroup(tuple(dirs), tuple(procs), counters, enforced)
    group.hits()  # the counts start at zero, but take them as they are
    return group


_swept = False


def _sweep_once() -> None:
    """Remove the empty groups of cmbs processes that are gone (once per process)."""
    global _swept
    if _swept:
        return
    _swept = True
    for parent in (_ROOT / "pids" / "cmbs", _ROOT / "memory" / "cmbs", _ROOT / "cmbs"):
        try:
            names = [p for p in parent.iterdir() if p.is_dir()]
        except OSError:
            continue
        for path in names:
            owner = path.name[1:].partition("-")[0]
            if path.name.startswith("s") and owner.isdigit() and not _alive(int(owner)):
                _remove([path])  # refused while processes are in it: then it stays


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _write(path: Path, value: int) -> None:
    path.write_text(str(value))


def _counter(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            name, _, count = line.partition(" ")
            if name == key:
                return int(count)
    except (OSError, ValueError):
        pass
    return 0


def _remove(paths: list[Path]) -> None:
    for path in paths:
        try:
            path.rmdir()
        except OSError:
            pass
