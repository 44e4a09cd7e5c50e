"""The SSH executor's remote launcher: one per prepared workdir, on one session channel.

The SSH executor sends this file (annotations stripped, so that Python 3.6 runs it) on the
channel's stdin to ``python3 -I -S``; nothing of it, nor of what it is later told, is in
an argument vector or a command string. It answers in length-prefixed frames on stdout
(:func:`encode`, :class:`FrameReader`), after a sync token the executor chose (whatever a
login shell printed first is skipped). Requests: ``open`` a workdir and hold it by a
descriptor, build the scenario's ``sandbox`` and run its ``canary``, ``run`` a command
with its environment (values travel in frames and reach the command through ``execve``,
never an ``argv``), ``kill`` one, ``write`` an artifact, ``cleanup``, and ``sweep`` (a
fresh launcher ending what an unresponsive one left).

Commands never get the channel's descriptors; their output reaches the executor framed,
so nothing they print forges a reply. The launcher is not dumpable: another process of
its user cannot open its descriptors or memory through ``/proc``.

The sandbox, one per workdir: a mount namespace where everything is read-only but the
workdir and private tmpfs (``/tmp``, with ``HOME=/tmp/home``; ``/dev/shm``; ``/run``,
where sockets such as systemd's and D-Bus's live; the login's ``~/.ssh``), a minimal
``/dev``, IPC and UTS namespaces (and a network one for ``network: none``), and a PID
namespace whose PID 1 is the zygote (:class:`Zygote`). The zygote clones each command
into a PID namespace of its own, nested, so that nothing a command starts outlives it;
the command has no capability and ``no_new_privs``. Made by bubblewrap (``bwrap``: root,
or unprivileged user namespaces) or here (``pidns``: root). A command costs one fork of
the zygote and the ``execve`` of its shell, about what a bare one does.

``session-kill`` is no sandbox (used only where configured): commands run as the login
user, each a session of its own tagged ``CMBS_RUN`` in its environment, the launcher their
subreaper; when one ends, every process of its session or with its tag is killed, and
orphans once no command runs.
"""

from __future__ import annotations

import array
import ctypes
import errno
import fcntl
import heapq
import json
import os
import pwd
import select
import selectors
import signal
import socket
import stat
import struct
import sys
import time
from typing import TYPE_CHECKING, Any

from .snapshot import diff, identify, locate, take  # sent inlined (ssh.launcher_source)

if TYPE_CHECKING:
    from collections.abc import Callable

    Meta = dict[str, Any]

#: Frames: a 4-byte big-endian length, then a JSON line, then the blobs it lists.
FRAME = struct.Struct("!I")
#: The largest frame either side accepts.
MAX_FRAME = 256 << 20
#: How long output is still read after a command ended, by default.
DRAIN = 0.2
#: How long the zygote has to carry out a KILL before the whole sandbox is ended.
ZYGOTE_SLACK = 2.0
#: How long the launcher waits for its commands to die once told to stop.
STOP_GRACE = 5.0
#: Deepest artifact path accepted (components, the file included), as locally.
MAX_DEPTH = 64


def encode(meta: Meta, *blobs: bytes) -> bytes:
    """One frame: ``meta`` (JSON) and ``blobs`` (bytes, their lengths in ``meta``)."""
    if blobs:
        meta = dict(meta)
        meta["blobs"] = [len(blob) for blob in blobs]
    body = json.dumps(meta, separators=(",", ":")).encode() + b"\n" + b"".join(blobs)
    return FRAME.pack(len(body)) + body


class FrameReader:
    """Cuts a byte stream into ``(meta, blobs)`` frames."""

    def __init__(self, limit: int = MAX_FRAME) -> None:
        self._buffer = bytearray()
        self._limit = limit

    def feed(self, data: bytes) -> list[tuple[Meta, list[bytes]]]:
        self._buffer += data
        frames = []
        while len(self._buffer) >= FRAME.size:
            (size,) = FRAME.unpack_from(self._buffer)
            if size > self._limit:
                raise ValueError(f"frame of {size} bytes is over the limit")
            end = FRAME.size + size
            if len(self._buffer) < end:
                break
            body = bytes(self._buffer[FRAME.size : end])
            del self._buffer[:end]
            head, _, rest = body.partition(b"\n")
            meta = json.loads(head.decode())
            if not isinstance(meta, dict):
                raise ValueError("a frame's header is not an object")
            blobs, at = [], 0
            for length in meta.get("blobs", ()):
                blobs.append(rest[at : at + length])
                at += length
            frames.append((meta, blobs))
        return frames


class Capped:
    """The first and last ``cap // 2`` bytes of a stream and its size (as ``OutputBuffer``)."""

    def __init__(self, cap: int) -> None:
        self.half = max(cap // 2, 1)
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0

    def feed(self, data: bytes) -> None:
        self.total += len(data)
        room = self.half - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        if data:
            self.tail += data
            if len(self.tail) > self.half:
                del self.tail[: len(self.tail) - self.half]


# -- the kernel, through libc ---------------------------------------------------------

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_NOATIME, MS_NODIRATIME, MS_BIND = 32, 1024, 2048, 4096
MS_REC, MS_PRIVATE, MS_RELATIME, MS_STRICTATIME = 16384, 1 << 18, 1 << 21, 1 << 24
PR_SET_PDEATHSIG, PR_SET_DUMPABLE = 1, 4
PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS, PR_SET_SECUREBITS = 36, 38, 28
#: SECBIT_NOROOT, SECBIT_KEEP_CAPS_LOCKED, SECBIT_NO_CAP_AMBIENT_RAISE, each locked
SECURE_NO_ROOT = 0x01 | 0x02 | 0x20 | 0x40 | 0x80
NS_GET_USERNS = 0xB701
#: mount_setattr(2) (Linux 5.12), the same number on every architecture
SYS_MOUNT_SETATTR = 442
AT_FDCWD, AT_RECURSIVE, MOUNT_ATTR_RDONLY = -100, 0x8000, 1
#: What a mount's options say, as mount(2) flags (kept when remounting read-only).
MOUNT_FLAGS = {
    "nosuid": MS_NOSUID,
    "nodev": MS_NODEV,
    "noexec": MS_NOEXEC,
    "noatime": MS_NOATIME,
    "nodiratime": MS_NODIRATIME,
    "relatime": MS_RELATIME,
    "strictatime": MS_STRICTATIME,
}
#: Parts of the pidns sandbox's /proc made read-only, as bubblewrap does (sysctls...).
PROC_COVERS = ("sys", "sysrq-trigger", "irq", "bus")
#: Device nodes of a sandbox's /dev.
DEVICES = ("null", "zero", "full", "random", "urandom", "tty")

_libc: Any = None


def libc() -> Any:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.mount.argtypes = [ctypes.c_char_p] * 3 + [ctypes.c_ulong, ctypes.c_char_p]
        _libc.prctl.argtypes = [ctypes.c_int] + [ctypes.c_ulong] * 4
        _libc.syscall.restype = ctypes.c_long
    return _libc


def _check(result: int, what: str) -> None:
    if result != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"{what}: {os.strerror(code)}")


def _path(path: str | None) -> bytes | None:
    return None if path is None else os.fsencode(path)


def mount(source: str | None, target: str, kind: str | None, flags: int, data: str = "") -> None:
    result = libc().mount(_path(source), _path(target), _path(kind), flags, data.encode() or None)
    _check(result, f"mount {target}")


def prctl(option: int, arg: int = 0) -> None:
    _check(libc().prctl(option, arg, 0, 0, 0), f"prctl {option}")


def setns(fd: int, what: str) -> None:
    _check(libc().setns(fd, 0), f"setns {what}")


def unshare(flags: int) -> None:
    _check(libc().unshare(flags), "unshare")


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    ]


def lock_privileges() -> None:
    """What nothing may undo: ``no_new_privs`` (set-uid programs and file capabilities
    raise nothing at ``execve``) and securebits, locked, by which a uid 0 gains nothing
    at ``execve`` either. Inherited by every child."""
    prctl(PR_SET_SECUREBITS, SECURE_NO_ROOT)
    prctl(PR_SET_NO_NEW_PRIVS, 1)


def capability_setter(*keep: int) -> Callable[[], None]:
    """A call setting this process's capabilities to ``keep`` (none: nothing left)."""
    header = _CapHeader(0x20080522, 0)
    data = (_CapData * 2)()
    for cap in keep:
        data[cap // 32].effective |= 1 << (cap % 32)
        data[cap // 32].permitted |= 1 << (cap % 32)
    capset, pointer = libc().capset, ctypes.byref(header)

    def apply() -> None:
        _check(capset(pointer, data), "capset")

    return apply


def start_time(pid: int) -> int | None:
    """When ``pid`` started (clock ticks after boot): with the pid, names one process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            fields = handle.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[19])


def _stat_fields(pid: int) -> list[bytes] | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            return handle.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def _close_all_but(keep: set[int]) -> None:
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd > 2 and fd not in keep:
            try:
                os.close(fd)
            except OSError:
                pass


def _detach_stdio(*, stderr: bool = False) -> None:
    """Let go of the channel (stdin, stdout, and ``stderr`` too): only the launcher
    speaks on it."""
    null = os.open("/dev/null", os.O_RDWR)
    for fd in (0, 1, 2) if stderr else (0, 1):
        os.dup2(null, fd)
    os.close(null)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def read_held(fd: int, into: Capped) -> None:
    """Feed ``into`` what the non-blocking pipe ``fd`` holds now (as executors/pipes.py)."""
    taken = 0
    while taken < 1 << 20:
        try:
            chunk = os.read(fd, 1 << 16)
        except BlockingIOError:
            return
        if not chunk:
            return
        into.feed(chunk)
        taken += len(chunk)


def _one_line(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror if not exc.filename else f"{exc.filename}: {exc.strerror}"
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


# -- sandboxes ----------------------------------------------------------------------


class Plan:
    """What the scenario's sandbox is made of (from the ``sandbox`` request)."""

    def __init__(self, workdir: str, request: Meta, home: str) -> None:
        """``home``: the login's, read-only in the sandbox (commands get HOME=/tmp/home)."""
        self.workdir = workdir
        self.network = request.get("network") or "all"
        self.tmp = request.get("tmp")
        self.shm = request.get("shm")
        self.readable = [p for p in request.get("readable") or () if os.path.isabs(p)]
        keys = os.path.join(home, ".ssh")
        #: the login's ~/.ssh (its private keys log in elsewhere): hidden
        self.keys = keys if home not in ("", "/") and os.path.isdir(keys) else None
        self.resolv = _resolver_dir()


def _resolver_dir() -> str | None:
    """The directory under /run that /etc/resolv.conf leads to (systemd-resolved's, say):
    shown again read-only over the sandbox's empty /run, so that names still resolve."""
    real = os.path.realpath("/etc/resolv.conf")
    if real.startswith("/run/") and os.path.exists(real):
        return os.path.dirname(real)
    return None


def _size(option: int | None) -> str:
    return f",size={option}" if option else ""


class Sandbox:
    """A scenario's sandbox: its zygote, PID 1 of the sandbox's PID namespace (killing
    it ends everything in the sandbox), the process to reap, the zygote's socket."""

    def __init__(self, name: str, process: int, holder: int, sock: socket.socket) -> None:
        self.name = name
        self.process = process
        self.holder = holder
        self.sock = sock


def _spawn(argv: list[str], env: dict[str, str], fds: dict[int, int]) -> int:
    """Fork and exec ``argv`` with ``fds`` (target: source) as its only descriptors."""
    pid = os.fork()
    if pid == 0:
        try:
            signal.set_wakeup_fd(-1)
            for sig in (signal.SIGCHLD, signal.SIGPIPE, signal.SIGXFSZ):
                signal.signal(sig, signal.SIG_DFL)
            moved = {}
            for target, source in fds.items():
                moved[target] = os.dup(source)
            for target, source in moved.items():
                os.dup2(source, target)
            _close_all_but(set(moved))
            prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
            os.execvpe(argv[0], argv, env)
        finally:
            os._exit(127)
    return pid


def which(program: str) -> str | None:
    for directory in os.environ.get("PATH", os.defpath).split(os.pathsep):
        path = os.path.join(directory, program)
        if directory.startswith("/") and os.access(path, os.X_OK) and os.path.isfile(path):
            return path
    return None


#: The zygote's start in a bwrap sandbox: its code arrives on the socket (fd 3).
ZYGOTE_BOOT = (
    "import socket\n"
    "s=socket.fromfd(3,socket.AF_UNIX,socket.SOCK_SEQPACKET)\n"
    "c=s.recv(1<<22)\n"
    "g={'__name__':'__cmbs_zygote__'}\n"
    "exec(compile(c,'cmbs-zygote','exec'),g)\n"
    "g['zygote_main'](s)\n"
)


def _ready(sock: socket.socket, what: str) -> None:
    """Wait for the zygote's ``ready`` (30 s at most); why not, otherwise."""
    sock.settimeout(30)
    try:
        meta, _ = receive_message(sock)
    except OSError as exc:
        raise OSError(errno.ETIMEDOUT, f"{what} did not start: {_one_line(exc)}") from None
    if meta is None or meta.get("op") != "ready":
        raise OSError(errno.EPERM, meta.get("message") if meta else f"{what} failed")
    sock.setblocking(False)


def build_bwrap(plan: Plan, source: Callable[[], bytes]) -> Sandbox:
    """The scenario's sandbox made by bubblewrap, the zygote its PID 1 (with only the
    capabilities it needs to make PID namespaces and drop privileges)."""
    bwrap = which("bwrap")
    if bwrap is None:
        raise OSError(errno.ENOENT, "bwrap is not installed")
    if b"--size" not in _output_of([bwrap, "--help"]):  # before bubblewrap 0.5 (RHEL 9)
        plan.tmp = plan.shm = None  # unlimited, and not reported as limited
    argv = [bwrap, "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc"]
    argv += (["--size", str(plan.tmp)] if plan.tmp else []) + ["--tmpfs", "/tmp"]
    argv += ["--dir", "/tmp/home"]
    argv += (["--size", str(plan.shm)] if plan.shm else []) + ["--tmpfs", "/dev/shm"]
    argv += ["--tmpfs", "/run"]
    if plan.resolv:
        argv += ["--ro-bind", plan.resolv, plan.resolv]
    if plan.keys:
        argv += ["--tmpfs", plan.keys]
    for path in plan.readable:
        argv += ["--ro-bind-try", path, path]
    argv += ["--bind", plan.workdir, plan.workdir, "--chdir", plan.workdir]
    argv += ["--unshare-pid", "--as-pid-1", "--unshare-ipc", "--unshare-uts"]
    argv += ["--unshare-cgroup-try", "--die-with-parent"]
    argv += ["--cap-drop", "ALL", "--cap-add", "CAP_SYS_ADMIN", "--cap-add", "CAP_SETPCAP"]
    if plan.network == "none":
        argv.append("--unshare-net")
    argv += ["--info-fd", "4", "--", sys.executable, "-I", "-S", "-c", ZYGOTE_BOOT]
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    report = _report_file()
    err_r, err_w = os.pipe2(os.O_CLOEXEC)
    null = os.open("/dev/null", os.O_RDWR | os.O_CLOEXEC)
    env = dict(os.environ, HOME="/tmp/home", PWD=plan.workdir)
    fds = {0: null, 1: null, 2: err_w, 3: theirs.fileno(), 4: report}
    pid = _spawn(argv, env, fds)
    for fd in (err_w, null):
        os.close(fd)
    theirs.close()
    holder = None
    try:
        mine.send(source())
        try:
            _ready(mine, "the bwrap sandbox")
        except OSError as exc:
            os.set_blocking(err_r, False)
            try:
                said = os.read(err_r, 4096).decode("utf-8", "replace").strip()
            except OSError:
                said = ""
            raise OSError(exc.errno, said.splitlines()[-1] if said else exc.strerror) from None
        info = os.pread(report, 65536, 0)  # whole: the sandbox runs only after it
        holder = int(json.loads(info.decode())["child-pid"])
    except BaseException:
        mine.close()
        _kill_and_reap(pid)
        raise
    finally:
        os.close(report)
        os.close(err_r)
    return Sandbox("bwrap", pid, holder, mine)


def _report_file() -> int:
    """Where bwrap reports the sandbox's init, before it lets the sandbox go on: a memory
    file, never a pipe (one nobody reads, this process killed) nor a disk (a full one),
    where a failed write kills bwrap and leaves its half-made sandbox for ever."""
    if hasattr(os, "memfd_create"):
        return int(os.memfd_create("cmbs-bwrap-report", os.MFD_CLOEXEC))
    fd = int(libc().memfd_create(b"cmbs-bwrap-report", 1))  # Python 3.6: MFD_CLOEXEC
    if fd < 0:
        raise OSError(ctypes.get_errno(), "memfd_create")
    return fd


def _output_of(argv: list[str]) -> bytes:
    """What ``argv`` prints on stdout (and stderr)."""
    read, write = os.pipe2(os.O_CLOEXEC)
    null = os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC)
    try:
        pid = _spawn(argv, dict(os.environ), {0: null, 1: write, 2: write})
    finally:
        os.close(write)
        os.close(null)
    chunks = []
    try:
        while True:
            chunk = os.read(read, 65536)
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(read)
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass
    return b"".join(chunks)


def _kill_and_reap(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except OSError:
        pass


def build_pidns(plan: Plan, source: Callable[[], bytes]) -> Sandbox:
    """The scenario's sandbox made here (root): a process unshares the namespaces and
    forks the zygote, PID 1 of the new PID namespace, which makes every mount read-only
    but the workdir and private tmpfs."""
    if os.geteuid() != 0:
        raise OSError(errno.EPERM, "needs root")
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    pid = os.fork()
    if pid == 0:
        try:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
            mine.close()
            _close_all_but({theirs.fileno()})
            _detach_stdio()
            flags = CLONE_NEWNS | CLONE_NEWIPC | CLONE_NEWUTS | CLONE_NEWPID
            if plan.network == "none":
                flags |= CLONE_NEWNET
            try:
                unshare(flags)
            except OSError as exc:
                send_message(theirs, {"op": "e", "message": _one_line(exc)})
                os._exit(1)
            zygote = os.fork()
            if zygote == 0:
                try:
                    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
                    _make_pidns_mounts(plan)
                    if plan.network == "none":
                        _loopback_up()
                    os.chdir(plan.workdir)
                except BaseException as exc:
                    send_message(theirs, {"op": "e", "message": _one_line(exc)})
                    os._exit(1)
                env = dict(os.environ, HOME="/tmp/home", PWD=plan.workdir)
                Zygote(theirs, env, plan.workdir).serve()
            os.waitpid(zygote, 0)
        finally:
            os._exit(0)
    theirs.close()
    try:
        _ready(mine, "the pidns sandbox")
    except BaseException:
        mine.close()
        _kill_and_reap(pid)
        raise
    return Sandbox("pidns", pid, pid, mine)


def _make_pidns_mounts(plan: Plan) -> None:
    """In the new mount namespace (root), as PID 1 of the new PID namespace: every mount
    read-only; tmpfs over /tmp, /dev, /dev/shm, /run and ~/.ssh; the workdir (and
    readable paths) bound back; a /proc of this PID namespace (sysctls read-only)."""
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    workdir = os.open(plan.workdir, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    devices = {}
    for name in DEVICES:
        try:
            devices[name] = os.open("/dev/" + name, os.O_PATH | os.O_CLOEXEC)
        except OSError:
            pass
    shown = {}
    for path in plan.readable + ([plan.resolv] if plan.resolv else []):
        try:
            shown[path] = os.open(path, os.O_PATH | os.O_CLOEXEC)
        except OSError:
            pass
    _read_only_everywhere()
    nodev = MS_NOSUID | MS_NODEV
    mount("tmpfs", "/tmp", "tmpfs", nodev, "mode=1777" + _size(plan.tmp))
    os.mkdir("/tmp/home", 0o700)
    mount("tmpfs", "/dev", "tmpfs", MS_NOSUID | MS_NOEXEC, "mode=755")
    for name, fd in devices.items():
        os.close(os.open("/dev/" + name, os.O_CREAT | os.O_WRONLY | os.O_CLOEXEC, 0o666))
        mount(f"/proc/self/fd/{fd}", "/dev/" + name, None, MS_BIND)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0")):
        os.symlink(target, "/dev/" + name)
    os.symlink("/proc/self/fd/1", "/dev/stdout")
    os.symlink("/proc/self/fd/2", "/dev/stderr")
    os.mkdir("/dev/shm", 0o1777)
    mount("tmpfs", "/dev/shm", "tmpfs", nodev, "mode=1777" + _size(plan.shm))
    mount("tmpfs", "/run", "tmpfs", nodev, "mode=755")
    if plan.keys:
        mount("tmpfs", plan.keys, "tmpfs", nodev, "mode=700")
    for path, fd in shown.items():
        _bind(fd, path, read_only=True)
    _bind(workdir, plan.workdir, read_only=False)
    mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    for name in PROC_COVERS:
        path = "/proc/" + name
        if os.path.exists(path):
            mount(path, path, None, MS_BIND | MS_REC)
            mount(None, path, None, MS_REMOUNT | MS_BIND | MS_RDONLY | nodev | MS_NOEXEC)


def _bind(fd: int, path: str, *, read_only: bool) -> None:
    """Mount what ``fd`` opened at ``path`` (made where a tmpfs hides it), then set it
    read-only or writable (no set-uid, no devices)."""
    if not os.path.lexists(path):
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            os.makedirs(path)
        else:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            os.close(os.open(path, os.O_CREAT | os.O_WRONLY | os.O_CLOEXEC, 0o600))
    mount(f"/proc/self/fd/{fd}", path, None, MS_BIND)
    flags = MS_REMOUNT | MS_BIND | MS_NOSUID | MS_NODEV | (MS_RDONLY if read_only else 0)
    mount(None, path, None, flags)


class _MountAttr(ctypes.Structure):
    _fields_ = [
        ("attr_set", ctypes.c_uint64),
        ("attr_clr", ctypes.c_uint64),
        ("propagation", ctypes.c_uint64),
        ("userns_fd", ctypes.c_uint64),
    ]


def _read_only_everywhere() -> None:
    """Every mount of this namespace read-only: one ``mount_setattr`` where the kernel
    has it (5.12), else a read-only remount of each mount point in /proc/self/mountinfo."""
    attr = _MountAttr(MOUNT_ATTR_RDONLY, 0, 0, 0)
    result = libc().syscall(
        SYS_MOUNT_SETATTR,
        ctypes.c_int(AT_FDCWD),
        b"/",
        ctypes.c_uint(AT_RECURSIVE),
        ctypes.byref(attr),
        ctypes.c_size_t(ctypes.sizeof(attr)),
    )
    if result == 0:
        return
    if ctypes.get_errno() not in (errno.ENOSYS, errno.EINVAL):
        _check(-1, "mount_setattr")
    read_only_by_remounting()


def read_only_by_remounting() -> None:
    """Remount each mount point read-only, keeping its other options."""
    with open("/proc/self/mountinfo") as handle:
        lines = handle.read().splitlines()
    for line in lines:
        fields = line.split(" ")
        point = fields[4].encode().decode("unicode_escape").encode("latin-1").decode()
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY
        for option in fields[5].split(","):
            flags |= MOUNT_FLAGS.get(option, 0)
        try:
            mount(None, point, None, flags)
        except OSError as exc:
            if exc.errno not in (errno.ENOENT, errno.EACCES) or os.path.exists(point):
                raise OSError(exc.errno, f"cannot make {point} read-only") from None


def _loopback_up() -> None:
    """``lo`` up in a new network namespace (what a command there may still reach)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        request = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(sock, 0x8913, request))[1]
        fcntl.ioctl(sock, 0x8914, struct.pack("16sH14x", b"lo", flags | 1))


#: What builds each sandbox, from its plan and the launcher's code (for bwrap's zygote).
BUILDERS: dict[str, Callable[[Plan, Callable[[], bytes]], Sandbox]] = {
    "pidns": build_pidns,
    "bwrap": build_bwrap,
}


# -- the canary -----------------------------------------------------------------------

#: Files the login account's sessions run or trust, relative to its home.
START_UP_FILES = (
    ".ssh/rc",
    ".ssh/authorized_keys",
    ".ssh/authorized_keys2",
    ".ssh/environment",
    ".ssh/config",
    ".bashrc",
    ".bash_profile",
    ".bash_login",
    ".bash_logout",
    ".profile",
    ".zshenv",
    ".zshrc",
    ".zprofile",
    ".kshrc",
    ".mkshrc",
    ".cshrc",
    ".tcshrc",
    ".login",
    ".config/fish/config.fish",
)


def canary_targets(home: str, workdir: str) -> Meta:
    """What the canary tries: append to each start-up file there is, create a file in
    each directory sessions or the system read from; the host's view of each."""
    files = []
    for name in START_UP_FILES:
        path = os.path.join(home, name)
        try:
            status = os.stat(path, follow_symlinks=False)
        except OSError:
            continue
        if stat.S_ISREG(status.st_mode):
            files.append([path, status.st_dev, status.st_ino])
    places = [home, os.path.join(home, ".ssh"), os.path.dirname(workdir.rstrip("/")) or "/"]
    places += ["/tmp", "/var/tmp", "/etc", "/etc/profile.d", "/etc/ssh", "/"]
    places += [os.path.dirname(os.path.realpath(sys.executable))]
    seen, dirs = set(), []
    for place in places:
        if place not in seen and os.path.isdir(place):
            seen.add(place)
            dirs.append(place)
    return {"files": files, "dirs": dirs}


def run_canary(targets: Meta, name: str, launcher: int, network: str, touch: bool) -> Meta:
    """Inside a new command's sandbox: try what an escaping command would. Without a
    sandbox (``touch`` false) only ask what could be written: nothing would stop it."""
    results: Meta = {"files": {}, "dirs": {}}
    if not touch:
        for path, _, _ in targets["files"]:
            status = os.stat(path)
            writable = os.access(path, os.W_OK)
            results["files"][path] = (
                [status.st_dev, status.st_ino, "writable"] if writable else [None, None, ""]
            )
        for directory in targets["dirs"]:
            results["dirs"][directory] = "writable" if os.access(directory, os.W_OK) else ""
    for path, _, _ in targets["files"] if touch else ():
        try:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError as exc:
            results["files"][path] = [None, None, exc.strerror]
            continue
        status = os.fstat(fd)
        os.close(fd)
        results["files"][path] = [status.st_dev, status.st_ino, "opened for writing"]
    for directory in targets["dirs"] if touch else ():
        try:
            fd = os.open(os.path.join(directory, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            os.close(fd)
            results["dirs"][directory] = "created"
        except OSError as exc:
            results["dirs"][directory] = exc.strerror
    try:
        os.kill(launcher, 0)
        results["signal"] = f"the launcher (pid {launcher}) could be signalled"
    except OSError as exc:
        results["signal"] = None if exc.errno in (errno.ESRCH, errno.EPERM) else exc.strerror
    with open("/proc/self/status") as handle:
        effective = [line.split()[1] for line in handle if line.startswith("CapEff:")]
    results["capabilities"] = effective[0] if effective else "?"
    if network == "none":
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
                sock.connect(("192.0.2.1", 9))
            results["network"] = "connected to 192.0.2.1:9"
        except OSError as exc:
            results["network"] = None if exc.errno else "refused"
    return results


def judge_canary(targets: Meta, found: Meta, name: str, home: str, network: str) -> list[Meta]:
    """The canary's checks, judged on the host: a file it reached is the host's file, a
    file it created is seen here (then removed)."""
    checks = []

    def shown(path: str) -> str:
        if path == home or path.startswith(home.rstrip("/") + "/"):
            return "~" + path[len(home.rstrip("/")) :]
        return path

    for path, dev, ino in targets["files"]:
        got_dev, got_ino, detail = found["files"].get(path, [None, None, "not tried"])
        held = not (got_dev == dev and got_ino == ino)
        checks.append(
            {
                "name": "append to a start-up file",
                "target": shown(path),
                "held": held,
                "detail": detail,
            }  # fmt: skip
        )
    for directory in targets["dirs"]:
        probe = os.path.join(directory, name)
        reached = os.path.lexists(probe) or found["dirs"].get(directory) == "writable"
        if os.path.lexists(probe):
            try:
                os.unlink(probe)
            except OSError:
                pass
        detail = found["dirs"].get(directory, "not tried")
        if detail == "created" and not reached:
            detail = "created in the sandbox's own copy"
        checks.append(
            {
                "name": "create a file",
                "target": shown(directory),
                "held": not reached,
                "detail": detail,
            }  # fmt: skip
        )
    checks.append(
        {"name": "signal the launcher", "target": "its own process namespace",
         "held": found.get("signal") is None, "detail": found.get("signal") or "no such process"}
    )  # fmt: skip
    effective = found.get("capabilities", "?")
    checks.append(
        {
            "name": "keep capabilities",
            "target": "CapEff",
            "held": effective.strip("0") == "",
            "detail": effective,
        }  # fmt: skip
    )
    if network == "none":
        checks.append(
            {"name": "reach the network", "target": "192.0.2.1:9",
             "held": found.get("network") is None, "detail": found.get("network") or "unreachable"}
        )  # fmt: skip
    return checks


# -- the zygote -----------------------------------------------------------------------

#: clone(2) by architecture: a fork straight into a new PID namespace, what ``os.fork``
#: cannot ask for (s390x takes the stack first, the flags second).
CLONE_SYSCALLS = {
    "x86_64": 56,
    "aarch64": 220,
    "riscv64": 220,
    "ppc64le": 120,
    "ppc64": 120,
    "s390x": 120,
}
#: What the zygote keeps in its bounding set: to make PID namespaces, to drop the rest.
CAP_SETPCAP, CAP_SYS_ADMIN = 8, 21
PR_CAPBSET_READ, PR_CAPBSET_DROP = 23, 24


def cloner() -> Callable[[], int]:
    """A call that forks, the child the PID 1 of a new PID namespace (``os.fork`` cannot
    ask for one). Only for a single-threaded process whose child runs a little code, then
    execs: ``os.fork``'s interpreter hooks do not run; the interpreter lock stays held
    across (through ``PyDLL``), as ``os.fork`` keeps it."""
    machine = os.uname().machine
    number = CLONE_SYSCALLS.get(machine)
    if number is None:
        raise OSError(errno.ENOSYS, "no clone(2) number known for " + machine)
    flags = CLONE_NEWPID | int(signal.SIGCHLD)
    first, second = (0, flags) if machine == "s390x" else (flags, 0)
    syscall = ctypes.PyDLL(None, use_errno=True).syscall
    syscall.restype = ctypes.c_long
    arguments = (number, ctypes.c_ulong(first), ctypes.c_ulong(second), 0, 0, 0)

    def clone() -> int:
        pid = int(syscall(*arguments))
        if pid < 0:
            _check(-1, "clone")
        return pid

    return clone


def send_message(sock: socket.socket, meta: Meta, fds: list[int] | None = None) -> None:
    """One datagram on the launcher-zygote socket, with ``fds`` passed along."""
    data = [json.dumps(meta).encode()]
    if fds:
        rights = array.array("i", fds).tobytes()
        sock.sendmsg(data, [(socket.SOL_SOCKET, socket.SCM_RIGHTS, rights)])
    else:
        sock.sendmsg(data)


def receive_message(sock: socket.socket) -> tuple[Meta | None, list[int]]:
    """The next datagram and the descriptors it carried (``None`` at EOF)."""
    flags = getattr(socket, "MSG_CMSG_CLOEXEC", 0)
    data, ancillary, _, _ = sock.recvmsg(1 << 20, socket.CMSG_SPACE(8 * 4), flags)
    fds: list[int] = []
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            usable = len(payload) - len(payload) % 4
            fds.extend(array.array("i", payload[:usable]))
    if not data:
        for fd in fds:
            os.close(fd)
        return None, []
    return json.loads(data.decode()), fds


def zygote_main(sock: socket.socket) -> None:
    """The zygote exec'd by bwrap: in the workdir, with the environment commands get."""
    Zygote(sock, dict(os.environ), os.getcwd()).serve()


class Zygote:
    """PID 1 of the scenario's sandbox: clones each command into a PID namespace of its
    own (nested, so the sandbox's /proc shows it), where the command's shell is PID 1
    without capabilities and with ``no_new_privs``; reaps, signals and reports on its
    socket. When it ends, the kernel ends everything in the sandbox."""

    def __init__(self, sock: socket.socket, env: dict[str, str], workdir: str) -> None:
        self.sock = sock
        self.env = env
        self.workdir = workdir
        self.children: dict[int, int] = {}  # pid: the request's id
        self.drop_all: Callable[[], None] = lambda: None
        self.clone: Callable[[], int] = lambda: -1
        self.null = -1

    def serve(self) -> None:
        """Run in the zygote's process; never returns."""
        try:
            prctl(PR_SET_DUMPABLE, 0)
            prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
            signal.set_wakeup_fd(-1)
            for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
                signal.signal(sig, signal.SIG_DFL)
            wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
            signal.set_wakeup_fd(wake_w)
            signal.signal(signal.SIGCHLD, lambda *_: None)
            _close_all_but({self.sock.fileno(), wake_r, wake_w})
            _detach_stdio(stderr=True)
            self.sock.setblocking(True)
            self.prepare_to_clone()
            send_message(self.sock, {"op": "ready"})
            while True:
                ready, _, _ = select.select([self.sock.fileno(), wake_r], [], [])
                if wake_r in ready:
                    try:
                        while os.read(wake_r, 4096):
                            pass
                    except OSError:
                        pass
                    self.reap()
                if self.sock.fileno() in ready:
                    meta, fds = receive_message(self.sock)
                    if meta is None:
                        return
                    if meta.get("op") == "kill":
                        self.signal(meta)
                    else:
                        self.spawn(meta, fds)
        except BaseException as exc:
            try:
                send_message(self.sock, {"op": "e", "message": _one_line(exc)})
            except OSError:
                pass
        finally:
            os._exit(0)

    def prepare_to_clone(self) -> None:
        """Do once, here, what every command inherits, so that a command's own setup
        before ``execve`` is a few system calls: the bounding set emptied and this
        process's capabilities reduced to what it uses (making PID namespaces), the
        privileges locked, default SIGPIPE, /dev/null open, the workdir its directory."""
        with open("/proc/sys/kernel/cap_last_cap") as handle:
            last = int(handle.read())
        for cap in range(last + 1):
            if cap != CAP_SYS_ADMIN and libc().prctl(PR_CAPBSET_READ, cap, 0, 0, 0) == 1:
                prctl(PR_CAPBSET_DROP, cap)  # CAP_SETPCAP too: it stays effective a moment
        lock_privileges()
        capability_setter(CAP_SYS_ADMIN)()
        self.drop_all = capability_setter()
        self.clone = cloner()
        self.null = os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC)
        for sig in (signal.SIGPIPE, signal.SIGXFSZ):
            signal.signal(sig, signal.SIG_DFL)
        os.chdir(self.workdir)

    def signal(self, meta: Meta) -> None:
        """Signal a command: its process group (TERM), or its PID 1 (KILL: the kernel
        ends its namespace)."""
        ident = int(meta.get("id") or 0)
        for pid, owner in self.children.items():
            if owner == ident:
                try:
                    if meta.get("group"):
                        os.killpg(pid, int(meta["signal"]))
                    else:
                        os.kill(pid, int(meta["signal"]))
                except OSError:
                    pass

    def spawn(self, meta: Meta, fds: list[int]) -> None:
        ident = meta.get("id")
        try:
            if len(fds) != 2:
                raise OSError(errno.EBADF, "the command's pipes did not arrive")
            env = dict(self.env, **(meta.get("env") or {}))
            pid = self.clone()
        except OSError as exc:
            for fd in fds:
                os.close(fd)
            send_message(self.sock, {"op": "e", "id": ident, "message": _one_line(exc)})
            send_message(self.sock, {"op": "x", "id": ident, "code": 126})
            return
        if pid == 0:
            try:
                self.become(meta, env, fds[0], fds[1])
            except BaseException as exc:
                try:
                    send_message(self.sock, {"op": "e", "id": ident, "message": _one_line(exc)})
                finally:
                    os._exit(126)
        for fd in fds:
            os.close(fd)
        self.children[pid] = int(ident or 0)

    def become(self, meta: Meta, env: dict[str, str], out_w: int, err_w: int) -> None:
        """As PID 1 of the new namespace: a session of its own, dying with the zygote,
        no capability left; then the command (or the canary)."""
        os.setsid()
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        self.drop_all()
        os.dup2(self.null, 0)
        os.dup2(out_w, 1)  # the pipes came close-on-exec: only these copies stay
        os.dup2(err_w, 2)
        canary = meta.get("canary")
        if canary is not None:
            found = run_canary(canary["targets"], canary["name"], canary["launcher"],
                               canary["network"], canary["touch"])  # fmt: skip
            _write_all(1, json.dumps(found).encode())
            os._exit(0)
        become_command(meta.get("command"), env)

    def reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            ident = self.children.pop(pid, None)
            if ident is None:
                continue
            if os.WIFSIGNALED(status):
                send_message(self.sock, {"op": "s", "id": ident, "signal": os.WTERMSIG(status)})
            else:
                send_message(self.sock, {"op": "x", "id": ident, "code": os.WEXITSTATUS(status)})


def exec_command(
    workdir: str,
    command: str | list[str] | None,
    env: dict[str, str],
    run: Callable[[], None] | None,
    out_w: int,
    err_w: int,
) -> None:
    """Become the command: in the workdir, stdin /dev/null, output to the pipes."""
    devnull = os.open("/dev/null", os.O_RDONLY)
    os.chdir(workdir)
    os.dup2(devnull, 0)
    os.dup2(out_w, 1)
    os.dup2(err_w, 2)
    for fd in (out_w, err_w, devnull):
        os.close(fd)
    for sig in (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGINT, signal.SIGQUIT, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    if run is not None:
        run()
        os._exit(0)
    assert command is not None
    become_command(command, env)


def become_command(command: Any, env: dict[str, str]) -> None:
    """Execute ``command``: a list as the argument vector it is, a string by ``sh -c``."""
    if isinstance(command, list):
        os.execve(str(command[0]), [str(arg) for arg in command], env)
    os.execve("/bin/sh", ["sh", "-c", str(command)], env)


class Command:
    """One command (or the canary): its process, output and how it ended."""

    def __init__(self, ident: int, cap: int) -> None:
        self.ident = ident
        self.pid: int | None = None  # the command's shell (PID 1 of its namespace)
        self.out = Capped(cap)
        self.err = Capped(cap)
        self.streams: dict[int, Capped] = {}
        self.code: int | None = None
        self.signal: int | None = None
        self.error: str | None = None
        self.ended = False
        self.drain_until: float | None = None
        self.finished = False
        self.tag = ""
        self.drain = DRAIN
        self.on_done: Callable[[Command], None] | None = None


class Launcher:
    """Serves one executor's requests on stdin/stdout until EOF or ``cleanup``."""

    def __init__(self, sync: bytes) -> None:
        self.sync = sync
        self.selector = selectors.DefaultSelector()
        self.reader = FrameReader()
        self.commands: dict[int, Command] = {}
        self.by_pid: dict[int, Command] = {}  # session-kill: the commands forked here
        self.timers: list[tuple[float, int, Callable[[], None]]] = []
        self.timer_count = 0
        self.stopping = False
        self.cleaning: Meta | None = None
        self.sandbox: Sandbox | None = None
        self.zygote_sock: socket.socket | None = None
        self.outbox: list[tuple[Meta, list[int]]] = []  # for the zygote, once it has room
        self.plan: Plan | None = None
        self.mode: str | None = None
        self.workdir: str | None = None
        self.tree: dict[str, Any] | None = None  # the workdir as the last action left it
        self.workdir_fd: int | None = None
        self.identity: tuple[int, int] | None = None
        self.home = os.environ.get("HOME") or pwd.getpwuid(os.getuid()).pw_dir
        self.env = {k: v for k, v in os.environ.items() if k != "SSH_AUTH_SOCK"}
        os.environ.pop("SSH_AUTH_SOCK", None)

    @property
    def source(self) -> bytes:
        """This launcher's code (what a bwrap sandbox's zygote runs)."""
        source = globals().get("CMBS_SOURCE")
        if source is None:  # run as a file
            with open(globals().get("__file__") or "/nonexistent", "rb") as handle:
                source = handle.read()
        return bytes(source)

    # -- the loop
    def serve(self) -> None:
        prctl(PR_SET_DUMPABLE, 0)
        prctl(PR_SET_CHILD_SUBREAPER, 1)
        wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        for sig in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, lambda *_: self.stop())
        os.set_blocking(0, True)
        self.selector.register(0, selectors.EVENT_READ, self.on_request)
        self.selector.register(wake_r, selectors.EVENT_READ, self.on_wake)
        user = pwd.getpwuid(os.geteuid()).pw_name if _has_user(os.geteuid()) else None
        ppid = os.getppid()
        hello = {
            "op": "hello",
            "pid": os.getpid(),
            "start": start_time(os.getpid()),
            "ppid": ppid,
            "pstart": start_time(ppid),
            "uid": os.geteuid(),
            "user": os.environ.get("USER") or user,
            "home": self.home,
            "python": ".".join(str(part) for part in sys.version_info[:2]),
        }
        _write_all(1, self.sync + encode(hello))
        stop_by = None
        while not self.stopping or self.commands:
            if self.stopping:
                if stop_by is None:
                    stop_by = time.monotonic() + STOP_GRACE
                    for command in list(self.commands.values()):
                        self.hard_kill(command)
                    self.later(STOP_GRACE, lambda: None)
                if time.monotonic() > stop_by:
                    break
            timeout = None
            if self.timers:
                timeout = max(self.timers[0][0] - time.monotonic(), 0)
            for key, _ in self.selector.select(timeout):
                key.data(key.fd)
            now = time.monotonic()
            while self.timers and self.timers[0][0] <= now:
                heapq.heappop(self.timers)[2]()
            for command in list(self.commands.values()):
                self.maybe_done(command)
            if self.cleaning is not None and not self.commands:
                self.finish_cleanup()
        self.shut_down()

    def later(self, delay: float, action: Callable[[], None]) -> None:
        self.timer_count += 1
        heapq.heappush(self.timers, (time.monotonic() + delay, self.timer_count, action))

    def send(self, meta: Meta, *blobs: bytes) -> None:
        try:
            _write_all(1, encode(meta, *blobs))
        except OSError:  # the channel is gone: end what runs
            self.stop()

    def stop(self) -> None:
        self.stopping = True

    def on_request(self, fd: int) -> None:
        try:
            data = os.read(0, 1 << 16)
        except OSError:
            data = b""
        if not data:
            self.selector.unregister(0)
            self.stop()
            return
        for meta, blobs in self.reader.feed(data):
            ident = meta.get("id")
            try:
                getattr(self, "op_" + str(meta.get("op")))(meta, blobs)
            except Exception as exc:
                self.send({"op": "error", "id": ident, "message": _one_line(exc)})

    def on_wake(self, fd: int) -> None:
        try:
            while os.read(fd, 4096):
                pass
        except OSError:
            pass
        self.reap()

    def reap(self) -> None:
        """Reap children: session-kill commands, orphans re-parented here, the sandbox's
        process (gone: the sandbox takes no more commands)."""
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if self.sandbox is not None and pid == self.sandbox.process:
                self.sandbox_lost()
                continue
            command = self.by_pid.pop(pid, None)
            if command is None:
                continue
            if os.WIFSIGNALED(status):
                command.signal = os.WTERMSIG(status)
            else:
                command.code = os.WEXITSTATUS(status)
            self.sweep_command(command)
            self.ended(command)

    def ended(self, command: Command) -> None:
        """The command's shell ended: its output is read for ``drain`` more at most
        (what it left, where nothing else ends it, may hold its pipes)."""
        command.ended = True
        command.drain_until = time.monotonic() + command.drain
        self.later(command.drain, lambda: None)

    def sandbox_lost(self) -> None:
        """The sandbox (its zygote) is gone: every command in it died with it."""
        for command in self.commands.values():
            if not command.ended and not command.tag:
                command.signal = command.signal or int(signal.SIGKILL)
                self.ended(command)
        self.stop_sandbox()

    def maybe_done(self, command: Command) -> None:
        if command.finished or not command.ended:
            return
        if command.streams and time.monotonic() < (command.drain_until or 0):
            return
        for fd in list(command.streams):  # what it holds still, however late this runs
            read_held(fd, command.streams[fd])
            self.close_stream(command, fd)
        command.finished = True
        del self.commands[command.ident]
        if command.on_done is not None:
            command.on_done(command)
        if self.mode == "session-kill" and not self.commands:
            self.kill_orphans()

    def close_stream(self, command: Command, fd: int) -> None:
        if fd in command.streams:
            del command.streams[fd]
            self.selector.unregister(fd)
            os.close(fd)

    def on_output(self, command: Command, fd: int) -> None:
        try:
            data = os.read(fd, 1 << 16)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if data:
            command.streams[fd].feed(data)
        else:
            self.close_stream(command, fd)

    def on_zygote(self, fd: int) -> None:
        """The zygote's reports: ``x``/``s`` (how a command ended), ``e`` (why it could
        not start)."""
        assert self.zygote_sock is not None
        if self.outbox:
            self.flush_zygote()
        try:
            meta, fds = receive_message(self.zygote_sock)
        except BlockingIOError:
            return
        except OSError:
            meta, fds = None, []
        for extra in fds:
            os.close(extra)
        if meta is None:
            self.sandbox_lost()
            return
        command = self.commands.get(int(meta.get("id") or 0))
        if command is None or command.ended:
            return
        op = meta.get("op")
        if op == "x":
            command.code = int(meta["code"])
            self.ended(command)
        elif op == "s":
            command.signal = int(meta["signal"])
            self.ended(command)
        elif op == "e":
            command.error = str(meta.get("message"))

    # -- requests
    def op_open(self, meta: Meta, blobs: list[bytes]) -> None:
        """Create (``make``) or adopt the workdir and hold it; refuse, before making
        anything, one that would let commands change what the login's sessions run."""
        ident, path = meta.get("id"), meta.get("workdir")
        if path is not None:
            guarded = _guarded_by(os.path.realpath(path), self.home)
            if guarded is not None:
                self.send(
                    {"op": "error", "id": ident,
                     "message": f"workdir {os.path.realpath(path)} would let commands change "
                                f"{guarded}: give the scenario a directory of its own"}
                )  # fmt: skip
                return
        try:
            if path is None:
                import tempfile

                path = tempfile.mkdtemp(prefix="cmbs-", dir="/tmp")
            elif meta.get("make"):
                os.makedirs(path, exist_ok=True)
            real = os.path.realpath(path)
            fd = os.open(real, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            verb = "create" if meta.get("make") else "open"
            self.send(
                {"op": "error", "id": ident,
                 "message": f"cannot {verb} workdir {path or ''}: {exc.strerror}"}
            )  # fmt: skip
            return
        status = os.fstat(fd)
        identity = (status.st_dev, status.st_ino)
        expected = meta.get("identity")
        if expected is not None and list(identity) != list(expected):
            os.close(fd)
            self.send({"op": "opened", "id": ident, "replaced": True})
            return
        self.workdir, self.workdir_fd, self.identity = real, fd, identity
        self.tree = take(real)
        self.send({"op": "opened", "id": ident, "workdir": real, "identity": list(identity)})

    def op_sandbox(self, meta: Meta, blobs: list[bytes]) -> None:
        """Build the scenario's sandbox, the first of ``order`` that this host allows
        (``session-kill``: none)."""
        assert self.workdir is not None, "no workdir is open"
        plan = Plan(self.workdir, meta, self.home)
        tried = []
        for name in meta.get("order") or ():
            if name == "session-kill":
                self.mode, self.plan = name, plan
                break
            try:
                self.sandbox = BUILDERS[name](plan, lambda: self.source)
                self.zygote_sock = self.sandbox.sock
                self.selector.register(
                    self.zygote_sock.fileno(), selectors.EVENT_READ, self.on_zygote
                )
            except (OSError, KeyError) as exc:
                self.stop_sandbox()
                tried.append(f"{name}: {_one_line(exc)}")
                continue
            self.mode, self.plan = name, plan
            break
        if self.mode is None:
            self.send({"op": "error", "id": meta.get("id"), "message": "; ".join(tried)})
            return
        limits = {}
        if self.mode != "session-kill":
            limits = {k: v for k, v in (("tmp", plan.tmp), ("shm", plan.shm)) if v}
        self.send(
            {"op": "sandboxed", "id": meta.get("id"), "sandbox": self.mode,
             "limits": limits, "tried": tried}
        )  # fmt: skip

    def to_zygote(self, meta: Meta, fds: list[int]) -> None:
        """Queue a request for the zygote (its descriptors closed here once sent)."""
        self.outbox.append((meta, fds))
        self.flush_zygote()

    def flush_zygote(self) -> None:
        sock = self.zygote_sock
        while self.outbox and sock is not None:
            meta, fds = self.outbox[0]
            try:
                send_message(sock, meta, fds)
            except BlockingIOError:
                break
            self.outbox.pop(0)
            for fd in fds:
                os.close(fd)
        if sock is not None:
            events = selectors.EVENT_READ | (selectors.EVENT_WRITE if self.outbox else 0)
            self.selector.modify(sock.fileno(), events, self.on_zygote)

    def op_canary(self, meta: Meta, blobs: list[bytes]) -> None:
        """Run the canary in a new command's sandbox; judge what it reached on the host."""
        assert self.workdir is not None and self.mode is not None and self.plan is not None
        name = f".cmbs-canary-{os.urandom(8).hex()}"
        targets = canary_targets(self.home, self.workdir)
        network = self.plan.network
        ident = meta.get("id")
        canary = {"targets": targets, "name": name, "launcher": os.getpid(), "network": network,
                  "touch": self.mode != "session-kill"}  # fmt: skip

        def judged(command: Command) -> None:
            try:
                found = json.loads(bytes(command.out.head + command.out.tail).decode())
            except ValueError:
                why = command.error or bytes(command.err.head).decode("utf-8", "replace")
                self.send({"op": "error", "id": ident, "message": "the canary failed: " + why})
                return
            checks = judge_canary(targets, found, name, self.home, network)
            self.send({"op": "canary", "id": ident, "checks": checks})

        self.start(int(ident or 0), None, {}, 1 << 20, on_done=judged, canary=canary)

    def op_run(self, meta: Meta, blobs: list[bytes]) -> None:
        """Run a command (a string, by ``sh -c``) or a program (an argument vector, its
        ``inputs`` identified first); its end says what it changed in the workdir."""
        ident = int(meta["id"])
        env = dict(meta.get("env") or {})  # on top of the host's (the zygote has it)
        if self.mode == "session-kill":
            env = dict(self.env, PWD=self.workdir or "/", **env)
        command = meta["command"]
        if not isinstance(command, list):
            command = str(command)
        inputs = [identify(self.workdir or "/", str(arg)) for arg in meta.get("inputs") or []]

        def done(command: Command) -> None:
            changes, complete = self.changes()
            self.send(
                {"op": "done", "id": command.ident, "code": command.code,
                 "signal": command.signal, "error": command.error,
                 "totals": [command.out.total, command.err.total], "inputs": inputs,
                 "changes": changes, "complete": complete},
                bytes(command.out.head), bytes(command.out.tail),
                bytes(command.err.head), bytes(command.err.tail),
            )  # fmt: skip

        self.start(ident, command, env, int(meta.get("cap") or 65536), on_done=done)
        self.commands[ident].drain = float(meta.get("drain", DRAIN))

    def op_kill(self, meta: Meta, blobs: list[bytes]) -> None:
        """TERM to the command's process group, KILL to all of it after ``grace``."""
        command = self.commands.get(int(meta["command"]))
        self.send({"op": "killing", "id": meta.get("id")})
        if command is None or command.ended:
            return
        if self.mode == "session-kill":
            try:
                if command.pid:
                    os.killpg(command.pid, signal.SIGTERM)
            except OSError:
                pass
        else:
            self.to_zygote({"op": "kill", "id": command.ident, "signal": 15, "group": True}, [])
        self.later(float(meta.get("grace") or 0), lambda: self.hard_kill(command))

    def hard_kill(self, command: Command) -> None:
        """KILL the command: its namespace's PID 1, through the zygote (the kernel ends the
        rest), or under session-kill everything of its session, group or tag."""
        if command.ended:
            return
        if self.mode == "session-kill":
            self.sweep_command(command)
        else:
            self.to_zygote({"op": "kill", "id": command.ident, "signal": 9}, [])
            self.later(ZYGOTE_SLACK, lambda: self.zygote_stuck(command))

    def zygote_stuck(self, command: Command) -> None:
        """A KILL the zygote did not carry out: end the whole sandbox."""
        if not command.ended and self.sandbox is not None:
            self.stop_sandbox()
            self.sandbox_lost()

    def op_write(self, meta: Meta, blobs: list[bytes]) -> None:
        code, message = self.write(meta.get("parts") or [], blobs[0] if blobs else b"")
        changes, complete = self.changes()
        self.send({"op": "wrote", "id": meta.get("id"), "code": code, "message": message,
                   "changes": changes, "complete": complete})  # fmt: skip

    def op_resolve(self, meta: Meta, blobs: list[bytes]) -> None:
        """A program as the commands find it on ``path``, outside what they can write."""
        writable = [self.workdir or "/", "/tmp", "/var/tmp", "/dev/shm", "/run"]
        owner = None
        if self.mode == "session-kill":  # commands run as this login, unsandboxed
            writable.append(self.home)
            owner = os.getuid()
        search = str(meta.get("path") or self.env.get("PATH") or os.defpath)
        found = locate(str(meta.get("name")), search, writable, owner)
        self.send({"op": "resolved", "id": meta.get("id"), "program": found})

    def changes(self) -> tuple[list[Meta], bool]:
        """What changed in the workdir since the last time this was asked."""
        before = self.tree if self.tree is not None else {}
        self.tree = take(self.workdir or "/", before)
        return diff(before, self.tree), "" not in before and "" not in self.tree

    def op_cleanup(self, meta: Meta, blobs: list[bytes]) -> None:
        """Kill every command; once they are gone (or after a grace) stop the sandbox,
        remove the workdir if asked, answer, and end."""
        self.cleaning = meta
        for command in list(self.commands.values()):
            self.hard_kill(command)
        self.later(STOP_GRACE, self.finish_cleanup)

    def finish_cleanup(self) -> None:
        if self.cleaning is None:
            return
        meta, self.cleaning = self.cleaning, None
        if self.mode == "session-kill":
            self.kill_orphans()
        self.stop_sandbox()
        left = None
        if meta.get("remove") and self.workdir_fd is not None and self.workdir is not None:
            left = remove_workdir(self.workdir, self.workdir_fd, self.identity)
        self.send({"op": "cleaned", "id": meta.get("id"), "left": left})
        self.stop()

    def op_sweep(self, meta: Meta, blobs: list[bytes]) -> None:
        """From a fresh launcher: KILL each process named (pid and start time, so that a
        reused pid is spared) with everything below it, and a stopped sshd named."""
        killed = 0
        for pid, started in meta.get("roots") or ():
            if pid and pid != os.getpid() and start_time(pid) == started:
                killed += sweep(_descending_from(int(pid)))
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed += 1
                except OSError:
                    pass
        for pid, started in meta.get("stopped") or ():
            fields = _stat_fields(pid)
            if fields and fields[0] in (b"T", b"t") and start_time(pid) == started:
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed += 1
                except OSError:
                    pass
        self.send({"op": "swept", "id": meta.get("id"), "killed": killed})

    # -- commands
    def start(
        self,
        ident: int,
        command: str | None,
        env: dict[str, str],
        cap: int,
        *,
        on_done: Callable[[Command], None],
        canary: Meta | None = None,
    ) -> None:
        """Start a command: through the zygote, or (session-kill) forked here as a
        session of its own."""
        if self.workdir is None or self.mode is None:
            raise RuntimeError("the sandbox is not built")
        if self.cleaning is not None or self.stopping:
            raise RuntimeError("the workdir is being cleaned up")
        if self.mode != "session-kill" and self.zygote_sock is None:
            raise RuntimeError("the sandbox is gone (its holder died)")
        job = Command(ident, cap)
        job.on_done = on_done
        out_r, out_w = os.pipe2(os.O_CLOEXEC)
        err_r, err_w = os.pipe2(os.O_CLOEXEC)
        try:
            if self.mode == "session-kill":
                job.tag = f"{os.getpid()}-{ident}-{os.urandom(6).hex()}"
                pid = os.fork()
                if pid == 0:
                    try:
                        self.session_child(
                            command, dict(env, CMBS_RUN=job.tag), canary, out_w, err_w
                        )
                    finally:
                        os._exit(126)
                job.pid = pid
                self.by_pid[pid] = job
            else:
                request = {"op": "run", "id": ident, "command": command, "env": env,
                           "canary": canary}  # fmt: skip
                self.to_zygote(request, [out_w, err_w])
                out_w = err_w = -1  # sent, or closed, with the request
        except BaseException:
            for fd in (out_r, err_r):
                os.close(fd)
            raise
        finally:
            for fd in (out_w, err_w):
                if fd >= 0:
                    os.close(fd)
        self.commands[ident] = job
        for fd, stream in ((out_r, job.out), (err_r, job.err)):
            os.set_blocking(fd, False)
            job.streams[fd] = stream
            self.selector.register(fd, selectors.EVENT_READ, lambda f, j=job: self.on_output(j, f))

    def session_child(
        self, command: str | None, env: dict[str, str], canary: Meta | None, out_w: int, err_w: int
    ) -> None:
        """session-kill: the command itself, a session of its own, dying with the launcher."""
        signal.set_wakeup_fd(-1)
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        _close_all_but({out_w, err_w})
        os.setsid()
        run = None
        if canary is not None:
            spec = dict(canary)

            def run() -> None:
                found = run_canary(
                    spec["targets"], spec["name"], spec["launcher"], spec["network"], spec["touch"]
                )
                _write_all(1, json.dumps(found).encode())

        exec_command(self.workdir or "/", command, env, run, out_w, err_w)

    def sweep_command(self, command: Command) -> None:
        """session-kill: KILL everything of the command's session or group, or tagged."""
        sid = command.pid or -1
        sweep(lambda pid, fields: _in_session(fields, sid) or _tagged(pid, command.tag))

    def kill_orphans(self) -> None:
        """session-kill, no command running: KILL every process left re-parented here."""
        me = os.getpid()
        sweep(lambda pid, fields: int(fields[1]) == me and pid not in self.by_pid)

    def stop_sandbox(self) -> None:
        """End the sandbox: KILL its PID 1 (the kernel ends every command in it)."""
        if self.zygote_sock is not None:
            try:
                self.selector.unregister(self.zygote_sock.fileno())
            except (KeyError, ValueError):
                pass
            self.zygote_sock.close()
            self.zygote_sock = None
        for _, fds in self.outbox:
            for fd in fds:
                os.close(fd)
        self.outbox = []
        sandbox, self.sandbox = self.sandbox, None
        if sandbox is not None:
            try:
                os.kill(sandbox.holder, signal.SIGKILL)
            except OSError:
                pass
            _kill_and_reap(sandbox.process)

    def shut_down(self) -> None:
        for command in list(self.commands.values()):
            self.hard_kill(command)
        if self.mode == "session-kill":
            self.kill_orphans()
        self.stop_sandbox()

    # -- artifacts
    def write(self, parts: list[str], content: bytes) -> tuple[str, str | None]:
        """Write ``content`` at ``parts`` under the held workdir, never through a link."""
        if self.workdir is None or self.workdir_fd is None:
            return "replaced", None
        try:
            status = os.stat(self.workdir, follow_symlinks=False)
            same = (status.st_dev, status.st_ino) == self.identity
        except OSError:
            same = False
        if not same:
            return "replaced", None
        if (
            not parts
            or len(parts) > MAX_DEPTH
            or any(not p or p in (".", "..") or "/" in p or "\0" in p for p in parts)
        ):
            return "refused", f"artifact path is not a relative path of at most {MAX_DEPTH} parts"
        parent = self.workdir_fd
        try:
            for depth, name in enumerate(parts[:-1], start=1):
                try:
                    os.mkdir(name, 0o777, dir_fd=parent)
                except FileExistsError:
                    pass
                try:
                    child = os.open(name, DIRECTORY, dir_fd=parent)
                except OSError as exc:
                    return _refusal("/".join(parts[:depth]), exc, name, parent)
                if parent != self.workdir_fd:
                    os.close(parent)
                parent = child
            return _replace(parent, parts[-1], content)
        except OSError as exc:
            return "error", _one_line(exc)
        finally:
            if parent != self.workdir_fd:
                os.close(parent)


DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


def _has_user(uid: int) -> bool:
    try:
        pwd.getpwuid(uid)
        return True
    except KeyError:
        return False


def _guarded_by(real: str, home: str) -> str | None:
    """What a writable workdir at ``real`` would expose: ``/``, the login home or the
    system's configuration and programs."""
    if real == "/":
        return "/"
    guarded = [home, "/etc", "/usr", "/bin", "/sbin", "/lib", "/lib64", "/boot", "/var/spool"]
    guarded += ["/proc", "/sys", "/dev", "/run", os.path.dirname(os.path.realpath(sys.executable))]
    for place in guarded:
        if not place or place == "/":
            continue
        inside = real == place or place.startswith(real.rstrip("/") + "/")
        under = real.startswith(place.rstrip("/") + "/")
        if inside or (under and place != home):
            return place
    ssh = os.path.join(home, ".ssh")
    if real == ssh or real.startswith(ssh + "/"):
        return ssh
    return None


def _refusal(prefix: str, exc: OSError, name: str, parent: int) -> tuple[str, str]:
    """Why the directory ``prefix`` could not be opened (the messages of ``workdir.py``)."""
    if exc.errno not in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
        return "refused", f"{prefix!r}: {exc.strerror}"
    try:
        mode: int | None = os.stat(name, dir_fd=parent, follow_symlinks=False).st_mode
    except OSError:
        mode = None
    if mode is not None and stat.S_ISLNK(mode):
        return "link", prefix
    if mode is not None and not stat.S_ISDIR(mode):
        return "not-dir", prefix
    return "refused", f"{prefix!r} changed while it was being opened"


def _replace(parent: int, name: str, content: bytes) -> tuple[str, str | None]:
    """Put ``content`` at ``name`` by renaming a fresh file over it; keep a file's mode."""
    try:
        existing: os.stat_result | None = os.stat(name, dir_fd=parent, follow_symlinks=False)
    except FileNotFoundError:
        existing = None
    if existing is not None and stat.S_ISLNK(existing.st_mode):
        return "symlink", None
    temporary = f".cmbs-{os.urandom(8).hex()}.tmp"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(temporary, flags, 0o644, dir_fd=parent)
    try:
        if existing is not None and stat.S_ISREG(existing.st_mode):
            os.fchmod(fd, stat.S_IMODE(existing.st_mode) & 0o777)
        _write_all(fd, content)
        os.close(fd)
        fd = -1
        os.rename(temporary, name, src_dir_fd=parent, dst_dir_fd=parent)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        try:
            os.unlink(temporary, dir_fd=parent)
        except OSError:
            pass
        raise
    return "ok", None


def remove_workdir(path: str, fd: int, identity: tuple[int, int] | None) -> str | None:
    """Delete everything under the held workdir, whatever its modes, then the workdir
    itself if ``path`` still names it; say what is left, if anything."""
    failures: list[str] = []
    _empty(fd, os.fstat(fd).st_dev, "", failures)
    parent_path, name = os.path.split(path.rstrip("/"))
    try:
        parent = os.open(parent_path or "/", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        parent = -1
    if parent >= 0:
        try:
            status = os.stat(name, dir_fd=parent, follow_symlinks=False)
            if (status.st_dev, status.st_ino) == identity:
                os.rmdir(name, dir_fd=parent)
        except FileNotFoundError:
            pass
        except OSError as exc:
            if not failures:
                failures.append(f"{path}: {exc.strerror}")
        finally:
            os.close(parent)
    if not failures:
        return None
    more = f" (and {len(failures) - 1} more)" if len(failures) > 1 else ""
    return f"{failures[0]}{more}"


def _empty(fd: int, device: int, where: str, failures: list[str]) -> None:
    """Delete the entries of the directory open as ``fd``, making each directory
    writable first, never following a link nor entering another filesystem."""
    try:
        os.fchmod(fd, 0o700)
    except OSError:
        pass
    try:
        names = os.listdir(fd)
    except OSError as exc:
        failures.append("{}: {}".format(where or ".", exc.strerror))
        return
    for name in names:
        shown = where + name
        try:
            status = os.stat(name, dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            continue
        except OSError as exc:
            failures.append(f"{shown}: {exc.strerror}")
            continue
        try:
            if stat.S_ISDIR(status.st_mode):
                if status.st_dev != device:
                    failures.append(f"{shown}: a mount point")
                    continue
                held = os.open(name, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
                try:
                    os.chmod(f"/proc/self/fd/{held}", 0o700)
                    child = os.open(f"/proc/self/fd/{held}", os.O_RDONLY | os.O_DIRECTORY)
                finally:
                    os.close(held)
                try:
                    _empty(child, device, shown + "/", failures)
                finally:
                    os.close(child)
                os.rmdir(name, dir_fd=fd)
            else:
                os.unlink(name, dir_fd=fd)
        except FileNotFoundError:
            continue
        except OSError as exc:
            if not any(f.startswith(shown + "/") for f in failures):
                failures.append(f"{shown}: {exc.strerror}")


def sweep(chosen: Callable[[int, list[bytes]], bool]) -> int:
    """KILL every process ``chosen`` (pid, stat fields after the name), zombies and this
    process aside, pass after pass until one finds none (what forks meanwhile is caught
    by the next); how many were killed."""
    me, killed = os.getpid(), 0
    for _ in range(50):
        found = 0
        for pid in _pids():
            if pid == me:
                continue
            fields = _stat_fields(pid)
            if fields is None or fields[0] in (b"Z", b"X"):
                continue
            try:
                if chosen(pid, fields):
                    os.kill(pid, signal.SIGKILL)
                    found += 1
            except OSError:
                pass
        killed += found
        if not found:
            break
    return killed


def _below(pid: int, root: int) -> bool:
    """Whether ``pid`` descends from ``root`` (through the parents /proc names)."""
    for _ in range(64):
        fields = _stat_fields(pid)
        if fields is None:
            return False
        pid = int(fields[1])
        if pid == root:
            return True
        if pid <= 1:
            return False
    return False


def _descending_from(root: int) -> Callable[[int, list[bytes]], bool]:
    return lambda pid, fields: _below(pid, root)


def _in_session(fields: list[bytes], sid: int) -> bool:
    return int(fields[3]) == sid or int(fields[2]) == sid


def _tagged(pid: int, tag: str) -> bool:
    if not tag:
        return False
    try:
        with open(f"/proc/{pid}/environ", "rb") as handle:
            return ("CMBS_RUN=" + tag).encode() in handle.read().split(b"\0")
    except OSError:
        return False


def main() -> None:
    """Serve, the sync token (hex) read from the globals (the executor's code) or argv."""
    token = globals().get("CMBS_SYNC") or (sys.argv[1] if len(sys.argv) > 1 else "")
    Launcher(bytes.fromhex(str(token))).serve()


if __name__ == "__main__":
    main()
