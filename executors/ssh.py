"""The SSH executor: the agent's commands and artifacts on a remote host, over asyncssh.

Connections take nothing from the operator's interactive SSH setup: no ``~/.ssh/config``
(``config=[]``), no ssh-agent (neither used nor forwarded), no X11, GSS, PKCS#11,
host-based, password or keyboard-interactive authentication; only what :class:`SSHTarget`
holds (host, port, user, identity files, known hosts or a pinned key, a jump host). Host
names are checked (a DNS name, an IPv4 address, an IPv6 one in brackets) when a target is
made. asyncssh runs on asyncio only.

Each prepared workdir gets one remote launcher (:mod:`executors.remote_launcher`), started
on one session channel as ``python3 -I -S`` reading its code on stdin, and kept for the
scenario: it holds the workdir by a descriptor, builds the scenario's sandbox once, runs
its canary, then runs each command, writes artifacts, kills and cleans up, all in frames
on that channel (environment values too: never in an argument vector). Commands never get
its descriptors, so nothing they print or do answers for it. A connection carries up to
``max_channels`` launchers; more scenarios open more connections; a dropped connection
is re-made, and the workdir's launcher started again, on next use.

Containment (``containments``, the first the host allows; by default :data:`SANDBOXES`):
``pidns`` (root: the launcher makes the sandbox) and ``bwrap`` (bubblewrap, root or
unprivileged user namespaces) run commands in a mount namespace where everything is
read-only but the workdir and private tmpfs (``/tmp`` with ``HOME``, ``/dev/shm``,
``/run``, the login's ``~/.ssh``), each command without capabilities and the PID 1 of a
PID namespace of its own (nothing it starts outlives it), so no command can change what
the login's sessions run (``~/.ssh/rc``, ``~/.bashrc``). ``session-kill`` is no sandbox,
used only where configured (``containments=("session-kill",)``); the canary then lists
what it does not protect.

On a time-out or a cancellation the launcher gets ``kill``: TERM to the command's group,
``kill_grace``, KILL to all of it. A launcher that does not answer (stopped, or the sshd
under it stopped: possible without a sandbox only) is killed from a fresh connection with
everything below it; so a deadline is stretched by the grace, a second and one login at
most.
"""

from __future__ import annotations

import ast
import asyncio
import functools
import ipaddress
import os
import re
import secrets
import shlex
import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import anyio
import asyncssh

from .base import (
    DEFAULT_OUTPUT_CAP,
    CleanupFailed,
    Closing,
    ExecutorError,
    OutputBuffer,
    PathRefused,
    SandboxLeak,
    confine,
    refused_artifact,
)
from .events import EventLogger
from .observation import (
    Check,
    CommandEnv,
    Containment,
    FileChange,
    InputFile,
    Observation,
    Output,
    Program,
)
from .remote_launcher import MAX_DEPTH, FrameReader, encode

__all__ = [
    "CONTAINMENTS",
    "SANDBOXES",
    "SSHAuthRefused",
    "SSHExecutor",
    "SSHHostKeyRejected",
    "SSHLauncherUnavailable",
    "SSHTarget",
    "SSHUnreachable",
    "read_identity",
]

_log = EventLogger("cmbs_async.ssh")
Meta = dict[str, Any]

#: Every containment there is, strongest first (see the module docstring).
CONTAINMENTS = ("pidns", "bwrap", "session-kill")
#: What is tried unless the operator says otherwise: the sandboxes only.
SANDBOXES = ("pidns", "bwrap")

#: How long a launcher has to acknowledge a kill before it counts as unresponsive.
_ACK_WAIT = 1.0
#: What a launcher may take beyond the kill grace to report the command's end.
_KILL_SLACK = 1.0
#: How long a launcher has to start and say hello (python3 starting, a login shell).
_START_WAIT = 30.0
#: How long a cleanup may take on the remote host.
_CLEANUP_WAIT = 30.0


class SSHUnreachable(ExecutorError):
    """The host could not be reached (refused, no route, time-out, dropped)."""


class SSHAuthRefused(ExecutorError):
    """The host refused the offered credentials, or they could not be offered."""


class SSHHostKeyRejected(ExecutorError):
    """The host's key is not the one expected (or not known at all)."""


class SSHLauncherUnavailable(ExecutorError):
    """The remote launcher could not start (no python3 on the host, say)."""


def read_identity(path: str) -> asyncssh.SSHKey:
    """The private key in ``path``, or :class:`SSHAuthRefused` saying why it cannot be used
    (unreadable, not a key, or encrypted: cmbs cannot ask for a passphrase)."""
    try:
        data = _read_capped(path, _IDENTITY_MAX)
    except OSError as exc:
        raise SSHAuthRefused(f"identity {path}: cannot read: {exc.strerror or exc}") from None
    if data is None:
        raise SSHAuthRefused(f"identity {path}: larger than 1 MiB (the cap for an identity file)")
    try:
        return asyncssh.import_private_key(data)
    except (asyncssh.KeyImportError, ValueError) as exc:
        raise SSHAuthRefused(f"identity {path}: not a usable private key: {exc}") from None


#: The largest identity (private key) and known-hosts files read.
_IDENTITY_MAX = 1 << 20
_KNOWN_HOSTS_MAX = 64 << 20


def _read_capped(path: str, cap: int) -> bytes | None:
    """At most ``cap`` bytes of ``path`` (``None`` if it holds more), never more read:
    a file of gigabytes, ``/dev/zero`` or a FIFO costs no more memory than the cap."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # a FIFO: never hangs
    try:
        os.set_blocking(fd, True)
        chunks, taken = [], 0
        while taken <= cap and (chunk := os.read(fd, min(1 << 20, cap + 1 - taken))):
            chunks.append(chunk)
            taken += len(chunk)
    finally:
        os.close(fd)
    return b"".join(chunks) if taken <= cap else None


_LABEL = re.compile(r"^[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?$")
_USER = re.compile(r"^[A-Za-z0-9_.][A-Za-z0-9_.-]{0,63}$")


def check_host(host: str) -> str:
    """``host`` if it is a DNS name, an IPv4 or an IPv6 address; ``ValueError`` otherwise
    (``${x}``, ``%h``, spaces: nothing SSH could expand or mistake for an option)."""
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        pass
    name = host[:-1] if host.endswith(".") else host
    labels = name.split(".")
    if not name or len(name) > 253 or not all(_LABEL.match(label) for label in labels):
        raise ValueError(f"{host!r} is not a host name or an IP address")
    return host


@dataclass(frozen=True)
class SSHTarget:
    """Where and how to connect. Host keys are verified unless ``insecure`` is set.

    ``jump``: a host to connect through (as ``ssh -J``), with the same identities and
    known hosts. ``ValueError`` (one line) for a host, user or port that cannot be used.
    """

    host: str
    user: str | None = None
    port: int = 22
    identities: tuple[str, ...] = ()
    known_hosts: str | None = None
    host_key: str | None = None
    insecure: bool = False
    connect_timeout: float = 10.0
    keepalive_interval: float = 15.0
    jump: SSHTarget | None = None
    #: the identities' and known hosts' contents, read already (see :meth:`carried`)
    identity_data: tuple[bytes, ...] = field(default=(), repr=False)
    known_hosts_data: bytes | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        check_host(self.host)
        if self.user is not None and not _USER.match(self.user):
            raise ValueError(f"{self.user!r} is not a user name")
        if not 0 < self.port < 65536:
            raise ValueError(f"port {self.port} is not a number from 1 to 65535")

    @classmethod
    def parse(cls, url: str, *, jump: str | SSHTarget | None = None, **options: Any) -> SSHTarget:
        """``ssh://[USER@]HOST[:PORT]`` (``[IPV6]`` in brackets); ``jump`` the same, or a
        target; ``ValueError`` with a one-line reason otherwise."""
        parts = urlsplit(url)
        if parts.scheme != "ssh" or not parts.hostname or parts.path not in ("", "/"):
            raise ValueError(f"{url!r}: expected ssh://USER@HOST[:PORT]")
        if parts.query or parts.fragment or parts.password is not None:
            raise ValueError(f"{url!r}: expected ssh://USER@HOST[:PORT]")
        try:
            port = parts.port if parts.port is not None else 22
        except ValueError:
            port = 0
        if not 1 <= port <= 65535:  # port 0 is no port to connect to, not the default
            raise ValueError(f"{url!r}: the port is not a number from 1 to 65535")
        if isinstance(jump, str):
            inherited = {k: v for k, v in options.items() if k not in ("host_key", "jump")}
            jump = cls.parse(jump, **inherited)
        try:
            return cls(host=parts.hostname, user=parts.username, port=port, jump=jump, **options)
        except ValueError as exc:
            raise ValueError(f"{url!r}: {exc}") from None

    def carried(self) -> SSHTarget:
        """This target with its identity and known-hosts files read into memory, so it can
        be used where those files are not (a batch's Ray worker): the same checks and caps
        as a connection's, :class:`SSHAuthRefused` or :class:`SSHHostKeyRejected` if one
        cannot be read."""
        for path in self.identities:
            read_identity(path)  # a key that cannot be used is said now, by its file
        if self.known_hosts:
            _known_hosts(self.known_hosts)
        return replace(
            self,
            identities=(),
            identity_data=self.identity_data
            + tuple(_read_capped(path, _IDENTITY_MAX) or b"" for path in self.identities),
            known_hosts=None,
            known_hosts_data=(
                _read_capped(self.known_hosts, _KNOWN_HOSTS_MAX)
                if self.known_hosts
                else self.known_hosts_data
            ),
            jump=self.jump.carried() if self.jump is not None else None,
        )

    @property
    def label(self) -> str:
        user = f"{self.user}@" if self.user else ""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{user}{host}:{self.port}"


def _options(target: SSHTarget) -> dict[str, Any]:
    """asyncssh's connection options: what ``target`` says, nothing from ``~/.ssh/config``
    or an agent (see the module docstring)."""
    options: dict[str, Any] = {
        "port": target.port,
        "config": [],
        "agent_path": None,
        "agent_forwarding": False,
        "x11_forwarding": False,
        "pkcs11_provider": None,
        "gss_auth": False,
        "gss_kex": False,
        "host_based_auth": False,
        "kbdint_auth": False,
        "password_auth": False,
        "preferred_auth": "publickey",
        "x509_trusted_certs": None,
        "x509_trusted_cert_paths": [],
        "connect_timeout": target.connect_timeout,
        "keepalive_interval": target.keepalive_interval,
        "keepalive_count_max": 3,
    }
    if target.user:
        options["username"] = target.user
    if target.identities or target.identity_data:
        options["client_keys"] = [read_identity(path) for path in target.identities] + [
            asyncssh.import_private_key(data) for data in target.identity_data
        ]
    if target.insecure:
        options["known_hosts"] = None
    elif target.host_key:
        try:
            key = asyncssh.import_public_key(target.host_key)
        except (asyncssh.KeyImportError, ValueError) as exc:
            raise SSHHostKeyRejected(f"the pinned host key is not valid: {exc}") from None
        options["known_hosts"] = ([key], [], [])
    elif target.known_hosts:
        options["known_hosts"] = _known_hosts(target.known_hosts)
    elif target.known_hosts_data is not None:
        options["known_hosts"] = asyncssh.import_known_hosts(
            target.known_hosts_data.decode("utf-8", "replace")
        )
    return options


def _known_hosts(path: str) -> asyncssh.SSHKnownHosts:
    """The known-hosts file ``path``, read with a cap (asyncssh would read it whole)."""
    try:
        data = _read_capped(path, _KNOWN_HOSTS_MAX)
    except OSError as exc:
        raise SSHHostKeyRejected(
            f"known hosts {path}: cannot read: {exc.strerror or exc}"
        ) from None
    if data is None:
        raise SSHHostKeyRejected(
            f"known hosts {path}: larger than 64 MiB (the cap for a known-hosts file)"
        )
    try:
        return asyncssh.import_known_hosts(data.decode("utf-8", "replace"))
    except ValueError as exc:
        raise SSHHostKeyRejected(f"known hosts {path}: not valid: {exc}") from None


@dataclass
class _Link:
    """One connection (and the jump connection under it), and its launchers' channels."""

    conn: asyncssh.SSHClientConnection | None = None
    tunnel: asyncssh.SSHClientConnection | None = None
    channels: int = 0
    dedicated: bool = False
    dropped: bool = False

    def close(self) -> None:
        for conn in (self.conn, self.tunnel):
            if conn is not None:
                conn.close()
        self.dropped = True


class _Client(asyncssh.SSHClient):
    def __init__(self, link: _Link) -> None:
        self._link = link

    def connection_lost(self, exc: Exception | None) -> None:
        self._link.dropped = True


async def _connect(target: SSHTarget, link: _Link) -> None:
    """Open ``link`` to ``target`` (through its jump host), or the error saying why not."""
    if target.jump is not None:
        jump = _Link()
        await _connect(target.jump, jump)
        link.tunnel = jump.conn
    try:
        link.conn = await asyncssh.connect(
            target.host, tunnel=link.tunnel or (), client_factory=lambda: _Client(link),
            **_options(target),
        )  # fmt: skip
    except asyncssh.HostKeyNotVerifiable:
        link.close()
        raise SSHHostKeyRejected(
            f"host key of {target.label} not verified (unknown host or key mismatch)"
        ) from None
    except asyncssh.PermissionDenied:
        link.close()
        raise SSHAuthRefused(f"authentication refused by {target.label}") from None
    except (OSError, TimeoutError, asyncssh.Error) as exc:
        link.close()
        raise SSHUnreachable(f"cannot reach {target.label}: {_reason(exc)}") from None
    except BaseException:
        link.close()
        raise


class _Lost(ExecutorError):
    """The launcher's channel closed (or its connection dropped)."""


class _Refused(ExecutorError):
    """The launcher answered a request with an error (the message, one line)."""


@dataclass
class _Pending:
    """One request's reply, and for a command what it reported on the way."""

    ident: int = 0
    done: anyio.Event = field(default_factory=anyio.Event)
    acked: anyio.Event = field(default_factory=anyio.Event)
    reply: tuple[Meta, list[bytes]] | None = None
    inputs: tuple[str, ...] = ()  # the arguments a program's run identifies


# The channel's command: the first python3 found execs a bootstrap that reads the
# launcher's code (a length in argv, the code on stdin) and runs it.
_BOOTSTRAP = (
    "import os,sys\n"
    "n=int(sys.argv[1]);b=b''\n"
    "while len(b)<n:\n"
    " c=os.read(0,n-len(b))\n"
    " if not c:sys.exit(3)\n"
    " b+=c\n"
    "exec(compile(b,'cmbs-launcher','exec'),{'__name__':'__cmbs__','CMBS_SOURCE':b})\n"
)
_START = (
    "for p in /usr/bin/python3 /usr/libexec/platform-python $(command -v python3); do "
    '[ -x "$p" ] && exec "$p" -I -S -c {bootstrap} {size}; done; '
    "echo 'cmbs: no python3 on this host' >&2; exit 127"
)
#: The exit status of the start command when no python3 was found.
_NO_PYTHON = 127


class _Plain(ast.NodeTransformer):
    """The launcher without annotations, docstrings or typing imports: what Python 3.6
    runs (annotations of 3.9+ spelling would fail there when a function is defined)."""

    def visit_ImportFrom(self, node: ast.ImportFrom) -> ast.AST | list[ast.stmt] | None:
        if node.level == 1 and node.module == "snapshot":  # sent inlined, as plain
            inlined = ast.parse(Path(__file__).with_name("snapshot.py").read_text())
            kept = [self.visit(statement) for statement in inlined.body[1:] if not _main(statement)]
            return [statement for statement in kept if isinstance(statement, ast.stmt)]
        return None if node.module in ("__future__", "typing") else node

    def visit_If(self, node: ast.If) -> ast.AST | None:
        if isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            return None
        return self.generic_visit(node)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> ast.AST | None:
        if node.value is None:
            return None
        return ast.copy_location(ast.Assign(targets=[node.target], value=node.value), node)

    def visit_arg(self, node: ast.arg) -> ast.AST:
        node.annotation = None
        return node

    def _bare(self, node: Any) -> Any:
        node = self.generic_visit(node)
        body = node.body
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            body = body[1:]
        node.body = body or [ast.Pass()]
        return node

    def visit_FunctionDef(self, node: ast.FunctionDef) -> ast.AST:
        node.returns = None
        return self._bare(node)  # type: ignore[no-any-return]

    def visit_ClassDef(self, node: ast.ClassDef) -> ast.AST:
        return self._bare(node)  # type: ignore[no-any-return]

    def visit_Module(self, node: ast.Module) -> ast.AST:
        return self._bare(node)  # type: ignore[no-any-return]


def _main(statement: ast.stmt) -> bool:
    """Whether ``statement`` is an ``if __name__ == "__main__":`` block (not sent: the
    launcher is ``__main__`` where it runs)."""
    return (
        isinstance(statement, ast.If)
        and isinstance(statement.test, ast.Compare)
        and isinstance(statement.test.left, ast.Name)
        and statement.test.left.id == "__name__"
    )


@functools.cache
def launcher_source() -> str:
    """The launcher's code as sent (see :class:`_Plain`)."""
    source = Path(__file__).with_name("remote_launcher.py").read_text()
    tree = ast.fix_missing_locations(_Plain().visit(ast.parse(source)))
    return ast.unparse(tree) + "\n"


class _Control(asyncssh.SSHClientSession[bytes]):
    """The launcher's channel: frames after the sync token on stdout; stderr kept (its
    last few KiB) to say why a launcher did not start."""

    def __init__(self, launcher: _Launcher, sync: bytes) -> None:
        self._launcher = launcher
        self._sync = sync
        self._synced = False
        self._before = bytearray()
        self._frames = FrameReader()
        self.stderr = bytearray()
        self.status: int | None = None

    def data_received(self, data: bytes, datatype: asyncssh.DataType) -> None:
        if datatype == asyncssh.EXTENDED_DATA_STDERR:
            self.stderr += data
            del self.stderr[:-4096]
            return
        if not self._synced:
            self._before += data
            at = self._before.find(self._sync)
            if at < 0:
                del self._before[: -len(self._sync)]
                return
            self._synced = True
            data = bytes(self._before[at + len(self._sync) :])
            self._before.clear()
        try:
            frames = self._frames.feed(data)
        except ValueError:
            self._launcher.lost("the launcher sent a malformed frame")
            return
        for meta, blobs in frames:
            self._launcher.received(meta, blobs)

    def exit_status_received(self, status: int) -> None:
        self.status = status

    def connection_lost(self, exc: Exception | None) -> None:
        self._launcher.lost(_reason(exc) if exc is not None else "the launcher ended")


class _Launcher:
    """The executor's side of one remote launcher."""

    def __init__(self, executor: SSHExecutor, link: _Link) -> None:
        self.executor = executor
        self.link = link
        self.channel: asyncssh.SSHClientChannel[bytes] | None = None
        self.control: _Control | None = None
        self.hello: Meta = {}
        self.greeted = anyio.Event()
        self.gone: str | None = None
        self.pending: dict[int, _Pending] = {}
        self.released = False
        self.sandboxed = False  # its sandbox is built and proven

    @property
    def alive(self) -> bool:
        return self.gone is None and not self.link.dropped

    async def start(self) -> None:
        """Open the channel, send the code, wait for the launcher's hello."""
        assert self.link.conn is not None
        conn = self.link.conn
        sync = secrets.token_bytes(16)
        trailer = f"CMBS_SYNC = {sync.hex()!r}\nif __name__ == '__cmbs__':\n    main()\n"
        code = (launcher_source() + trailer).encode()
        command = _START.format(bootstrap=shlex.quote(_BOOTSTRAP), size=len(code))
        self.channel, session = await self.executor._retrying(
            lambda: conn.create_session(lambda: _Control(self, sync), command, encoding=None)
        )
        assert isinstance(session, _Control)
        self.control = session
        self.channel.write(code)
        with anyio.move_on_after(_START_WAIT):
            await self.greeted.wait()
        if not self.greeted.is_set():
            self.close()
            raise SSHLauncherUnavailable(self._why_not_started("did not answer in time"))
        if self.gone is not None:
            raise SSHLauncherUnavailable(self._why_not_started(self.gone))

    def _why_not_started(self, fallback: str) -> str:
        label = self.executor.target.label
        control = self.control
        said = bytes(control.stderr).decode("utf-8", "replace") if control else ""
        if control is not None and control.status == _NO_PYTHON and "no python3" in said:
            return f"{label} has no python3: the SSH executor's launcher needs it"
        last = said.strip().splitlines()[-1:] or [fallback]
        return f"the launcher could not start on {label}: {last[0]}"

    def received(self, meta: Meta, blobs: list[bytes]) -> None:
        op = meta.get("op")
        if op == "hello":
            self.hello = meta
            self.greeted.set()
            return
        pending = self.pending.get(meta.get("id"))  # type: ignore[arg-type]
        if pending is None:
            return
        if op == "killing":
            pending.acked.set()
        else:
            pending.reply = (meta, blobs)
            pending.done.set()

    def lost(self, why: str) -> None:
        if self.gone is None:
            self.gone = why
        self.greeted.set()
        for pending in self.pending.values():
            pending.acked.set()
            pending.done.set()

    def send(self, meta: Meta, *blobs: bytes) -> _Pending:
        """Send a request; its :class:`_Pending` (registered under a fresh id)."""
        if not self.alive or self.channel is None:
            raise _Lost(self.gone or "the connection dropped")
        pending = _Pending(self.executor._next_id())
        self.pending[pending.ident] = pending
        try:
            self.channel.write(encode(dict(meta, id=pending.ident), *blobs))
        except (asyncssh.Error, OSError) as exc:
            self.lost(_reason(exc))
            raise _Lost(self.gone or "the connection dropped") from None
        return pending

    def forget(self, pending: _Pending) -> None:
        self.pending.pop(pending.ident, None)

    async def request(self, meta: Meta, *blobs: bytes, timeout: float | None = None) -> Meta:
        """Send a request and wait for its reply (``_Lost``, ``_Refused``, ``TimeoutError``)."""
        pending = self.send(meta, *blobs)
        try:
            with anyio.fail_after(timeout):
                await pending.done.wait()
        finally:
            self.forget(pending)
        if pending.reply is None:
            raise _Lost(self.gone or "the connection dropped")
        reply, _ = pending.reply
        if reply.get("op") == "error":
            raise _Refused(str(reply.get("message")))
        return reply

    def close(self) -> None:
        """Close the channel (the launcher then kills what it runs and ends)."""
        self.lost("closed")
        if self.channel is not None:
            self.channel.close()
        if not self.released:
            self.released = True
            self.link.channels -= 1
            if self.link.dedicated:
                self.link.close()


@dataclass
class _Workdir:
    """A workdir this executor holds: what it is, what contains it, its launcher."""

    path: str
    identity: list[int]
    env: CommandEnv | None = None  # what its sandbox is built from (None: not built yet)
    containment: Containment | None = None
    launcher: _Launcher | None = None
    lock: anyio.Lock = field(default_factory=anyio.Lock)
    users: int = 1  # scenarios that prepared it and have not cleaned it up


class SSHExecutor(Closing):
    """Runs commands and writes artifacts on ``target``; see the module docstring.

    ``containments`` lists what may contain commands, in order of preference (by default
    the sandboxes, :data:`SANDBOXES`); :attr:`containment` says what the last prepared
    workdir got (``"unknown"`` before), :meth:`containment_of` what one workdir got.
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
        containments: Sequence[str] = SANDBOXES,
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
        self._links: list[_Link] = []
        self._links_lock: anyio.Lock | None = None
        self._workdirs: dict[str, _Workdir] = {}
        self._ids = 0
        if target.insecure:
            _log.warning("ssh.host_key_check_disabled", host=target.label)

    # -- the executor protocol --------------------------------------------------------
    async def prepare(
        self, workdir: str | None, files: Mapping[str, str], *, env: CommandEnv | None = None
    ) -> str:
        declared = env or CommandEnv()
        self._check_declared(declared)
        if workdir is not None and self._share(workdir, declared):
            await self._seed(workdir, files, made=False)
            return workdir
        launcher = await self._launcher()
        made = workdir is None
        try:
            try:
                opened = await launcher.request(
                    {"op": "open", "workdir": workdir, "make": True}, timeout=_START_WAIT
                )
            except _Refused as exc:
                raise ExecutorError(str(exc)) from None
            if self._share(opened["workdir"], declared):  # held already, by its real path
                launcher.close()
                await self._seed(opened["workdir"], files, made=False)
                return str(opened["workdir"])
            state = _Workdir(opened["workdir"], opened["identity"], declared, launcher=launcher)
            await self._build(state, launcher)
            self._workdirs[state.path] = state
        except BaseException as exc:
            with anyio.CancelScope(shield=True):
                await self._abandon(launcher, remove=made)
            if isinstance(exc, (_Lost, asyncssh.Error, OSError, TimeoutError)):
                why = _reason(exc) if str(exc) else "no answer"
                raise ExecutorError(f"lost {self.target.label} while preparing: {why}") from None
            raise
        await self._seed(state.path, files, made=made)
        return state.path

    def _share(self, workdir: str, env: CommandEnv) -> bool:
        """Whether ``workdir`` is held already, its sandbox alive and built from the same
        declaration: then one more scenario uses it (and its cleanup waits for the last)."""
        state = self._workdirs.get(workdir)
        if state is None or state.launcher is None or not state.launcher.alive:
            return False
        if state.env is not None and _sandbox_of(state.env) != _sandbox_of(env):
            raise ExecutorError(
                f"workdir {workdir} is in use with another sandbox (network, limits, readable)"
            )
        state.users += 1
        return True

    async def _seed(self, workdir: str, files: Mapping[str, str], *, made: bool) -> None:
        """Write a scenario's starting files; a file that cannot be written undoes the
        prepare."""
        for path, content in files.items():
            observation = await self.write_artifact(workdir, path, content)
            if not observation.success:
                with anyio.CancelScope(shield=True):
                    await self.cleanup(workdir, remove=made)
                raise ExecutorError(f"cannot seed scenario file: {observation.error}")

    def containment_of(self, workdir: str) -> Containment:
        state = self._workdirs.get(workdir)
        if state is None or state.containment is None:
            raise ExecutorError(f"workdir {workdir} has no sandbox on {self.target.label} yet")
        return state.containment

    async def cleanup(self, workdir: str, *, remove: bool = True) -> None:
        state = self._workdirs.get(workdir)
        if state is not None and state.users > 1:
            state.users -= 1  # another scenario still uses it
            return
        self._workdirs.pop(workdir, None)
        if state is None and not remove:
            return
        launcher = state.launcher if state is not None else None
        left: str | None = None
        done = False
        try:
            if launcher is not None and launcher.alive:
                try:
                    reply = await launcher.request(
                        {"op": "cleanup", "remove": remove}, timeout=_CLEANUP_WAIT
                    )
                    left, done = reply.get("left"), True
                except TimeoutError:  # unresponsive: kill it and all it ran
                    await self._force_kill(launcher)
                except _Lost:  # it ended, and killed what it ran
                    pass
            if not done and remove:  # with a fresh launcher
                left = await self._remove_with_fresh(workdir, state)
        finally:
            if launcher is not None:
                launcher.close()
        if left:
            raise CleanupFailed(f"workdir {workdir} on {self.target.label}: left {left}")

    async def write_artifact(self, workdir: str, path: str, content: str) -> Observation:
        start = anyio.current_time()
        try:
            relative = confine(path)
            if len(relative.parts) > MAX_DEPTH:
                raise PathRefused(
                    f"artifact path has {len(relative.parts)} components; at most {MAX_DEPTH}"
                )
            launcher = await self._ready(workdir, sandboxed=False)
            reply = await launcher.request(
                {"op": "write", "parts": list(relative.parts)}, content.encode()
            )
        except PathRefused as exc:
            return refused_artifact(path, str(exc))
        except (_Lost, _Refused, asyncssh.Error, OSError) as exc:
            return refused_artifact(path, f"cannot write {path!r}: {_reason(exc)}")
        code, message = reply.get("code"), reply.get("message")
        if code == "ok":
            return Observation(
                kind="artifact",
                path=path,
                success=True,
                duration_s=anyio.current_time() - start,
                **_changes(reply),
            )
        if code == "replaced":
            raise ExecutorError(f"workdir {workdir} was deleted or replaced during the run")
        reason = {
            "link": f"artifact path {path!r} could lead outside the workdir: "
            f"{message!r} is a symbolic link",
            "not-dir": f"cannot write {path!r}: {message!r} is not a directory",
            "symlink": f"artifact path {path!r} is a symbolic link",
        }.get(str(code), f"cannot write {path!r}: {message}")
        return refused_artifact(path, reason)

    async def run_command(
        self, workdir: str, command: str, *, timeout: float | None, env: CommandEnv | None = None
    ) -> Observation:
        return await self._run(workdir, command, command, timeout, env, ())

    async def run_program(
        self,
        workdir: str,
        argv: Sequence[str],
        *,
        timeout: float | None,
        env: CommandEnv | None = None,
        inputs: Sequence[str] = (),
    ) -> Observation:
        said = shlex.join(argv)
        observed = await self._run(workdir, list(argv), said, timeout, env, inputs)
        return observed.model_copy(update={"argv": tuple(argv)})

    async def resolve_program(
        self, workdir: str, name: str, *, env: CommandEnv | None = None
    ) -> Program | None:
        try:
            launcher = await self._ready(workdir, sandboxed=True)
            path = _declared(env).get("PATH")
            reply = await launcher.request({"op": "resolve", "name": name, "path": path})
        except (_Lost, _Refused, asyncssh.Error, OSError) as exc:
            why = _reason(exc)
            raise ExecutorError(f"cannot look for {name} on {self.target.label}: {why}") from None
        found = reply.get("program")
        return Program.model_validate(found) if found else None

    async def _run(
        self,
        workdir: str,
        command: str | list[str],
        said: str,
        timeout: float | None,
        env: CommandEnv | None,
        inputs: Sequence[str],
    ) -> Observation:
        """Run a shell command, or an argument vector; observed as ``said``."""
        start = anyio.current_time()
        try:
            launcher = await self._ready(workdir, sandboxed=True)
            values = _declared(env)
            pending = launcher.send(
                {"op": "run", "command": command, "env": values, "cap": self.output_cap,
                 "drain": self.drain_grace, "inputs": list(inputs)}
            )  # fmt: skip
            pending.inputs = tuple(inputs)
        except (_Lost, _Refused, asyncssh.Error, OSError, TimeoutError) as exc:
            return Observation(
                kind="command",
                command=said,
                success=False,
                error=f"could not start the command on {self.target.label}: {_reason(exc)}",
                duration_s=anyio.current_time() - start,
            )
        timed_out = False
        try:
            with anyio.move_on_after(timeout) as scope:
                await pending.done.wait()
            timed_out = scope.cancelled_caught
        finally:
            with anyio.CancelScope(shield=True):
                if not pending.done.is_set():
                    await self._kill(launcher, pending)
                launcher.forget(pending)
        return self._observation(said, pending, launcher, timed_out, timeout, start)

    # -- life cycle -----------------------------------------------------------------
    async def aclose(self) -> None:
        """Close every launcher (each kills what it runs; workdirs stay) and connection."""
        for state in self._workdirs.values():
            if state.launcher is not None:
                state.launcher.close()
        self._workdirs.clear()
        links, self._links = self._links, []
        for link in links:
            link.close()
        with anyio.move_on_after(5, shield=True):
            for link in links:
                for conn in (link.conn, link.tunnel):
                    if conn is not None:
                        await conn.wait_closed()

    # -- internals ------------------------------------------------------------------
    def _next_id(self) -> int:
        self._ids += 1
        return self._ids

    def _check_declared(self, env: CommandEnv) -> None:
        """Refuse what a remote sandbox cannot honour, before anything runs."""
        if isinstance(env.network, tuple):
            raise ExecutorError(
                "network allow-lists are enforced by the local sandbox only: "
                'over SSH say network: "all" or "none"'
            )
        if env.network == "none" and self.containments == ("session-kill",):
            raise ExecutorError('network: "none" needs a remote sandbox (pidns or bwrap)')

    async def _retrying(self, open_channel: Any) -> Any:
        """``open_channel()``, again after a short back-off while the server refuses it."""
        for attempt in range(self.channel_retries):
            try:
                return await open_channel()
            except asyncssh.ChannelOpenError:
                await anyio.sleep(min(0.01 * 2**attempt, 0.5))
        return await open_channel()

    async def _link(self) -> _Link:
        """A connection with a free channel (a new one if none has); one channel taken.

        Under ``session-kill`` each launcher has a connection of its own: a command
        there may stop the sshd serving it, which must not stall other scenarios.
        """
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            raise ExecutorError(
                "the SSH executor needs the asyncio backend (asyncssh does not run on trio)"
            ) from None
        if self._links_lock is None:
            self._links_lock = anyio.Lock()
        dedicated = "session-kill" in self.containments
        async with self._links_lock:
            for link in list(self._links):
                if link.dropped and link.channels <= 0:
                    link.close()
                    self._links.remove(link)
            for link in self._links:
                if not (link.dropped or link.dedicated) and link.channels < self.max_channels:
                    link.channels += 1
                    return link
            link = _Link(dedicated=dedicated)
            await _connect(self.target, link)
            link.channels = 1
            self._links.append(link)
            return link

    async def _launcher(self) -> _Launcher:
        """A new launcher on the pool."""
        link = await self._link()
        launcher = _Launcher(self, link)
        try:
            await launcher.start()
        except asyncssh.ChannelOpenError as exc:
            launcher.close()
            raise ExecutorError(
                f"cannot open a session on {self.target.label}: {_reason(exc)}"
            ) from None
        except BaseException:
            launcher.close()
            raise
        return launcher

    async def _ready(self, workdir: str, *, sandboxed: bool) -> _Launcher:
        """The workdir's launcher, started again (the workdir checked to be the one held)
        if it is gone, with its sandbox built if ``sandboxed``. A workdir not prepared
        here is adopted as it is, with the default environment's sandbox."""
        state = self._workdirs.setdefault(workdir, _Workdir(workdir, []))
        async with state.lock:
            launcher = state.launcher
            if launcher is None or not launcher.alive:
                if launcher is not None:
                    launcher.close()
                state.launcher = None
                try:
                    launcher, state.identity = await self._reopen(workdir, state.identity)
                except BaseException:
                    if not state.identity:  # adopting it failed: nothing is held
                        self._workdirs.pop(workdir, None)
                    raise
                state.launcher = launcher
            if sandboxed and not launcher.sandboxed:
                state.env = state.env or CommandEnv()
                await self._build(state, launcher)
            return launcher

    async def _reopen(self, workdir: str, identity: list[int]) -> tuple[_Launcher, list[int]]:
        """A new launcher holding ``workdir``, checked to be the one held (``identity``,
        if any); and the workdir's identity."""
        launcher = await self._launcher()
        try:
            opened = await launcher.request(
                {"op": "open", "workdir": workdir, "make": False, "identity": identity or None},
                timeout=_START_WAIT,
            )
        except BaseException as exc:
            launcher.close()
            if isinstance(exc, _Refused):
                raise ExecutorError(str(exc)) from None
            raise
        if opened.get("replaced"):
            launcher.close()
            raise ExecutorError(f"workdir {workdir} was deleted or replaced during the run")
        return launcher, list(opened["identity"])

    async def _build(self, state: _Workdir, launcher: _Launcher) -> None:
        """Build the workdir's sandbox and prove it with the canary: its containment, or
        :class:`SandboxLeak` (not under an explicitly configured ``session-kill``)."""
        env = state.env or CommandEnv()
        limits = env.limits
        try:
            built = await launcher.request(
                {"op": "sandbox", "order": list(self.containments), "network": env.network,
                 "tmp": limits.tmp, "shm": limits.shm, "readable": list(env.readable)},
                timeout=_START_WAIT,
            )  # fmt: skip
        except _Refused as exc:
            raise ExecutorError(
                f"{self.target.label} allows none of the containments "
                f"{', '.join(self.containments)} ({exc})"
            ) from None
        for tried in built.get("tried") or ():
            _log.info("ssh.containment_unavailable", host=self.target.label, tried=tried)
        try:
            canary = await launcher.request({"op": "canary"}, timeout=_START_WAIT)
        except _Refused as exc:
            raise ExecutorError(f"the canary could not run on {self.target.label}: {exc}") from None
        sandbox = str(built["sandbox"])
        checks = tuple(Check(**check) for check in canary.get("checks") or ())
        hello = launcher.hello
        user = str(hello.get("user") or hello.get("uid"))
        if sandbox != "session-kill" and hello.get("uid") == 0:
            user += " (no capabilities)"
        containment = Containment(
            sandbox=sandbox,
            user=user,
            network=str(env.network),
            limits={k: int(v) for k, v in (built.get("limits") or {}).items()},
            canary=checks,
        )
        if containment.leaks and sandbox != "session-kill":
            first = containment.leaks[0]
            raise SandboxLeak(
                f"the {sandbox} sandbox on {self.target.label} leaks: "
                f"{first.name} {first.target} ({first.detail})",
                containment,
            )
        if sandbox == "session-kill":
            _log.warning("ssh.commands_unsandboxed", host=self.target.label)
        state.containment = containment
        launcher.sandboxed = True
        self.containment = sandbox

    async def _abandon(self, launcher: _Launcher, *, remove: bool) -> None:
        """After a failed prepare: stop the launcher (removing a workdir it made)."""
        if launcher.alive:
            with anyio.move_on_after(_CLEANUP_WAIT):
                try:
                    await launcher.request({"op": "cleanup", "remove": remove})
                except (_Lost, _Refused):
                    pass
        launcher.close()

    async def _kill(self, launcher: _Launcher, pending: _Pending) -> None:
        """Kill a command through its launcher; through a fresh connection if the
        launcher does not acknowledge, or does not report the end in time."""
        try:
            ack = launcher.send({"op": "kill", "command": pending.ident, "grace": self.kill_grace})
        except _Lost:
            return  # the launcher is gone: it killed what it ran
        try:
            with anyio.move_on_after(_ACK_WAIT):
                await ack.acked.wait()
            if ack.acked.is_set():
                with anyio.move_on_after(self.kill_grace + _KILL_SLACK):
                    await pending.done.wait()
        finally:
            launcher.forget(ack)
        if not pending.done.is_set() and launcher.gone is None:
            await self._force_kill(launcher)

    async def _force_kill(self, launcher: _Launcher) -> None:
        """KILL an unresponsive launcher and every process below it (its sandbox, the
        commands and what they started), and the sshd under it if stopped, from a
        launcher on a fresh connection."""
        hello = launcher.hello
        roots = [[hello.get("pid"), hello.get("start")]]
        stopped = [[hello.get("ppid"), hello.get("pstart")]]
        link = _Link()
        try:
            with anyio.move_on_after(self.target.connect_timeout + _START_WAIT):
                await _connect(self.target, link)
                link.channels = 1
                fresh = _Launcher(self, link)
                await fresh.start()
                await fresh.request({"op": "sweep", "roots": roots, "stopped": stopped})
                fresh.close()
        except (ExecutorError, _Lost, _Refused, asyncssh.Error, OSError) as exc:
            _log.warning("ssh.kill_failed", host=self.target.label, reason=str(exc))
        finally:
            link.close()
        _log.warning("ssh.launcher_unresponsive", host=self.target.label)
        launcher.lost("unresponsive: killed through a fresh connection")
        launcher.close()

    async def _remove_with_fresh(self, workdir: str, state: _Workdir | None) -> str | None:
        """Remove a workdir whose launcher is gone, with a new launcher (only the
        directory prepared: one that replaced it is left alone)."""
        launcher = await self._launcher()
        try:
            identity = state.identity if state is not None else None
            try:
                opened = await launcher.request(
                    {"op": "open", "workdir": workdir, "make": False, "identity": identity},
                    timeout=_START_WAIT,
                )
            except _Refused:
                return None  # nothing there
            if opened.get("replaced"):
                return None
            reply = await launcher.request({"op": "cleanup", "remove": True}, timeout=_CLEANUP_WAIT)
            return reply.get("left")
        except (_Lost, TimeoutError) as exc:
            return f"{workdir} (the host did not answer: {exc})"
        finally:
            launcher.close()

    def _observation(
        self,
        command: str,
        pending: _Pending,
        launcher: _Launcher,
        timed_out: bool,
        timeout: float | None,
        start: float,
    ) -> Observation:
        reply, blobs = pending.reply if pending.reply is not None else ({}, [])
        code = reply.get("code")
        killed_by = reply.get("signal")
        stdout, stderr = (
            _output(blobs[:2], reply, 0, self.output_cap),
            _output(blobs[2:], reply, 1, self.output_cap),
        )
        if timed_out:
            error: str | None = f"command timed out after {timeout:g} s"
        elif reply.get("op") == "error":
            error = f"could not start the command on {self.target.label}: {reply.get('message')}"
        elif reply.get("op") != "done":
            error = f"connection to {self.target.label} lost during the command"
        elif reply.get("error"):
            error = f"could not start the command on {self.target.label}: {reply['error']}"
        elif killed_by is not None:
            error = f"command killed by signal {_signal_name(int(killed_by))}"
        else:
            error = None
        status = code if isinstance(code, int) else None
        return Observation(
            kind="command",
            command=command,
            success=error is None and status == 0,
            exit_status=status,
            program_found=None if status is None or timed_out else status != 127,
            timed_out=timed_out,
            error=error,
            stdout=stdout,
            stderr=stderr,
            duration_s=anyio.current_time() - start,
            inputs=tuple(
                InputFile.model_validate({"argument": argument, **found})
                for argument, found in zip(pending.inputs, reply.get("inputs") or (), strict=False)
            ),
            **_changes(reply),
        )


def _changes(reply: Meta) -> dict[str, Any]:
    """What the launcher said an action changed in the workdir, as observation fields."""
    changes = reply.get("changes")
    if not isinstance(changes, list):
        return {"changes_complete": False}
    return {
        "changes": tuple(FileChange.model_validate(change) for change in changes),
        "changes_complete": bool(reply.get("complete")),
    }


def _output(blobs: list[bytes], reply: Meta, which: int, cap: int) -> Output:
    """A stream as the launcher kept it (head, tail, total)."""
    buffer = OutputBuffer(cap)
    for blob in blobs:
        buffer.feed(blob)
    totals = reply.get("totals") or [0, 0]
    buffer.total = max(int(totals[which]), buffer.total)
    return buffer.output()


def _sandbox_of(env: CommandEnv) -> tuple[object, ...]:
    """What of a declaration the sandbox is built from (the rest applies per command)."""
    return (env.network, env.limits, env.readable)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name.removeprefix("SIG")
    except ValueError:
        return str(number)


def _declared(env: CommandEnv | None) -> dict[str, str]:
    """What the scenario sets for a remote command: ``pass_env`` from the operator's
    environment here, then ``values`` (the host's own environment is the base)."""
    if env is None:
        return {}
    passed = {name: os.environ[name] for name in env.pass_env if name in os.environ}
    return passed | env.values


def _reason(exc: BaseException | None) -> str:
    """A one-line reason that never carries key material."""
    if exc is None:
        return "closed"
    if isinstance(exc, asyncssh.Error):
        return exc.reason or type(exc).__name__
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__
