"""What a sandbox is: the bubblewrap command line of one scenario's sandbox, the user its
commands run as, the environment they get, and the checks on a workdir.

Inside, the scenario sees the host filesystem read-only; its workdir is the only writable
path; ``/tmp`` and ``/dev/shm`` are private and bounded, with ``HOME`` in ``/tmp``; the
operator's home, the cmbs data directory (signing key, audit database), every path the
operator names, and the other workdirs are out of sight. Its commands run as an
unprivileged user (``nobody`` when cmbs runs as root) with no capabilities, each in a
PID namespace of its own (see :mod:`executors.launcher`). ``network`` is ``"all"`` (the
host's), ``"none"`` (no network, and no Unix socket at all: a host service listening on
one is out of reach too), or an allow-list the launcher and the executor enforce
together (see :mod:`executors.netpolicy`).
"""

from __future__ import annotations

import fnmatch
import functools
import os
import pwd
import secrets
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from .errors import ExecutorError
from .netpolicy import Broker
from .observation import CommandEnv, Limits, Network
from .seccomp import sandbox_filter

__all__ = [
    "ALLOWED_ENV",
    "CGROUP_JOINS",
    "INSTALL_HINT",
    "LAUNCHER",
    "SANDBOX_HOME",
    "SandboxMode",
    "SandboxSpec",
    "SandboxUnavailable",
    "FRESH_UIDS",
    "SandboxUser",
    "TOOL_DIRS",
    "check_readable",
    "check_root",
    "check_workdir",
    "command_env",
    "default_hidden",
    "find_bwrap",
    "sandbox_argv",
    "sandbox_user",
]

SandboxMode = Literal["auto", "bwrap", "none"]

#: Variables a command inherits from the operator's environment (``LC_*`` too).
ALLOWED_ENV = ("PATH", "LANG", "LANGUAGE", "TERM", "TZ")

#: How to get bubblewrap on Debian and Ubuntu.
INSTALL_HINT = "apt-get install bubblewrap"
#: ``HOME`` inside the sandbox: a private directory under its own ``/tmp``.
SANDBOX_HOME = "/tmp/home"
#: The program that runs inside every sandbox.
LAUNCHER = str(Path(__file__).with_name("launcher.py"))

#: What the launcher may do as root inside the sandbox (its commands get none of it):
#: make PID and mount namespaces, become the sandbox user, signal and reap its commands,
#: give ``HOME`` to the sandbox user, set up an allow-listed network, and empty a
#: command's bounding set.
_LAUNCHER_CAPS = (
    "CAP_SYS_ADMIN",
    "CAP_SETUID",
    "CAP_SETGID",
    "CAP_KILL",
    "CAP_CHOWN",
    "CAP_NET_ADMIN",
    "CAP_NET_BIND_SERVICE",
    "CAP_NET_RAW",
    "CAP_SETPCAP",
)

#: Where sockets of host services live; hidden whenever the network is not the host's.
_SOCKET_DIRS = ("/run", "/var/run")

#: Where a command's namespace init finds the control groups it joins (``...0``, ``...1``).
CGROUP_JOINS = "/dev/.cmbs-cgroup-"

#: The system's own places: no workdir root there (it is emptied in each sandbox).
_SYSTEM = ("/bin", "/boot", "/dev", "/etc", "/lib", "/lib32", "/lib64", "/proc", "/run",
           "/sbin", "/sys", "/usr")  # fmt: skip

#: The host's credentials: never ``readable``, whoever declares them.
_CREDENTIALS = (
    "/etc/shadow*",
    "/etc/gshadow*",
    "/etc/sudoers",
    "/etc/sudoers.d/*",
    "/etc/ssh/ssh_host_*key",
    "/etc/ssl/private/*",
)

#: The largest file a scenario may declare ``readable`` (it is copied into the sandbox).
MAX_READABLE = 1 << 20


class SandboxUnavailable(ExecutorError):
    """``sandbox="bwrap"`` was asked for where bubblewrap does not work."""


@dataclass(frozen=True)
class SandboxUser:
    """Who a sandbox's processes run as: a user of their own (see :meth:`fresh`), a user the
    operator names, or, where cmbs does not run as root, the operator."""

    uid: int
    gid: int
    name: str

    @classmethod
    def fresh(cls) -> SandboxUser:
        """A user id of its own, taken at random from a range no host account uses: it owns
        nothing on the host, and shares no per-user kernel state (keyrings, inotify and
        message-queue allowances, process counts) with any other sandbox."""
        uid = FRESH_UIDS.start + secrets.randbelow(len(FRESH_UIDS))
        return cls(uid, uid, "cmbs")

    def __str__(self) -> str:
        return f"{self.name} ({self.uid})"


#: Where fresh users are taken from: far above every account a distribution makes.
FRESH_UIDS = range(2_000_000_000, 2_000_000_000 + (1 << 24))


def sandbox_user(name: str | int | SandboxUser | None = None) -> SandboxUser | None:
    """The fixed user a sandbox's processes run as; ``None`` where each sandbox gets a
    fresh one (:meth:`SandboxUser.fresh`, the default as root). ``ValueError`` for an
    unknown or unusable user.

    Not as root, processes can only run as the operator.
    """
    if isinstance(name, SandboxUser):
        return name
    if os.geteuid() != 0:
        me = pwd.getpwuid(os.geteuid())
        if name not in (None, me.pw_name, me.pw_uid):
            raise ValueError(f"only root can run commands as {name!r}; cmbs runs as {me.pw_name}")
        return SandboxUser(me.pw_uid, me.pw_gid, me.pw_name)
    if name is None:
        return None
    try:
        entry = pwd.getpwuid(name) if isinstance(name, int) else pwd.getpwnam(name)
    except KeyError:
        raise ValueError(f"no such user: {name}") from None
    if entry.pw_uid == 0:
        raise ValueError("commands cannot run as root: name an unprivileged user")
    return SandboxUser(entry.pw_uid, entry.pw_gid, entry.pw_name)


def command_env(
    declared: CommandEnv, *, home: str | None, source: Mapping[str, str] = os.environ
) -> dict[str, str]:
    """The environment a command runs with: allow-list (``PATH`` without its relative
    entries), passed names, declared values."""
    env = {
        name: value
        for name, value in source.items()
        if name in ALLOWED_ENV or name.startswith("LC_") or name in declared.pass_env
    }
    # only absolute entries: an empty or relative one is the workdir, where the agent writes
    absolute = [entry for entry in env.get("PATH", "").split(os.pathsep) if entry.startswith("/")]
    env["PATH"] = os.pathsep.join(absolute) or os.defpath
    if home is not None:
        env["HOME"] = home
    elif "HOME" in source:
        env["HOME"] = source["HOME"]
    env.update(declared.values)
    return env


@functools.cache
def find_bwrap() -> str | None:
    """The bwrap binary if it is installed and can make a sandbox here, else ``None``.

    ``CMBS_BWRAP`` names another binary (or an empty value: none). Probed once per process.
    """
    configured = os.environ.get("CMBS_BWRAP")
    if configured == "":
        return None
    path = shutil.which(configured or "bwrap")
    if path is None:
        return None
    probe = [path, "--ro-bind", "/", "/", "--unshare-pid", "--cap-drop", "ALL", "--", "true"]
    if os.geteuid() != 0:
        probe[1:1] = ["--unshare-user"]
    try:
        done = subprocess.run(probe, capture_output=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return path if done.returncode == 0 else None


def default_hidden() -> tuple[str, ...]:
    """The operator's home and the cmbs data directory (signing key, audit database)."""
    hidden = [os.path.expanduser("~")]
    data = os.environ.get("XDG_DATA_HOME")
    if data:
        hidden.append(os.path.join(data, "cmbs"))
    return tuple(hidden)


@dataclass(frozen=True)
class SandboxSpec:
    """One sandbox: its workdir (real path; ``None`` for none, an agent program's), the
    directory its processes start in (the workdir by default), the root of every workdir
    (hidden, but for this one), what is hidden, what is declared readable, network and
    limits."""

    workdir: str | None
    root: str | None
    user: SandboxUser
    hidden: tuple[str, ...] = ()
    readable: tuple[str, ...] = ()
    network: Network = "all"
    limits: Limits = field(default_factory=Limits)
    cwd: str | None = None

    @property
    def start_in(self) -> str:
        """Where its processes start."""
        return self.cwd or self.workdir or SANDBOX_HOME

    @classmethod
    def of(
        cls,
        workdir: str,
        env: CommandEnv,
        *,
        root: str | None,
        user: SandboxUser,
        hidden: Iterable[str],
    ) -> SandboxSpec:
        return cls(
            workdir=workdir,
            root=root,
            user=user,
            hidden=tuple(hidden),
            readable=env.readable,
            network=env.network,
            limits=env.limits,
        )


@dataclass
class _Argv:
    """A command line and the descriptors it refers to (closed by the caller once passed)."""

    argv: list[str] = field(default_factory=list)
    fds: list[int] = field(default_factory=list)
    #: directories replaced by an empty one (a tmpfs): what is shown in them needs a way in
    emptied: list[str] = field(default_factory=list)

    def add(self, *args: str) -> None:
        self.argv += args

    def empty(self, path: str, *, perms: str = "0755", size: int | None = None) -> None:
        """An empty ``path`` (a tmpfs) with these permissions."""
        if size is not None:
            self.add("--size", str(size))
        self.add("--perms", perms, "--tmpfs", path)
        self.emptied.append(path)

    def show(self, option: str, source: str, path: str, *, perms: str | None = None) -> None:
        """``option source path`` (a bind), with the directories that lead to ``path``
        inside an emptied one made searchable (bwrap would make them 0700)."""
        self._lead_to(path)
        if perms is not None:
            self.add("--perms", perms)
        self.add(option, source, path)

    def reach(self, path: str) -> None:
        """``path`` exists and can be entered: made (empty) where an emptied directory
        would have it missing."""
        if any(Path(path).is_relative_to(base) for base in self.emptied):
            self._lead_to(path)
            self.add("--perms", "0755", "--dir", path)

    def _lead_to(self, path: str) -> None:
        for base in self.emptied:
            if Path(path).is_relative_to(base):
                steps = Path(path).relative_to(base).parts[:-1]
                for depth in range(1, len(steps) + 1):
                    self.add("--perms", "0755", "--dir", str(Path(base, *steps[:depth])))

    def memfd(self, content: bytes) -> str:
        """A descriptor (as an argument) of a memory file holding ``content``."""
        fd = os.memfd_create("cmbs-data", os.MFD_CLOEXEC)
        self.fds.append(fd)
        os.write(fd, content)
        os.lseek(fd, 0, os.SEEK_SET)
        os.set_inheritable(fd, True)
        return str(fd)

    def data(self, content: bytes, dest: str) -> None:
        """``content`` as a read-only, world-readable file at ``dest``."""
        self.show("--ro-bind-data", self.memfd(content), dest, perms="0444")


def sandbox_argv(
    bwrap: str,
    spec: SandboxSpec,
    *,
    control_fd: int,
    info_fd: int,
    broker: Broker | None = None,
    joins: Sequence[str] = (),
) -> _Argv:
    """The bwrap command line that starts the launcher in ``spec``'s sandbox.

    ``hidden`` is looked up on disk now: a key or database created after the executor was
    made is hidden all the same. Readable files are copied in (world-readable: every
    process of the sandbox runs as its one user); a readable directory is mounted back
    read-only, and its own permissions say what the sandbox user may read in it.
    """
    out = _Argv()
    out.add(bwrap, "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc")
    out.empty("/tmp", perms="1777", size=spec.limits.tmp)
    out.empty("/dev/shm", perms="1777", size=spec.limits.shm)
    existing = _existing(spec.hidden)
    present = _outermost(existing)
    tools = _tools_under(present)
    inside_tools = [p for p in existing if any(Path(p).is_relative_to(t) for t in tools)]
    for path in present:
        _hide(out, path)
    for path in tools:  # the interpreter and the tools it runs, shown again...
        out.show("--ro-bind", path, path)
    for path in inside_tools:  # ...but not a secret that lies among them
        _hide(out, path)
    if spec.network != "all":
        for path in _existing(_SOCKET_DIRS):
            out.empty(path)
    if spec.root is not None:  # the other scenarios' workdirs
        out.empty(spec.root)
    _readable(out, spec.readable, hidden=existing)
    if os.geteuid() == 0:
        out.data(_passwd(spec.user), "/etc/passwd")
        group = _group(spec.user)
        if group is not None:
            out.data(group, "/etc/group")
    if broker is not None:  # network by allow-list: its names, resolved (executors/netpolicy.py)
        out.data(broker.policy.hosts_file(), "/etc/hosts")
    for index, procs in enumerate(joins):  # the control groups each command writes itself in
        out.add("--bind", procs, f"{CGROUP_JOINS}{index}")
    if spec.workdir is not None:
        out.show("--bind", spec.workdir, spec.workdir)
    if spec.cwd is not None and spec.cwd != spec.workdir:
        out.reach(spec.cwd)
    out.add("--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try")
    if os.geteuid() != 0:
        out.add("--unshare-user")
    if spec.network != "all":
        out.add("--unshare-net")
    out.add("--seccomp", out.memfd(sandbox_filter(unix_sockets=spec.network != "none")))
    # no --die-with-parent: it ties bwrap to the thread that started it (trio starts
    # processes from worker threads that end when idle); the launcher ends when its
    # control socket closes instead, whatever ended the process that held it
    out.add("--new-session", "--cap-drop", "ALL")
    for cap in _LAUNCHER_CAPS:
        out.add("--cap-add", cap)
    out.add("--clearenv", "--info-fd", str(info_fd))
    out.add("--", os.path.realpath(sys.executable), "-I", "-S", LAUNCHER, str(control_fd))
    return out


def check_readable(path: str, *, hidden: Iterable[str]) -> str:
    """The real path of ``path``, declared readable, or :class:`ExecutorError` if it would
    show a hidden path (the signing key, the audit database, a home) or is one of the
    host's own credentials."""
    real = os.path.realpath(path)
    covered = next((h for h in _existing(hidden) if Path(h).is_relative_to(real)), None)
    if covered is not None:
        raise ExecutorError(f"readable {path}: would show {covered}, which stays hidden")
    if any(fnmatch.fnmatch(real, pattern) for pattern in _CREDENTIALS):
        raise ExecutorError(f"readable {path}: the host's own credentials stay unreadable")
    return real


def _readable(out: _Argv, paths: Iterable[str], *, hidden: Sequence[str]) -> None:
    """Show what is declared readable (see :func:`check_readable`)."""
    for path in paths:
        real = check_readable(path, hidden=hidden)
        closed = _closed_ancestor(real, out.emptied)
        if closed is not None:  # unsearchable to the sandbox's user: shown empty but for it
            if any(Path(tool).is_relative_to(closed) for tool in TOOL_DIRS):
                raise ExecutorError(f"readable {path}: {closed} holds the tools: cannot show it")
            out.empty(closed)
        if os.path.isdir(real):
            out.show("--ro-bind", real, real)
            continue
        try:
            with open(real, "rb") as handle:
                content = handle.read(MAX_READABLE + 1)
        except OSError as exc:
            raise ExecutorError(f"readable {path}: cannot read: {exc.strerror}") from None
        if len(content) > MAX_READABLE:
            raise ExecutorError(f"readable {path}: over {MAX_READABLE} bytes")
        out.data(content, real)


def _closed_ancestor(path: str, emptied: Iterable[str]) -> str | None:
    """The outermost directory on the way to ``path`` that others may not search (so the
    sandbox's user could not reach it), outside what is emptied already; ``None``."""
    for ancestor in reversed(Path(path).parents):
        if any(ancestor.is_relative_to(base) for base in emptied):
            return None
        try:
            if not os.stat(ancestor).st_mode & 0o001:
                return str(ancestor)
        except OSError:
            return None
    return None


def _passwd(user: SandboxUser) -> bytes:
    """``/etc/passwd`` as the sandbox sees it: its user's home is the private ``HOME``
    (ssh looks there, not in ``$HOME``, for its configuration and known hosts), and a
    fresh user has an entry of its own."""
    lines, found = [], False
    for line in Path("/etc/passwd").read_text().splitlines():
        fields = line.split(":")
        if len(fields) == 7 and fields[2] == str(user.uid):
            fields[5], found = SANDBOX_HOME, True
        lines.append(":".join(fields))
    if not found:
        lines.append(f"{user.name}:x:{user.uid}:{user.gid}:cmbs sandbox:{SANDBOX_HOME}:/bin/sh")
    return ("\n".join(lines) + "\n").encode()


def _group(user: SandboxUser) -> bytes | None:
    """``/etc/group`` with the fresh user's group, where the host has none of that id."""
    text = Path("/etc/group").read_text()
    if any(line.split(":")[2:3] == [str(user.gid)] for line in text.splitlines()):
        return None
    return (text.rstrip("\n") + f"\n{user.name}:x:{user.gid}:\n").encode()


def check_workdir(workdir: str, *, hidden: Iterable[str], root: str | None = None) -> None:
    """Refuse a workdir whose writable mount would undo the sandbox: outside ``root``
    (where a root is set), ``/``, a directory holding a hidden path, the shared ``/tmp``,
    or the tools commands run (a changed interpreter would run the agent's code outside
    the sandbox later)."""
    real = os.path.realpath(workdir)
    if root is not None:
        base = os.path.realpath(root)
        if real == base or not Path(real).is_relative_to(base):
            raise ExecutorError(
                f"workdir {real} is outside the workdir root {base}: "
                "name a directory under it (or another --workdir-root)"
            )
    guarded = [*_existing(hidden), tempfile.gettempdir(), *TOOL_DIRS]
    covered = (
        "/" if real == "/" else next((p for p in guarded if Path(p).is_relative_to(real)), None)
    )
    if covered is not None:
        raise ExecutorError(
            f"workdir {real} would let commands change {covered}: "
            "give the scenario a directory of its own"
        )


def check_root(root: str, *, hidden: Iterable[str]) -> None:
    """Refuse a workdir root the sandbox cannot empty: ``/``, or one holding the tools
    commands run or a hidden path (it is replaced by an empty directory in each sandbox)."""
    real = os.path.realpath(root)
    if real == "/" or any(Path(real).is_relative_to(p) for p in _SYSTEM):
        raise ExecutorError(
            f"the workdir root cannot be {real} (a place of the system's): "
            "name a directory for workdirs"
        )
    for path in (*TOOL_DIRS, *_existing(hidden)):
        if Path(path).is_relative_to(real):
            raise ExecutorError(
                f"the workdir root {real} holds {path}, which commands must see or must not: "
                "name a directory of its own"
            )


def _hide(out: _Argv, path: str) -> None:
    if os.path.isdir(path):
        out.empty(path)
    else:
        out.show("--ro-bind", "/dev/null", path)


def _outermost(paths: list[str]) -> list[str]:
    """``paths`` without those inside another of them (hidden with it already)."""
    dirs = [p for p in paths if os.path.isdir(p)]
    return [p for p in paths if not any(p != d and Path(p).is_relative_to(d) for d in dirs)]


def _existing(paths: Iterable[str]) -> list[str]:
    found = []
    for path in paths:
        real = os.path.realpath(path)
        if real != "/" and os.path.exists(real):
            found.append(real)
    return found


#: Python's installation, its venv, and where this package's code lies (a source tree, for
#: an editable install): what the tools a command runs (cmbs-opa, ansible) and the launcher
#: are made of.
TOOL_DIRS = tuple(
    sorted(
        {
            os.path.realpath(path)
            for path in (sys.prefix, sys.base_prefix, sys.exec_prefix, Path(__file__).parent.parent)
        }
    )
)


def _tools_under(hidden: list[str]) -> list[str]:
    """The tools' directories that lie in a hidden place (a home, ``/tmp``): shown again."""
    dirs = ["/tmp", *(d for d in hidden if os.path.isdir(d))]
    return [tool for tool in TOOL_DIRS if any(Path(tool).is_relative_to(d) for d in dirs)]
