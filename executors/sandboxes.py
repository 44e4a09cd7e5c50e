"""A running sandbox: bubblewrap with the launcher inside (:mod:`executors.launcher`), in
a control group of its own, and the commands run through it.

One per scenario: starting it (namespaces, mounts, the interpreter) costs tens of
milliseconds once; a command then costs about what a bare one does, since the launcher
only hands it to a namespace it made ready beforehand. Messages go both ways on one
``SOCK_SEQPACKET`` socket; whichever task waits for a message reads for all of them,
so any number of commands may run at once without a reader task.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shlex
import signal
import socket
import subprocess
import tempfile
from collections import defaultdict
from collections.abc import Mapping, Sequence
from contextlib import suppress
from dataclasses import dataclass
from typing import IO, Any

import anyio
from anyio.abc import Process

from .base import OutputBuffer
from .cgroups import Cgroup, CgroupUnavailable, open_cgroup
from .errors import ExecutorError
from .events import EventLogger
from .netpolicy import Broker, start_broker
from .pipes import read_pipes
from .sandbox import CGROUP_JOINS, SANDBOX_HOME, SandboxSpec, sandbox_argv

__all__ = ["Exit", "Job", "Run", "Sandbox", "SandboxBroken", "start_sandbox"]

_log = EventLogger("cmbs_async.sandbox")
_START_TIMEOUT = 30.0
_CHILD_PID = re.compile(rb'"child-pid":\s*(\d+)\D')  # whole: followed by more


class SandboxBroken(ExecutorError):
    """The sandbox ended or could not start; the message says what it said."""


@dataclass(frozen=True)
class Exit:
    """How a command ended: its status (128 + the signal that killed it) and the limits it
    ran into (``"pids"``, ``"memory"``, ``"tmp"``, ``"shm"``)."""

    status: int
    limits_hit: tuple[str, ...] = ()


@dataclass
class Job:
    """A command started in a sandbox: the zygote that runs it, and the executor's ends of
    its standard streams (non-blocking; :meth:`close` them once done)."""

    id: int
    stdin: int | None
    stdout: int
    stderr: int
    full_before: tuple[str, ...] = ()  # the private file systems full when it started

    def close_stdin(self) -> None:
        if self.stdin is not None:
            os.close(self.stdin)
            self.stdin = None

    def close(self) -> None:
        self.close_stdin()
        for fd in (self.stdout, self.stderr):
            os.close(fd)


async def start_sandbox(
    bwrap: str, spec: SandboxSpec, *, env: Mapping[str, str], name: str | None = None
) -> Sandbox:
    """Start ``spec``'s sandbox; :class:`SandboxBroken` with bwrap's own words if it cannot.

    ``env`` is what its commands usually get: each starts with it in the workdir for free.

    Limits that cannot be enforced here (no control groups: not root, no hierarchy) are
    left out of :attr:`Sandbox.limits`; the caller decides what that means.
    """
    name = name or f"s{os.getpid()}-{secrets.token_hex(6)}"
    # network by allow-list (executors/netpolicy.py): resolved now, before anything starts
    broker = await start_broker(spec.network) if isinstance(spec.network, tuple) else None
    cgroup, why = _cgroup(name, spec)
    host, inside = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    # bwrap's report of the sandbox's init, written before it lets the sandbox go on: a
    # memory file, never a pipe (one nobody reads, this process killed) nor a disk (a full
    # one), where a failed write kills bwrap and leaves its half-made sandbox for ever
    info = os.memfd_create("cmbs-bwrap-report", os.MFD_CLOEXEC)
    stderr = tempfile.TemporaryFile()  # bwrap's and the launcher's: never a full pipe
    try:
        argv = sandbox_argv(
            bwrap,
            spec,
            control_fd=inside.fileno(),
            info_fd=info,
            broker=broker,
            joins=[str(p) for p in cgroup.procs] if cgroup and cgroup.commands_only else (),
        )
        try:
            process = await anyio.open_process(
                [*_enter(cgroup), *argv.argv],
                env={},
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=stderr,
                start_new_session=True,
                pass_fds=(
                    inside.fileno(),
                    info,
                    *argv.fds,
                    *([broker.fd] if broker else []),
                ),
            )
        finally:
            for fd in argv.fds:
                os.close(fd)
    except BaseException:
        os.close(info)
        for closable in (host, inside, stderr):
            closable.close()
        if cgroup is not None:
            cgroup.remove()
        if broker is not None:
            broker.close()
        raise
    inside.close()
    if broker is not None:  # its end is in the sandbox now: serve it
        broker.start()
        env = {**broker.env, **env}
    host.setblocking(False)
    sandbox = Sandbox(
        process, host, info, cgroup, spec, env=env, unenforced=why, said=stderr, broker=broker
    )
    try:
        with anyio.fail_after(_START_TIMEOUT):
            await sandbox._handshake()
    except BaseException as exc:
        with anyio.CancelScope(shield=True):
            await sandbox.aclose()
        if isinstance(exc, TimeoutError):
            raise SandboxBroken(f"the sandbox did not start within {_START_TIMEOUT:g} s") from None
        if isinstance(exc, SandboxBroken):
            said = sandbox.last_words or str(exc)
            raise SandboxBroken(f"the sandbox could not start: {said}") from None
        raise
    return sandbox


def _cgroup(name: str, spec: SandboxSpec) -> tuple[Cgroup | None, str | None]:
    limits = spec.limits
    if limits.pids is None and limits.memory is None:
        return None, None
    try:
        return open_cgroup(name, pids=limits.pids, memory=limits.memory), None
    except CgroupUnavailable as exc:
        return None, str(exc)


def _enter(cgroup: Cgroup | None) -> list[str]:
    """Where the whole sandbox joins its control group (cgroup v2): a shell that joins it
    (and keeps the out-of-memory killer off bwrap and the launcher, where it may), then
    becomes bwrap."""
    if cgroup is None or cgroup.commands_only:
        return []
    joins = "".join(f"echo $$ > {shlex.quote(str(path))} && " for path in cgroup.procs)
    keep = "{ echo -1000 > /proc/self/oom_score_adj; } 2>/dev/null"  # where allowed
    script = f'{joins}{keep}; exec "$@"'
    return ["/bin/sh", "-c", script, "sh"]


class Sandbox:
    """One running sandbox; see :func:`start_sandbox`. Close it with :meth:`aclose`."""

    def __init__(
        self,
        process: Process,
        sock: socket.socket,
        info_fd: int,
        cgroup: Cgroup | None,
        spec: SandboxSpec,
        *,
        env: Mapping[str, str],
        unenforced: str | None,
        said: IO[bytes],
        broker: Broker | None = None,
    ) -> None:
        self.spec = spec
        #: what serves its network, when that is an allow-list (see executors/netpolicy.py)
        self.broker = broker
        self.env = dict(env)
        self._said = said
        joining = cgroup.procs if cgroup is not None and cgroup.commands_only else ()
        self._joins = [f"{CGROUP_JOINS}{index}" for index in range(len(joining))]
        #: what bwrap and the launcher said on stderr, once closed
        self.last_words = ""
        self._process = process
        self._sock = sock
        self._info = info_fd
        self._init: int | None = None  # a pidfd for the sandbox's init, once known
        self._init_pid: int | None = None
        self._cgroup = cgroup
        self._inbox: defaultdict[int, list[dict[str, Any]]] = defaultdict(list)
        self._zygotes: list[tuple[int, list[int]] | str] = []  # ready ones, or why none
        self._waiting: dict[int, anyio.Event] = {}
        self._reading = False
        self._broken: str | None = None
        self._next_id = 0
        self._closed = False
        #: why the process and memory limits are not enforced, if they are not
        self.unenforced = unenforced

    @property
    def broken(self) -> bool:
        """Whether the sandbox ended (or stopped answering): nothing more runs in it."""
        return self._broken is not None

    @property
    def limits(self) -> dict[str, int]:
        """The limits in force: the sizes of ``/tmp`` and ``/dev/shm``, and, where there is
        a control group, the number of processes and the memory."""
        enforced = dict(self._cgroup.enforced) if self._cgroup is not None else {}
        for name in ("tmp", "shm"):
            size = getattr(self.spec.limits, name)
            if size is not None:
                enforced[name] = size
        return enforced

    async def run(
        self,
        command: str | Sequence[str],
        *,
        env: Mapping[str, str],
        cwd: str,
        stdin: bool = False,
    ) -> Job:
        """Start ``command`` in ``cwd`` with exactly ``env``: a string is run by ``/bin/sh``
        as ``sh -c`` would, a sequence is executed as it is. Its stdin is closed unless
        ``stdin`` (then the job's :attr:`Job.stdin` is the way to it).

        The command goes to a zygote the launcher made ready; whether it could run at all
        (a workdir it cannot enter), :meth:`wait` says. :class:`SandboxBroken` if no
        zygote could be made.
        """
        if self.broker is not None:  # the proxy's variables, unless the command sets them
            env = {**self.broker.env, **env}
        number, fds = await self._zygote()
        job = Job(number, fds[0], fds[1], fds[2], full_before=self._full())
        try:
            await _write_all(fds[3], self._orders(command, env, cwd))
        except OSError:  # it died while it waited: it says so as its exit
            pass
        except BaseException:
            job.close()
            raise
        finally:
            os.close(fds[3])
        self._send({"op": "used", "zygote": number})
        if not stdin:
            job.close_stdin()
        return job

    async def wait(self, job: Job) -> Exit:
        """How ``job`` ended, once it has."""
        reply = await self._message(job.id)
        hit = [*(self._cgroup.hits() if self._cgroup is not None else ())]
        hit += [name for name in self._full() if name not in job.full_before]
        return Exit(status=int(reply["exit"]), limits_hit=tuple(hit))

    def kill(self, job: Job) -> None:
        """KILL the job's PID namespace: everything it started ends with it."""
        if self._broken is None:
            self._send({"op": "kill", "zygote": job.id})

    async def aclose(self) -> None:
        """KILL the whole sandbox (its namespace's init: the kernel ends every process in
        it), wait (briefly) for the namespace to be empty, then remove its control group.
        Shielded: it always finishes."""
        if self._closed:
            return
        self._closed = True
        with anyio.CancelScope(shield=True):
            if self._init is None:
                self._take_init()
            init, self._init = self._init, None
            if init is not None:  # the init of its PID namespace: the kernel ends the rest
                with suppress(ProcessLookupError):
                    signal.pidfd_send_signal(init, signal.SIGKILL)
            self._sock.close()  # and the launcher ends with its control socket, in any case
            if self._process.returncode is None:
                try:
                    os.killpg(self._process.pid, signal.SIGKILL)  # bwrap itself
                except (ProcessLookupError, PermissionError):
                    pass
            if init is not None:
                try:
                    with anyio.move_on_after(5):
                        await anyio.wait_readable(init)
                finally:
                    os.close(init)
            with anyio.move_on_after(5):
                await self._process.wait()
            await self._process.aclose()
            if self.broker is not None:
                await anyio.to_thread.run_sync(self.broker.close)
            for ready in self._zygotes:
                for fd in ready[1] if isinstance(ready, tuple) else ():
                    os.close(fd)
            self._zygotes.clear()
            self.last_words = self._read_said()
            self._said.close()
            os.close(self._info)
            self._wake_all()
            if self._cgroup is not None:
                await anyio.to_thread.run_sync(self._cgroup.remove)

    # -- messages ---------------------------------------------------------------------
    def _send(self, message: dict[str, Any], fds: Sequence[int] = ()) -> None:
        if self._broken is not None:
            raise SandboxBroken(self._broken)
        data = json.dumps(message).encode()
        try:
            socket.send_fds(self._sock, [data], list(fds)) if fds else self._sock.send(data)
        except BlockingIOError:  # the launcher is not reading: it hangs, or is stopped
            self._fail("the sandbox does not answer")
        except OSError as exc:
            self._fail(f"the sandbox ended ({exc.strerror})")

    async def _message(self, key: int) -> dict[str, Any]:
        """The next message for ``key`` (a zygote's number; 0: the launcher's own)."""
        while not self._inbox[key]:
            await self._read(key)
        return self._inbox[key].pop(0)

    async def _zygote(self) -> tuple[int, list[int]]:
        """A ready zygote: its number and its four pipes, which are the caller's to close."""
        while not self._zygotes:
            await self._read(-1)
        ready = self._zygotes.pop(0)
        if isinstance(ready, str):
            raise SandboxBroken(f"no command can start: {ready}")
        return ready

    async def _read(self, key: int) -> None:
        """Wait for messages: the task that waits first reads for everyone."""
        if self._broken is not None:
            raise SandboxBroken(self._broken)
        if self._reading:
            event = self._waiting.setdefault(key, anyio.Event())
            await event.wait()
            return
        self._reading = True
        try:
            await anyio.wait_readable(self._sock)
            self._drain()
        finally:
            self._reading = False
            self._wake_all()  # someone else reads now, if they still wait

    def _drain(self) -> None:
        while True:
            try:
                data, fds, _flags, _addr = socket.recv_fds(self._sock, 1 << 16, 4)
            except BlockingIOError:
                return
            except OSError as exc:
                self._fail(f"the sandbox ended ({exc.strerror})")
                return
            if not data:
                self._fail("the sandbox ended")
                return
            message = json.loads(data)
            number = message.get("zygote", 0)
            if "exit" in message or number == 0:
                self._inbox[int(number)].append(message)
            elif number is None:
                self._zygotes.append(str(message.get("error")))
            elif len(fds) == 4:
                for fd in fds:
                    os.set_blocking(fd, False)
                self._zygotes.append((int(number), fds))

    def _wake_all(self) -> None:
        waiting, self._waiting = self._waiting, {}
        for event in waiting.values():
            event.set()

    def _fail(self, reason: str) -> None:
        if self._broken is None:
            self._broken = reason
        self._wake_all()

    def _orders(self, command: str | Sequence[str], env: Mapping[str, str], cwd: str) -> bytes:
        """What a zygote's shell runs: enter ``cwd``, take ``env`` (only what differs from
        what it has), then run ``command``: a string with ``eval`` (the shell parses it
        as ``sh -c`` would, and no second shell starts), a sequence with ``exec``."""
        lines = ["exec 3<&-"]
        if cwd != self.spec.start_in:
            lines.append(f"cd -- {shlex.quote(cwd)} || exit 126")
        gone = [name for name in self.env if name not in env]
        if gone:
            lines.append("unset " + " ".join(gone))
        lines += [
            f"export {name}={shlex.quote(value)}"
            for name, value in env.items()
            if _NAME.match(name) and self.env.get(name) != value
        ]
        if isinstance(command, str):
            lines.append("eval " + shlex.quote(command))
        else:
            lines.append("exec " + " ".join(shlex.quote(arg) for arg in command))
        return "\n".join([*lines, ""]).encode()

    async def _handshake(self) -> None:
        user = self.spec.user
        config = {
            "op": "config",
            "uid": user.uid,
            "gid": user.gid,
            "home": SANDBOX_HOME,
            "cwd": self.spec.start_in,
            "joins": self._joins,
            "env": {name: value for name, value in self.env.items() if _NAME.match(name)},
        }
        if self.broker is not None:  # the launcher starts the network guard first
            config["netguard"] = self.broker.config()
        self._send(config)
        reply = await self._message(0)
        if not reply.get("ready"):
            raise SandboxBroken(str(reply))
        self._take_init()

    def _read_said(self) -> str:
        """What bwrap and the launcher wrote on stderr (the first 4 KiB), in one line."""
        self._said.seek(0)
        return " ".join(self._said.read(4096).decode("utf-8", "replace").split())

    def _take_init(self) -> None:
        """The sandbox's init, as bwrap reports it: a pidfd (its end means the PID
        namespace is empty) and its pid (``/proc/PID/root`` is the sandbox's view)."""
        try:
            found = _CHILD_PID.search(os.pread(self._info, 4096, 0))
            if found:
                self._init_pid = int(found.group(1))
                self._init = os.pidfd_open(self._init_pid)
        except OSError:  # nothing written (bwrap failed), or the init is gone already
            pass

    def _full(self) -> tuple[str, ...]:
        """Which of the sandbox's private ``/tmp`` and ``/dev/shm`` are full now."""
        if self._init_pid is None:
            return ()
        return tuple(
            name for path, name in _FULL.items() if _is_full(f"/proc/{self._init_pid}/root{path}")
        )


_FULL = {"/tmp": "tmp", "/dev/shm": "shm"}


def _is_full(path: str) -> bool:
    try:
        status = os.statvfs(path)
    except OSError:
        return False
    return status.f_blocks > 0 and (status.f_bavail == 0 or status.f_favail == 0)


_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


async def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view) :]
        except BlockingIOError:
            await anyio.wait_writable(fd)


class Run:
    """One command in a sandbox: its output, how it ended."""

    def __init__(self, sandbox: Sandbox, job: Job) -> None:
        self._sandbox = sandbox
        self._job = job
        self.exit: Exit | None = None

    @classmethod
    async def start(
        cls, sandbox: Sandbox, command: str | list[str], env: Mapping[str, str], cwd: str
    ) -> Run | str:
        """The command running (a string is a shell command), or why it could not start."""
        try:
            job = await sandbox.run(command, env=env, cwd=cwd)
        except SandboxBroken as exc:
            if sandbox.broken:
                raise ExecutorError(str(exc)) from None
            return str(exc)  # no zygote could be made: the process limit, say
        return cls(sandbox, job)

    async def collect(self, stdout: OutputBuffer, stderr: OutputBuffer, grace: float) -> None:
        """Read both streams until the command has ended and they are drained (at most
        ``grace`` seconds after the end: what holds a pipe then is not waited for, what
        the pipes hold then is still taken)."""
        broken: SandboxBroken | None = None

        async def ended() -> bool:
            nonlocal broken
            try:
                self.exit = await self._sandbox.wait(self._job)
            except SandboxBroken as exc:  # raised below: in the group it would be a group
                broken = exc
                return False
            return True

        pipes = [(self._job.stdout, stdout), (self._job.stderr, stderr)]
        await read_pipes(pipes, ended, grace=grace)
        if broken is not None:
            raise broken

    def abandon(self) -> None:
        """Kill the command, close its pipes, wait for nothing: its caller is gone (the
        kernel ends its namespace; the sandbox's own end waits for every process)."""
        if self.exit is None:
            self._sandbox.kill(self._job)
        self._job.close()

    async def end(self, grace: float) -> None:
        """Kill the command unless it ended (shielded by the caller), then close its pipes."""
        try:
            if self.exit is None:
                self._sandbox.kill(self._job)
                with anyio.move_on_after(grace + 5):
                    try:
                        self.exit = await self._sandbox.wait(self._job)
                    except SandboxBroken:
                        pass
        finally:
            self._job.close()
