"""The SSH executor: the agent's commands and artifacts on a remote host, over asyncssh.

One pooled connection per (user, host, port), shared by every scenario that uses the
same executor, with at most ``max_channels`` sessions open on it at once (OpenSSH's
MaxSessions is 10 and 10 in flight still fails sometimes). A refused channel open is
retried; a dropped connection is re-made on next use. asyncssh runs on asyncio only.

Each command runs behind a small POSIX prefix that reports its process group first (sshd
makes the session's shell a group leader) and signals what is left of the group when the
command ends. On a time-out or a cancellation the group is killed from a second channel
(TERM, a short grace, KILL) and the channel closed, in a shielded scope: cancelling
asyncssh's ``run()`` alone would leave the remote process running.
"""

from __future__ import annotations

import posixpath
import re
import shlex
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar
from urllib.parse import urlsplit

import anyio
import asyncssh
import sniffio
import structlog

from cmbs_async.protocol import Observation

from .base import (
    DEFAULT_OUTPUT_CAP,
    ExecutorError,
    OutputBuffer,
    PathRefused,
    confine,
    refused_artifact,
    seed_files,
)

__all__ = [
    "SSHExecutor",
    "SSHHostKeyRejected",
    "SSHAuthRefused",
    "SSHTarget",
    "SSHUnreachable",
]

_log = structlog.get_logger("cmbs_async.ssh")
T = TypeVar("T")

# Each command runs in the login shell (POSIX: sh, bash, dash, ksh, zsh) behind a prefix
# that prints the shell's process group on stderr (stripped again before anyone sees the
# output), enters the workdir and, on exit, sends TERM to the rest of its group: a
# background grandchild does not outlive the command, nor keep the channel open by
# holding its pipes. No extra process is started for it. A command that sets its own
# EXIT trap replaces that last clean-up; time-outs and cancellations do not depend on it.
_PREFIX = (
    "printf 'cmbs-pgid=%s\\n' \"$$\" >&2; cd -- {workdir} || exit 1; "
    "trap 'rc=$?; trap \"exit $rc\" TERM; kill -TERM -- -$$ 2>/dev/null; exit $rc' EXIT; "
    "eval {command}"
)
_PGID = re.compile(rb"\Acmbs-pgid=(\d+)\n")


class SSHUnreachable(ExecutorError):
    """The host could not be reached (refused, no route, time-out, dropped)."""


class SSHAuthRefused(ExecutorError):
    """The host refused the offered credentials."""


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


class _Session(asyncssh.SSHClientSession[bytes]):
    """Collects one command's output into capped buffers and notes how it ended."""

    def __init__(self, cap: int) -> None:
        self.stdout = OutputBuffer(cap)
        self.stderr = OutputBuffer(cap)
        self.exited = anyio.Event()
        self.closed = anyio.Event()
        self.status: int | None = None
        self.signal: str | None = None
        self.lost: Exception | None = None
        self.pgid: int | None = None
        self._head = b""
        self._marker_seen = False

    def data_received(self, data: bytes, datatype: asyncssh.DataType) -> None:
        if datatype != asyncssh.EXTENDED_DATA_STDERR:
            self.stdout.feed(data)
        elif self._marker_seen:
            self.stderr.feed(data)
        else:  # the wrapper's first line: strip it, keep the group id
            self._head += data
            match = _PGID.match(self._head)
            if match or b"\n" in self._head or len(self._head) > 64:
                self._marker_seen = True
                if match:
                    self.pgid = int(match.group(1))
                self.stderr.feed(self._head[match.end() :] if match else self._head)
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
    """One pooled connection and the channel budget on it."""

    target: SSHTarget
    slots: anyio.Semaphore
    lock: anyio.Lock = field(default_factory=anyio.Lock)
    conn: asyncssh.SSHClientConnection | None = None
    sftp: asyncssh.SFTPClient | None = None
    dropped: bool = False


class _Client(asyncssh.SSHClient):
    def __init__(self, host: _Host) -> None:
        self._host = host

    def connection_lost(self, exc: Exception | None) -> None:
        self._host.dropped = True


class SSHExecutor:
    """Runs commands and writes artifacts on ``target``; see the module docstring."""

    def __init__(
        self,
        target: SSHTarget,
        *,
        max_channels: int = 8,
        channel_retries: int = 20,
        output_cap: int = DEFAULT_OUTPUT_CAP,
        kill_grace: float = 0.5,
        drain_grace: float = 0.2,
    ) -> None:
        if max_channels < 2:
            raise ValueError("max_channels must be at least 2 (one is kept for SFTP)")
        self.target = target
        self.max_channels = max_channels
        self.channel_retries = channel_retries
        self.output_cap = output_cap
        self.kill_grace = kill_grace
        self.drain_grace = drain_grace
        self._host: _Host | None = None
        if target.insecure:
            _log.warning("ssh.host_key_check_disabled", host=target.label)

    # -- the executor protocol --------------------------------------------------------
    async def prepare(self, workdir: str | None, files: Mapping[str, str]) -> str:
        conn = await self._connection()
        if workdir is None:
            result = await self._run_plain(conn, "mktemp -d /tmp/cmbs-XXXXXXXX")
            if result.exit_status != 0:
                raise ExecutorError(f"cannot create a remote workdir on {self.target.label}")
            workdir = str(result.stdout).strip()
        else:
            sftp = await self._sftp()
            try:
                await sftp.makedirs(workdir, exist_ok=True)
            except (asyncssh.SFTPError, OSError) as exc:
                raise ExecutorError(f"cannot create remote workdir {workdir}: {exc}") from exc
        await seed_files(self, workdir, files)
        return workdir

    async def cleanup(self, workdir: str) -> None:
        conn = await self._connection()
        await self._run_plain(conn, f"rm -rf -- {shlex.quote(workdir)}")

    async def write_artifact(self, workdir: str, path: str, content: str) -> Observation:
        start = anyio.current_time()
        try:
            relative = confine(path)
            sftp = await self._sftp()
            parent = await self._confined_parent(sftp, workdir, relative.parts[:-1], path)
            target = posixpath.join(parent, relative.name)
            try:
                if (await sftp.lstat(target)).type == asyncssh.FILEXFER_TYPE_SYMLINK:
                    raise PathRefused(f"artifact path {path!r} is a symbolic link")
            except asyncssh.SFTPNoSuchFile:
                pass
            async with sftp.open(target, "wb") as handle:
                await handle.write(content.encode())
        except PathRefused as exc:
            return refused_artifact(path, str(exc))
        except (asyncssh.SFTPError, asyncssh.DisconnectError, OSError) as exc:
            return refused_artifact(path, f"cannot write {path!r}: {_reason(exc)}")
        return Observation(
            kind="artifact", path=path, success=True, duration_s=anyio.current_time() - start
        )

    async def run_command(
        self, workdir: str, command: str, *, timeout: float | None
    ) -> Observation:
        start = anyio.current_time()
        remote = _remote_command(workdir, command)
        timed_out = False
        async with self._channel() as conn:
            try:
                channel, session = await self._open(conn, remote)
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
                    await self._release(conn, channel, session)
        return self._observation(command, session, timed_out, timeout, start)

    # -- life cycle -----------------------------------------------------------------
    async def aclose(self) -> None:
        host, self._host = self._host, None
        if host is not None and host.conn is not None:
            host.conn.close()
            with anyio.move_on_after(5, shield=True):
                await host.conn.wait_closed()

    async def __aenter__(self) -> SSHExecutor:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    # -- internals ------------------------------------------------------------------
    def _observation(
        self, command: str, session: _Session, timed_out: bool, timeout: float | None, start: float
    ) -> Observation:
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

    async def _open(
        self, conn: asyncssh.SSHClientConnection, remote: str
    ) -> tuple[asyncssh.SSHClientChannel[bytes], _Session]:
        """Open a session channel, retrying while the server refuses new channels."""
        channel, session = await self._retrying(
            lambda: conn.create_session(lambda: _Session(self.output_cap), remote, encoding=None)
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
    ) -> None:
        """Kill what is left of the command's group unless it ended cleanly; close the channel."""
        if not session.closed.is_set() and session.pgid is not None and not self._is_dropped():
            group = f"-{session.pgid}"
            script = (
                f"kill -TERM -- {group} 2>/dev/null || exit 0; "
                f"i=0; while kill -0 -- {group} 2>/dev/null && [ $i -lt 10 ]; do "
                f"sleep {self.kill_grace / 10:.3f}; i=$((i+1)); done; "
                f"kill -KILL -- {group} 2>/dev/null; exit 0"
            )
            with anyio.move_on_after(self.kill_grace + 5):
                try:
                    await self._run_plain(conn, script)
                except (asyncssh.Error, OSError):
                    pass
        channel.close()
        with anyio.move_on_after(self.kill_grace + 1):
            await session.closed.wait()

    async def _run_plain(
        self, conn: asyncssh.SSHClientConnection, command: str
    ) -> asyncssh.SSHCompletedProcess:
        return await self._retrying(lambda: conn.run(command, check=False))

    async def _confined_parent(
        self, sftp: asyncssh.SFTPClient, workdir: str, parts: tuple[str, ...], path: str
    ) -> str:
        """Walk (and create) the parent directories, refusing any link that leads out."""
        root = await sftp.realpath(workdir)
        current = root
        for part in parts:
            step = posixpath.join(current, part)
            try:
                attrs = await sftp.lstat(step)
            except asyncssh.SFTPNoSuchFile:
                await sftp.mkdir(step)
                current = step
                continue
            if attrs.type == asyncssh.FILEXFER_TYPE_SYMLINK:
                step = await sftp.realpath(step)
                if not (step == root or step.startswith(root.rstrip("/") + "/")):
                    raise PathRefused(
                        f"artifact path {path!r} leads outside the workdir through a link"
                    )
            current = step
        return current

    @asynccontextmanager
    async def _channel(self) -> AsyncIterator[asyncssh.SSHClientConnection]:
        conn = await self._connection()
        assert self._host is not None
        async with self._host.slots:
            yield conn

    def _is_dropped(self) -> bool:
        return self._host is None or self._host.dropped

    def _host_dropped(self) -> None:
        if self._host is not None:
            self._host.dropped = True

    async def _sftp(self) -> asyncssh.SFTPClient:
        await self._connection()
        host = self._host
        assert host is not None
        async with host.lock:
            if host.sftp is None:
                await host.slots.acquire()  # the SFTP channel holds one slot for good
                try:
                    host.sftp = await host.conn.start_sftp_client()  # type: ignore[union-attr]
                except (asyncssh.Error, OSError) as exc:
                    host.slots.release()
                    raise ExecutorError(
                        f"SFTP is not available on {self.target.label}: {_reason(exc)}"
                    ) from None
                except BaseException:
                    host.slots.release()
                    raise
            return host.sftp

    async def _connection(self) -> asyncssh.SSHClientConnection:
        if sniffio.current_async_library() != "asyncio":
            raise ExecutorError(
                "the SSH executor needs the asyncio backend (asyncssh does not run on trio)"
            )
        if self._host is None:
            self._host = _Host(self.target, anyio.Semaphore(self.max_channels))
        host = self._host
        if host.conn is not None and not host.dropped:
            return host.conn
        async with host.lock:
            if host.conn is None or host.dropped:
                if host.conn is not None:
                    host.conn.abort()
                    if host.sftp is not None:
                        host.sftp = None
                        host.slots.release()
                host.dropped = False
                host.conn = await self._connect(host)
            return host.conn

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
            options["client_keys"] = list(target.identities)
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


def _remote_command(workdir: str, command: str) -> str:
    return _PREFIX.format(workdir=shlex.quote(workdir), command=shlex.quote(command))


def _reason(exc: BaseException) -> str:
    """A one-line reason that never carries key material."""
    if isinstance(exc, asyncssh.Error):
        return exc.reason or type(exc).__name__
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc) or type(exc).__name__
