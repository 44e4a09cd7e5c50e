"""The SSH executor: the agent's commands and artifacts on a remote host, over asyncssh.

One pooled connection per (user, host, port), shared by every scenario that uses the
same executor, with at most ``max_channels`` sessions open on it at once (OpenSSH's
MaxSessions is 10 and 10 in flight still fails sometimes). A refused channel open is
retried; a dropped connection is re-made on next use. asyncssh runs on asyncio only.

Containment (:attr:`SSHExecutor.containment`, probed once per connection, in the order
of ``containments``): ``"pidns"`` runs each command's shell as the init of a new PID
namespace (``unshare --fork --pid --kill-child``, as root); ``"bwrap"`` does the same
with bubblewrap (``--unshare-pid --die-with-parent``; note that bwrap forbids gaining
privileges, so ``sudo`` fails inside); when that init ends, the kernel kills everything
left in the namespace, background jobs, ``setsid``, ``nohup`` and double forks included.
``"session-kill"`` is the fallback: when the command ends, every process of its login
session, or carrying the command's tag in its environment, is killed (what clears its
environment and calls ``setsid`` escapes it). The host's ``/proc`` stays visible, so
``ps`` and ``pgrep`` see the host as usual.

Each command's wrapper prints a per-command nonce and its process group on stderr
(found anywhere in the stream, whatever the login shell prints first, and stripped
again); on a time-out or a cancellation the group is killed from a second channel
(TERM, a short grace, KILL), in a shielded scope. The channel's stdin is held by a
small watchdog: when the channel closes or the connection drops (the sshd process
serving it dies), the watchdog kills the command. The command's own stdin is
``/dev/null``.

Artifacts are written by a small POSIX helper, not SFTP (whose path lookups follow any
link a racing process swaps in): it enters the workdir and each parent with ``cd -P``
and checks, with the kernel's ``getcwd`` (``/bin/pwd -P``), that it is still inside;
then writes a fresh file created exclusively in that directory and renames it over the
final name (``mv -T``), so a hard or symbolic link there is replaced, never written
through. The workdir's real path and inode, taken by :meth:`SSHExecutor.prepare`, are
checked before every write: a workdir deleted or replaced (by a symbolic link, say) is
an :class:`ExecutorError`.
"""

from __future__ import annotations

import asyncio
import os
import re
import secrets
import shlex
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any, TypeVar
from urllib.parse import urlsplit

import anyio
import asyncssh

from .base import (
    DEFAULT_OUTPUT_CAP,
    Closing,
    ExecutorError,
    OutputBuffer,
    PathRefused,
    confine,
    refused_artifact,
    seed_files,
)
from .events import EventLogger
from .observation import CommandEnv, Observation

__all__ = [
    "CONTAINMENTS",
    "SSHExecutor",
    "SSHHostKeyRejected",
    "SSHAuthRefused",
    "SSHTarget",
    "SSHUnreachable",
    "read_identity",
]

_log = EventLogger("cmbs_async.ssh")
T = TypeVar("T")

#: What may contain the remote commands, strongest first (see the module docstring).
CONTAINMENTS = ("pidns", "bwrap", "session-kill")

# How each containment starts the command's shell: as a PID namespace's init that dies
# with its launcher (unshare --kill-child, bwrap --die-with-parent), or plainly.
_LAUNCH = {
    "pidns": "unshare --fork --pid --kill-child -- ",
    "bwrap": "bwrap --dev-bind / / --unshare-pid --die-with-parent -- ",
    "session-kill": "",
}

# KILL every process of session {sid} (pgrep, where procps is installed) or tagged
# CMBS_RUN={tag} (GNU grep), zombies aside, but this shell, until a pass finds none
# (what was forked meanwhile is caught by the next pass).
_SWEEP = (
    "n=1; i=0; while [ $n = 1 ] && [ $i -lt 20 ]; do n=0; i=$((i+1)); "
    "for p in $(pgrep -s {sid} 2>/dev/null) $(grep -lsxz CMBS_RUN={tag} /proc/[0-9]*/environ); "
    'do p=${{p#/proc/}}; p=${{p%/environ}}; [ "$p" = $$ ] && continue; '
    '{{ read -r s < "/proc/$p/stat"; }} 2>/dev/null || continue; '
    'case ${{s##*) }} in Z*|X*) continue;; esac; kill -KILL "$p" 2>/dev/null && n=1; '
    "done; done; "
)

# Each command: the login shell (POSIX: sh, bash, dash, ksh, zsh) prints the nonce and
# its pid (sshd made it a session and group leader), keeps the channel's stdin for a
# watchdog that kills the command when the channel goes, and runs the command with
# /bin/sh -c (as locally; a second login shell would read its start-up files again),
# contained, in the workdir, with stdin from /dev/null. The wrapper itself then writes
# nothing (a write to a dropped channel would kill it before its clean-up).
_WRAPPER = (
    "printf 'cmbs-{nonce}=%s\\n' \"$$\" >&2; exec 3<&0 </dev/null; "
    'CMBS_RUN={nonce} {exports}{launch}/bin/sh -c \'cd -- "$1" || exit 1; eval "$2"\' '
    "sh {workdir} {command} 3<&- & c=$!; exec 2>/dev/null; "
    "{{ while read -r _; do :; done; kill -KILL $c; }} <&3 & w=$!; exec 3<&-; "
    "wait $c; rc=$?; kill $w 2>/dev/null; {sweep}exit $rc"
)

# On a time-out or a cancellation, from a second channel: TERM to the command's group,
# a grace, KILL (which also ends a namespace's launcher, hence the namespace).
_KILL = (
    "kill -TERM -- -{pid} 2>/dev/null && {{ i=0; while kill -0 -- -{pid} 2>/dev/null && "
    "[ $i -lt 10 ]; do sleep {step:.3f}; i=$((i+1)); done; kill -KILL -- -{pid} 2>/dev/null; }}; "
    "{sweep}exit 0"
)

# Which containments the host allows, in the caller's order.
_PROBE = "if {launch}true >/dev/null 2>&1; then echo cmbs-{nonce}={name}; exit 0; fi; "

# The workdir: its name, real path (the kernel's getcwd, not the shell's idea of it) and inode.
_IDENTIFY = '{make}cd -P -- "$w" && printf \'cmbs-{nonce}\\n%s\\n\' "$w" && /bin/pwd -P && ls -di .'

# An artifact: content on stdin into a fresh file in the checked directory, renamed into
# place. Exit 3: the workdir changed; 4: a link leads out; 5: a parent is no directory;
# 6: the final name is a symbolic link.
_WRITE = (
    'cd -P -- {workdir} 2>/dev/null && [ "$(/bin/pwd -P)" = {real} ] && set -- $(ls -di .) '
    '&& [ "$1" = {inode} ] || exit 3; '
    "{walk}[ -h {name} ] && exit 6; set -C; cat > {temp} || exit 7; "
    "mv -f -T -- {temp} {name} || {{ rm -f -- {temp}; exit 7; }}"
)
_STEP = (
    "mkdir -- {part} 2>/dev/null; cd -P -- {part} 2>/dev/null || exit 5; "
    "case $(/bin/pwd -P) in {inside}) ;; *) exit 4;; esac; "
)


class SSHUnreachable(ExecutorError):
    """The host could not be reached (refused, no route, time-out, dropped)."""


class SSHAuthRefused(ExecutorError):
    """The host refused the offered credentials, or they could not be offered."""


def read_identity(path: str) -> asyncssh.SSHKey:
    """The private key in ``path``, or :class:`SSHAuthRefused` saying why it cannot be used
    (unreadable, not a key, or encrypted: cmbs cannot ask for a passphrase)."""
    try:
        return asyncssh.read_private_key(path)
    except OSError as exc:
        raise SSHAuthRefused(f"identity {path}: cannot read: {exc.strerror or exc}") from None
    except (asyncssh.KeyImportError, ValueError) as exc:
        raise SSHAuthRefused(f"identity {path}: not a usable private key: {exc}") from None


class SSHHostKeyRejected(ExecutorError):
    """The host's key is not the one expected (or not known at all)."""


@dataclass(frozen=True)
class SSHTarget:
    """Where and how to connect. Host keys are verified unless ``insecure`` is set."""

    host: str
    user: str | None = None
    port: int = 22
    identities: tuple[str, ...] = ()
    known_hosts: str | None = None
    host_key: str | None = None
    insecure: bool = False
    connect_timeout: float = 10.0
    keepalive_interval: float = 15.0

    @classmethod
    def parse(cls, url: str, **options: Any) -> SSHTarget:
        """``ssh://[USER@]HOST[:PORT]``; ``ValueError`` with a one-line reason otherwise."""
        parts = urlsplit(url)
        if parts.scheme != "ssh" or not parts.hostname or parts.path not in ("", "/"):
            raise ValueError(f"{url!r}: expected ssh://USER@HOST[:PORT]")
        try:
            port = parts.port or 22
        except ValueError:
            raise ValueError(f"{url!r}: the port is not a number from 1 to 65535") from None
        return cls(host=parts.hostname, user=parts.username, port=port, **options)

    @property
    def label(self) -> str:
        user = f"{self.user}@" if self.user else ""
        return f"{user}{self.host}:{self.port}"


# Login-shell output looked through for the marker before giving up on finding it.
_MARKER_WINDOW = 64


class _Session(asyncssh.SSHClientSession[bytes]):
    """Collects one command's output into capped buffers and notes how it ended.

    The wrapper's marker (``cmbs-NONCE=PID``) is searched for anywhere in stderr, after
    whatever the login shell printed first, and cut out of what is kept.
    """

    def __init__(self, cap: int, nonce: str) -> None:
        self.stdout = OutputBuffer(cap)
        self.stderr = OutputBuffer(cap)
        self.exited = anyio.Event()
        self.closed = anyio.Event()
        self.status: int | None = None
        self.signal: str | None = None
        self.lost: Exception | None = None
        self.nonce = nonce
        self.pgid: int | None = None
        self._marker = re.compile(re.escape(f"cmbs-{nonce}=".encode()) + rb"(\d+)\n")
        self._head = b""

    def data_received(self, data: bytes, datatype: asyncssh.DataType) -> None:
        if datatype != asyncssh.EXTENDED_DATA_STDERR:
            self.stdout.feed(data)
        elif self.pgid is not None:
            self.stderr.feed(data)
        else:
            self._head += data
            match = self._marker.search(self._head)
            if match:
                self.pgid = int(match.group(1))
                self.stderr.feed(self._head[: match.start()] + self._head[match.end() :])
                self._head = b""
            elif len(self._head) > _MARKER_WINDOW:  # keep what may be a marker's start
                self.stderr.feed(self._head[:-_MARKER_WINDOW])
                self._head = self._head[-_MARKER_WINDOW:]

    def finish(self) -> None:
        """Pass on what was held back while looking for a marker that never came."""
        self.stderr.feed(self._head)
        self._head = b""

    def exit_status_received(self, status: int) -> None:
        self.status = status
        self.exited.set()

    def exit_signal_received(self, signal: str, core_dumped: bool, msg: str, lang: str) -> None:
        self.signal = signal
        self.exited.set()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = exc
        self.exited.set()
        self.closed.set()


@dataclass
class _Host:
    """One pooled connection, what contains commands on it, and its channel budget."""

    target: SSHTarget
    slots: anyio.Semaphore
    lock: anyio.Lock
    conn: asyncssh.SSHClientConnection | None = None
    containment: str | None = None  # probed on first use of each connection
    dropped: bool = False


@dataclass(frozen=True)
class _Workdir:
    """What a workdir was at :meth:`SSHExecutor.prepare`: real path and inode."""

    real: str
    inode: str


class _Client(asyncssh.SSHClient):
    def __init__(self, host: _Host) -> None:
        self._host = host

    def connection_lost(self, exc: Exception | None) -> None:
        self._host.dropped = True


class SSHExecutor(Closing):
    """Runs commands and writes artifacts on ``target``; see the module docstring.

    ``containments`` lists what may contain commands, in order of preference;
    :attr:`containment` says which the host allowed (``"unknown"`` before connecting).
    """

    def __init__(
        self,
        target: SSHTarget,
        *,
        max_channels: int = 8,
        channel_retries: int = 20,
        output_cap: int = DEFAULT_OUTPUT_CAP,
        kill_grace: float = 0.5,
        drain_grace: float = 0.2,
        containments: Sequence[str] = CONTAINMENTS,
    ) -> None:
        if max_channels < 1:
            raise ValueError("max_channels must be at least 1")
        unknown = [name for name in containments if name not in CONTAINMENTS]
        if unknown or not containments:
            raise ValueError(f"containments must be some of {', '.join(CONTAINMENTS)}")
        self.target = target
        self.max_channels = max_channels
        self.channel_retries = channel_retries
        self.output_cap = output_cap
        self.kill_grace = kill_grace
        self.drain_grace = drain_grace
        self.containments = tuple(containments)
        self.containment = "unknown"
        self._host: _Host | None = None
        self._workdirs: dict[str, _Workdir] = {}
        if target.insecure:
            _log.warning("ssh.host_key_check_disabled", host=target.label)

    # -- the executor protocol --------------------------------------------------------
    async def prepare(self, workdir: str | None, files: Mapping[str, str]) -> str:
        if workdir is None:
            make = "w=$(mktemp -d /tmp/cmbs-XXXXXXXX) && "
        else:
            make = f'w={shlex.quote(workdir)} && mkdir -p -- "$w" && '
        workdir = await self._identify(workdir, make)
        await seed_files(self, workdir, files)
        return workdir

    async def cleanup(self, workdir: str, *, remove: bool = True) -> None:
        self._workdirs.pop(workdir, None)
        if not remove:
            return
        async with self._channel() as conn:
            await self._run_plain(conn, f"rm -rf -- {shlex.quote(workdir)}")

    async def write_artifact(self, workdir: str, path: str, content: str) -> Observation:
        start = anyio.current_time()
        try:
            relative = confine(path)
            script = _write_script(workdir, await self._known(workdir), relative)
            async with self._channel() as conn:
                result = await self._run_plain(conn, script, input=content)
        except PathRefused as exc:
            return refused_artifact(path, str(exc))
        except (asyncssh.Error, OSError) as exc:
            return refused_artifact(path, f"cannot write {path!r}: {_reason(exc)}")
        match result.exit_status:
            case 0:
                return Observation(
                    kind="artifact",
                    path=path,
                    success=True,
                    duration_s=anyio.current_time() - start,
                )
            case 3:
                raise ExecutorError(f"workdir {workdir} was deleted or replaced during the run")
            case 4:
                reason = f"artifact path {path!r} leads outside the workdir through a link"
            case 5:
                reason = f"cannot write {path!r}: a parent is not a directory"
            case 6:
                reason = f"artifact path {path!r} is a symbolic link"
            case status:
                reason = f"cannot write {path!r}: {_last_line(result.stderr) or f'exit {status}'}"
        return refused_artifact(path, reason)

    async def run_command(
        self, workdir: str, command: str, *, timeout: float | None, env: CommandEnv | None = None
    ) -> Observation:
        start = anyio.current_time()
        timed_out = False
        async with self._channel() as conn:
            nonce = secrets.token_hex(8)
            try:
                containment = await self._contained(conn)
                remote = _remote_command(workdir, command, containment, nonce, env)
                channel, session = await self._open(conn, remote, nonce)
            except (asyncssh.Error, OSError) as exc:
                self._host_dropped()
                return Observation(
                    kind="command",
                    command=command,
                    success=False,
                    error=f"could not start the command on {self.target.label}: {_reason(exc)}",
                    duration_s=anyio.current_time() - start,
                )
            try:
                with anyio.move_on_after(timeout) as scope:
                    await session.exited.wait()
                    with anyio.move_on_after(self.drain_grace):
                        await session.closed.wait()
                timed_out = scope.cancelled_caught
            finally:
                with anyio.CancelScope(shield=True):
                    await self._release(conn, channel, session, containment)
        return self._observation(command, session, timed_out, timeout, start)

    # -- life cycle -----------------------------------------------------------------
    async def aclose(self) -> None:
        host, self._host = self._host, None
        if host is not None and host.conn is not None:
            host.conn.close()
            with anyio.move_on_after(5, shield=True):
                await host.conn.wait_closed()

    # -- internals ------------------------------------------------------------------
    def _observation(
        self, command: str, session: _Session, timed_out: bool, timeout: float | None, start: float
    ) -> Observation:
        session.finish()
        lost = session.lost is not None and session.status is None
        if timed_out:
            error: str | None = f"command timed out after {timeout:g} s"
        elif lost:
            error = f"connection to {self.target.label} lost during the command"
        elif session.signal is not None:
            error = f"command killed by signal {session.signal}"
        else:
            error = None
        status = session.status
        return Observation(
            kind="command",
            command=command,
            success=error is None and status == 0,
            exit_status=status,
            program_found=None if status is None or timed_out else status != 127,
            timed_out=timed_out,
            error=error,
            stdout=session.stdout.output(),
            stderr=session.stderr.output(),
            duration_s=anyio.current_time() - start,
        )

    async def _known(self, workdir: str) -> _Workdir:
        """The workdir's identity: from :meth:`prepare`, or taken now (one not prepared here)."""
        if workdir not in self._workdirs:
            await self._identify(workdir, f"w={shlex.quote(workdir)} && ")
        return self._workdirs[workdir]

    async def _identify(self, workdir: str | None, make: str) -> str:
        """Run ``make`` (which sets ``$w``), then note the workdir's real path and inode."""
        nonce = secrets.token_hex(8)
        try:
            async with self._channel() as conn:
                await self._contained(conn)
                result = await self._run_plain(conn, _IDENTIFY.format(make=make, nonce=nonce))
        except (asyncssh.Error, OSError) as exc:
            raise ExecutorError(f"cannot reach {self.target.label}: {_reason(exc)}") from None
        found = re.search(rf"cmbs-{nonce}\n(.+)\n(/.*)\n\s*(\d+) \.\n", str(result.stdout or ""))
        if result.exit_status != 0 or found is None:
            where = workdir or "a temporary workdir"
            why = _last_line(result.stderr) or f"exit {result.exit_status}"
            raise ExecutorError(f"cannot create {where} on {self.target.label}: {why}")
        self._workdirs[found[1]] = _Workdir(real=found[2], inode=found[3])
        return found[1]

    async def _open(
        self, conn: asyncssh.SSHClientConnection, remote: str, nonce: str
    ) -> tuple[asyncssh.SSHClientChannel[bytes], _Session]:
        """Open a session channel, retrying while the server refuses new channels."""
        channel, session = await self._retrying(
            lambda: conn.create_session(
                lambda: _Session(self.output_cap, nonce), remote, encoding=None
            )
        )
        assert isinstance(session, _Session)
        return channel, session

    async def _retrying(self, open_channel: Callable[[], Awaitable[T]]) -> T:
        """``open_channel()``, again after a short back-off while the server refuses it."""
        for attempt in range(self.channel_retries):
            try:
                return await open_channel()
            except asyncssh.ChannelOpenError:
                await anyio.sleep(min(0.01 * 2**attempt, 0.5))
        return await open_channel()

    async def _release(
        self,
        conn: asyncssh.SSHClientConnection,
        channel: asyncssh.SSHClientChannel[bytes],
        session: _Session,
        containment: str,
    ) -> None:
        """Kill what is left of the command unless it ended cleanly; close the channel.

        Closing the channel alone also ends it (the remote watchdog sees its stdin close).
        """
        if not session.closed.is_set() and session.pgid is not None and not self._is_dropped():
            sweep = _sweep(containment, str(session.pgid), session.nonce)
            script = _KILL.format(pid=session.pgid, step=self.kill_grace / 10, sweep=sweep)
            with anyio.move_on_after(self.kill_grace + 5):
                try:
                    await self._run_plain(conn, script)
                except (asyncssh.Error, OSError):
                    pass
        channel.close()
        with anyio.move_on_after(self.kill_grace + 1):
            await session.closed.wait()

    async def _run_plain(
        self, conn: asyncssh.SSHClientConnection, command: str, *, input: str | None = None
    ) -> asyncssh.SSHCompletedProcess:
        return await self._retrying(lambda: conn.run(command, input=input, check=False))

    @asynccontextmanager
    async def _channel(self) -> AsyncIterator[asyncssh.SSHClientConnection]:
        """The pooled connection, holding one channel slot."""
        conn = await self._connection()
        assert self._host is not None
        async with self._host.slots:
            yield conn

    def _is_dropped(self) -> bool:
        return self._host is None or self._host.dropped

    def _host_dropped(self) -> None:
        if self._host is not None:
            self._host.dropped = True

    async def _connection(self) -> asyncssh.SSHClientConnection:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            raise ExecutorError(
                "the SSH executor needs the asyncio backend (asyncssh does not run on trio)"
            ) from None
        if self._host is None:
            self._host = _Host(self.target, anyio.Semaphore(self.max_channels), anyio.Lock())
        host = self._host
        if host.conn is not None and not host.dropped:
            return host.conn
        async with host.lock:
            if host.conn is None or host.dropped:
                if host.conn is not None:
                    host.conn.abort()
                    host.conn = None
                host.dropped = False
                host.containment = None
                host.conn = await self._connect(host)
            return host.conn

    async def _contained(self, conn: asyncssh.SSHClientConnection) -> str:
        """What contains commands on this connection, probed on its first use."""
        host = self._host
        assert host is not None
        if host.containment is None:
            async with host.lock:
                if host.containment is None:
                    host.containment = self.containment = await self._probe(conn)
        return host.containment

    async def _probe(self, conn: asyncssh.SSHClientConnection) -> str:
        """Which of ``containments`` the host allows, the first that works."""
        nonce = secrets.token_hex(8)
        script = "".join(
            _PROBE.format(launch=_LAUNCH[name], nonce=nonce, name=name)
            for name in self.containments
        )
        result = await self._run_plain(conn, script + f"echo cmbs-{nonce}=none")
        found = re.search(rf"cmbs-{nonce}=([a-z-]+)", str(result.stdout or ""))
        if found is not None and found[1] != "none":
            return found[1]
        if found is None and "session-kill" in self.containments:
            # no POSIX shell answered: promise no more than the weakest
            _log.warning("ssh.containment_probe_unanswered", host=self.target.label)
            return "session-kill"
        raise ExecutorError(
            f"{self.target.label} allows none of the containments {', '.join(self.containments)}"
        )

    async def _connect(self, host: _Host) -> asyncssh.SSHClientConnection:
        target = self.target
        options: dict[str, Any] = {
            "port": target.port,
            "connect_timeout": target.connect_timeout,
            "keepalive_interval": target.keepalive_interval,
            "keepalive_count_max": 3,
            "client_factory": lambda: _Client(host),
        }
        if target.user:
            options["username"] = target.user
        if target.identities:
            options["client_keys"] = [read_identity(path) for path in target.identities]
        if target.insecure:
            options["known_hosts"] = None
        elif target.host_key:
            try:
                key = asyncssh.import_public_key(target.host_key)
            except (asyncssh.KeyImportError, ValueError) as exc:
                raise SSHHostKeyRejected(f"the pinned host key is not valid: {exc}") from None
            options["known_hosts"] = ([key], [], [])
        elif target.known_hosts:
            options["known_hosts"] = target.known_hosts
        try:
            return await asyncssh.connect(target.host, **options)
        except asyncssh.HostKeyNotVerifiable:
            raise SSHHostKeyRejected(
                f"host key of {target.label} not verified (unknown host or key mismatch)"
            ) from None
        except asyncssh.PermissionDenied:
            raise SSHAuthRefused(f"authentication refused by {target.label}") from None
        except (OSError, TimeoutError, asyncssh.Error) as exc:
            raise SSHUnreachable(f"cannot reach {target.label}: {_reason(exc)}") from None


def _declared(env: CommandEnv | None) -> dict[str, str]:
    """What the scenario sets for a remote command: ``pass_env`` from the operator's
    environment here, then ``values`` (the host's own environment is the base)."""
    if env is None:
        return {}
    passed = {name: os.environ[name] for name in env.pass_env if name in os.environ}
    return passed | env.values


def _sweep(containment: str, sid: str, nonce: str) -> str:
    """The session sweep, where nothing else contains the command."""
    return _SWEEP.format(sid=sid, tag=nonce) if containment == "session-kill" else ""


def _remote_command(
    workdir: str, command: str, containment: str, nonce: str, env: CommandEnv | None
) -> str:
    exports = "".join(f"{name}={shlex.quote(value)} " for name, value in _declared(env).items())
    return _WRAPPER.format(
        nonce=nonce,
        exports=exports,
        launch=_LAUNCH[containment],
        workdir=shlex.quote(workdir),
        command=shlex.quote(command),
        sweep=_sweep(containment, "$$", nonce),
    )


def _write_script(workdir: str, known: _Workdir, relative: PurePosixPath) -> str:
    inside = shlex.quote(known.real.rstrip("/")) + "/*"
    walk = "".join(
        _STEP.format(part=shlex.quote(part), inside=inside) for part in relative.parts[:-1]
    )
    return _WRITE.format(
        workdir=shlex.quote(workdir),
        real=shlex.quote(known.real),
        inode=known.inode,
        walk=walk,
        name=shlex.quote(relative.name),
        temp=f".cmbs-{secrets.token_hex(8)}.tmp",
    )


def _last_line(text: object) -> str:
    lines = str(text or "").strip().splitlines()
    return lines[-1] if lines else ""


def _reason(exc: BaseException) -> str:
    """A one-line reason that never carries key material."""
    if isinstance(exc, asyncssh.Error):
        return exc.reason or type(exc).__name__
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc) or type(exc).__name__
