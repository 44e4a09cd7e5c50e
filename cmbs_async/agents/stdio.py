"""An agent that is any program, in any language: turns go to its stdin as JSON lines,
steps come back on its stdout, one line each."""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
from collections.abc import Sequence
from contextlib import suppress
from subprocess import DEVNULL
from typing import IO, Literal, NoReturn, Protocol

import anyio
from anyio.abc import Process

from .._closing import Closing
from .._errors import CmbsError
from ..protocol import Turn
from .base import AgentMessage

__all__ = ["AgentProcessError", "Isolation", "StdioAgent"]

_STDERR_TAIL = 2000
_GRACE = 1.0  # seconds between TERM and KILL, and for the KILL to take effect

#: How the agent's processes are kept together so that all of them end with the run.
Isolation = Literal["auto", "pidns", "group"]

#: The host as it is (files, devices, environment), but a PID namespace of its own, and
#: the program in a session of its own inside it (it cannot signal bwrap itself).
_BWRAP = (
    "--dev-bind", "/", "/", "--proc", "/proc",
    "--unshare-pid", "--die-with-parent", "--new-session",
)  # fmt: skip

_bwrap_works: dict[str, bool] = {}


class AgentProcessError(CmbsError, RuntimeError):
    """The agent program crashed, hung or closed its output; the message says which."""


class StdioAgent(Closing):
    """Starts ``command`` (through the shell when it is a string) on first use.

    Each turn is written as one JSON line; the next line the program prints is its step,
    passed on verbatim. An empty line or end of output means it has nothing more to say.
    A program that exits with an error, gives no line within ``step_timeout`` seconds, or
    sends a line over ``max_line_bytes`` raises :class:`AgentProcessError` with the tail of
    its stderr (the run ends ``agent_error``). Use as an async context manager, or call
    :meth:`aclose`.

    ``isolate`` says how everything the program starts is ended with it: ``"pidns"`` runs it
    in a PID namespace of its own under bubblewrap (same files, devices and environment), so
    nothing it starts, even through ``setsid`` or a double fork, outlives it; ``"group"``
    only in a process group of its own (a ``setsid`` escapes that); ``"auto"`` (the default)
    is ``"pidns"`` where ``bwrap`` works, else ``"group"``. At the end all of them get TERM,
    then, after a second's grace, KILL; in a namespace, whatever is left when the program
    itself exits is killed at once.
    """

    def __init__(
        self,
        command: str | Sequence[str],
        *,
        step_timeout: float = 60.0,
        max_line_bytes: int = 1 << 20,
        isolate: Isolation = "auto",
        cwd: str | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        if isolate not in ("auto", "pidns", "group"):
            raise ValueError(f"isolate must be 'auto', 'pidns' or 'group', not {isolate!r}")
        self.command = command
        self.step_timeout = step_timeout
        self.max_line_bytes = max_line_bytes
        self.isolate = isolate
        self.cwd = cwd
        self.env = env
        self._process: Process | None = None
        self._tree: _Tree | None = None
        self._buffer = bytearray()
        self._stderr: IO[bytes] | None = None

    async def next_step(self, turn: Turn) -> AgentMessage | None:
        process = await self._started()
        assert process.stdin is not None
        try:
            await process.stdin.send(turn.model_dump_json().encode() + b"\n")
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            await self._failed("closed its input")
        line = await self._read_line(process)
        if line is None:
            await self._wait_briefly(process)
            if process.returncode not in (0, None):
                await self._failed(f"exited with status {process.returncode}")
            return None
        text = line.decode("utf-8", "replace").strip()
        return text or None

    async def _read_line(self, process: Process) -> bytes | None:
        assert process.stdout is not None
        searched = 0
        with anyio.move_on_after(self.step_timeout) as scope:
            while (end := self._buffer.find(b"\n", searched)) < 0:
                if len(self._buffer) > self.max_line_bytes:
                    break
                searched = len(self._buffer)
                try:
                    self._buffer += await process.stdout.receive()
                except anyio.EndOfStream:
                    rest, self._buffer = bytes(self._buffer), bytearray()
                    return rest or None
        if scope.cancelled_caught:
            await self._failed(f"gave no step within {self.step_timeout:g} s")
        if end < 0 or end > self.max_line_bytes:
            await self._failed(f"sent a line over {self.max_line_bytes} bytes")
        line = bytes(self._buffer[:end])
        del self._buffer[: end + 1]
        return line

    async def _started(self) -> Process:
        if self._process is None:
            # stderr goes to a file, not a pipe: a chatty program can never block on it
            self._stderr = tempfile.TemporaryFile()
            bwrap = shutil.which("bwrap")
            if self.isolate == "group" or (
                self.isolate == "auto" and not (bwrap and await _works(bwrap))
            ):
                self._process = await self._open(self.command)
                self._tree = _Group(self._process)
            elif bwrap is None:
                await self._failed("could not start: isolate='pidns' needs bwrap on the PATH")
            else:
                await self._start_in_namespace(bwrap)
        assert self._process is not None
        return self._process

    async def _open(self, command: str | Sequence[str], pass_fds: Sequence[int] = ()) -> Process:
        return await anyio.open_process(
            command,
            cwd=self.cwd,
            env=self.env,
            start_new_session=True,
            stderr=self._stderr,
            pass_fds=pass_fds,
        )

    async def _start_in_namespace(self, bwrap: str) -> None:
        """bwrap reports its init process on a pipe. The process is kept before that is
        read, so that even a cancellation then leaves it to :meth:`aclose`."""
        argv = ["/bin/sh", "-c", self.command] if isinstance(self.command, str) else self.command
        info, write_end = os.pipe()
        try:
            try:
                self._process = await self._open(
                    [bwrap, *_BWRAP, "--info-fd", str(write_end), "--", *argv],
                    pass_fds=(write_end,),
                )
            finally:
                os.close(write_end)
            self._tree = _Namespace(self._process, await _read_to_end(info))
        finally:
            os.close(info)

    async def _wait_briefly(self, process: Process) -> None:
        with anyio.move_on_after(2):
            await process.wait()

    async def _failed(self, what: str) -> NoReturn:
        tail = self._stderr_tail()
        await self.aclose()
        raise AgentProcessError(f"agent program {what}" + (f"; stderr: {tail}" if tail else ""))

    def _stderr_tail(self) -> str:
        if self._stderr is None:
            return ""
        handle = self._stderr
        handle.seek(0, os.SEEK_END)
        handle.seek(max(handle.tell() - _STDERR_TAIL, 0))
        return " ".join(handle.read().decode("utf-8", "replace").split())

    async def aclose(self) -> None:
        process, self._process = self._process, None
        tree, self._tree = self._tree, None
        with anyio.CancelScope(shield=True):
            if tree is not None:
                await _end(tree)
            if process is not None:
                if process.returncode is None:
                    with suppress(ProcessLookupError):
                        process.kill()
                await process.aclose()
        if self._stderr is not None:
            self._stderr.close()
            self._stderr = None


class _Tree(Protocol):
    """All the processes of one agent program, to be ended together."""

    def terminate(self) -> None: ...

    def kill(self) -> None: ...

    async def gone(self) -> None:
        """Returns once none of them is left."""

    def close(self) -> None: ...


async def _end(tree: _Tree) -> None:
    """TERM, a grace, then KILL for whatever is left; the caller shields this."""
    tree.terminate()
    with anyio.move_on_after(_GRACE) as grace:
        await tree.gone()
    if grace.cancelled_caught:
        tree.kill()
        with anyio.move_on_after(_GRACE):
            await tree.gone()
    tree.close()


class _Group:
    """The program's process group: its children stay in it, unless they call ``setsid``."""

    def __init__(self, process: Process) -> None:
        self._process = process

    def terminate(self) -> None:
        _signal_group(self._process.pid, signal.SIGTERM)

    def kill(self) -> None:
        _signal_group(self._process.pid, signal.SIGKILL)

    async def gone(self) -> None:
        await self._process.wait()
        # no event says a group is empty (its members are not our children): poll /proc
        while _running_in_group(self._process.pid):  # noqa: ASYNC110
            await anyio.sleep(0.05)

    def close(self) -> None:
        pass


def _signal_group(pgid: int, signum: int) -> None:
    with suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signum)


def _running_in_group(pgid: int) -> bool:
    """Whether a process of group ``pgid`` still runs (zombies do not count: where pid 1
    does not reap orphans, they stay forever)."""
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as handle:
                state, _, group = handle.read().rsplit(")", 1)[1].split()[:3]
        except OSError:  # gone
            continue
        if int(group) == pgid and state != "Z":
            return True
    return False


class _Namespace:
    """The program's own PID namespace under bwrap, which reports its init process there.

    bwrap exits as soon as the program does, and its init then dies with it; when the init
    dies the kernel kills everything else in the namespace, and the init is gone only once
    all of them are: so it is the init that is killed and waited for.
    """

    def __init__(self, process: Process, info: bytes) -> None:
        self._process = process
        self._init_pid = 0
        self._inode = 0
        self._init: int | None = None
        if info:  # none when bwrap failed (its stderr says why; the next read says it failed)
            details = json.loads(info)
            self._init_pid = int(details["child-pid"])
            self._inode = int(details["pid-namespace"])
            self._init = _pidfd(self._init_pid, self._inode)

    def terminate(self) -> None:
        for pid in _members(self._inode):
            if pid != self._init_pid and (fd := _pidfd(pid, self._inode)) is not None:
                _signal_pidfd(fd, signal.SIGTERM)
                os.close(fd)

    def kill(self) -> None:
        if self._init is not None:
            _signal_pidfd(self._init, signal.SIGKILL)

    async def gone(self) -> None:
        if self._init is not None:
            await anyio.wait_readable(self._init)  # a pidfd is readable once its process ended
        await self._process.wait()

    def close(self) -> None:
        if self._init is not None:
            os.close(self._init)
            self._init = None


def _members(inode: int) -> list[int]:
    """The (host) pids of the processes in the PID namespace ``inode``."""
    return [int(entry) for entry in filter(str.isdigit, os.listdir("/proc")) if _in(entry, inode)]


def _in(pid: int | str, inode: int) -> bool:
    try:
        return os.stat(f"/proc/{pid}/ns/pid").st_ino == inode
    except OSError:  # gone, or a zombie
        return False


def _pidfd(pid: int, inode: int) -> int | None:
    """A pidfd for ``pid`` if it is in the namespace ``inode``: signals sent through it
    cannot reach another process that got the same number later."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return None
    if _in(pid, inode):  # checked after opening: the fd holds the process checked
        return fd
    os.close(fd)
    return None


def _signal_pidfd(fd: int, signum: int) -> None:
    with suppress(ProcessLookupError):
        signal.pidfd_send_signal(fd, signum)


async def _works(bwrap: str) -> bool:
    """Whether bwrap can make a PID namespace here (not in every container); asked once."""
    if bwrap not in _bwrap_works:
        probe = await anyio.run_process(
            [bwrap, *_BWRAP, "--", "true"], check=False, stdout=DEVNULL, stderr=DEVNULL
        )
        _bwrap_works[bwrap] = probe.returncode == 0
    return _bwrap_works[bwrap]


async def _read_to_end(fd: int) -> bytes:
    os.set_blocking(fd, False)
    data = b""
    while True:
        await anyio.wait_readable(fd)
        try:
            chunk = os.read(fd, 4096)
        except BlockingIOError:
            continue
        if not chunk:
            return data
        data += chunk
