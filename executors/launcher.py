"""The launcher: the one long-lived process inside a scenario's sandbox.

The executor starts it once per scenario, inside bubblewrap, with ``python -I -S``: it
imports nothing but the standard library, so it runs wherever the interpreter does. It
talks to the executor over one ``SOCK_SEQPACKET`` socket (the descriptor its first
argument names), one JSON object per message.

Each command runs as the init of a PID namespace of its own, with a ``/proc`` of its
own, under the sandbox's unprivileged user, with no capabilities: when it exits, or is
killed, the kernel ends everything it started. So that none of this is on a command's
path, the launcher keeps one such namespace ready, a *zygote*: forked, unshared,
privileges dropped, its standard streams already pipes, and the shell that will run the
command already started, reading its instructions from one more pipe. The launcher hands
the executor the other ends of those four pipes; the executor writes the shell a few
lines (the directory, the environment, ``exec`` the command), tells the launcher it used
the zygote, and reads the output. The launcher makes the next zygote, and reaps the
command when it ends.

Messages from the executor: ``{"op": "config", "uid": U, "gid": G, "home": DIR, "cwd":
DIR, "env": {...}, "joins": [...]}`` first (answered ``{"ready": true}``): a zygote's
shell starts in that directory with that environment, so that a command that wants no
other costs nothing more than its ``exec``, and each zygote writes itself into the
control groups ``joins`` names (the scenario's limits are for its commands); then
``{"op": "used", "zygote": K}`` and ``{"op": "kill", "zygote": K}``. From the launcher:
``{"zygote": K}`` with four descriptors (the command's stdin to write, its stdout and
stderr to read, the instructions to write) once a zygote is ready; ``{"zygote": K,
"exit": S}`` once it has ended (``S`` is 128 + the signal that killed it); ``{"zygote":
null, "error": REASON}`` when no zygote can be made (the scenario's process limit, say):
it tries again soon. When the executor is gone (its socket closed, whatever ended it),
the launcher kills every command and ends, and the sandbox with it.
"""

import contextlib
import ctypes
import errno
import fcntl
import json
import os
import selectors
import signal
import socket
import sys
from collections.abc import Callable
from typing import Any

_MAX = 1 << 20

_CLONE_NEWNS = 0x00020000
_CLONE_NEWPID = 0x20000000
_MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_REC, _MS_PRIVATE = 2, 4, 8, 1 << 14, 1 << 18
_PR_SET_NO_NEW_PRIVS = 38
_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL = 47, 4
_CAPABILITY_VERSION_3 = 0x20080522
_PR_CAPBSET_DROP = 24
_LANDLOCK_CREATE_RULESET, _LANDLOCK_RESTRICT_SELF = 444, 446  # the same on every machine
_LANDLOCK_CREATE_RULESET_VERSION = 1
_LANDLOCK_SCOPES = 1 | 2  # abstract Unix sockets, signals
_RETRY = 0.05  # seconds before trying again to make a zygote that could not be made
_LIMIT = "the scenario's process limit is reached"
_POOL = 1  # zygotes kept ready (one: more makes a scenario slower to end)
#: The zygote's shell: it runs the instructions the executor writes to descriptor 3.
_WAITER = ["/bin/sh", "-c", ". /dev/fd/3"]
#: The same, where the zygote could not enter the directory: the shell says why.
_WAITER_CD = ["/bin/sh", "-c", 'cd -- "$0" || exit 126; . /dev/fd/3']

_libc = ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


class Launcher:
    """The loop: the executor's messages, zygotes getting ready, commands ending."""

    def __init__(self, control: socket.socket, config: dict[str, Any]) -> None:
        self.control: socket.socket | None = control
        self.uid: int = config["uid"]
        self.gid: int = config["gid"]
        self.cwd: str = config["cwd"]
        self.env: dict[str, str] = config["env"]
        self.joins: list[str] = config.get("joins", [])
        self.selector = selectors.DefaultSelector()
        self.pid_ns = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
        self.zygotes: dict[int, _Zygote] = {}  # every zygote not yet reaped, by number
        self.offered: list[_Zygote] = []  # made, not yet used
        self.number = 0
        self.retry = False
        self._watch(control, self._message)

    def _watch(self, source: socket.socket | int, handler: Callable[[Any], None]) -> None:
        self.selector.register(source, selectors.EVENT_READ, handler)

    def serve(self) -> None:
        """Until the executor is gone; then every command with it (the sandbox's init
        waits for every process it inherits, so none may stay)."""
        self._make_zygote()
        try:
            while self.control is not None:
                events = self.selector.select(_RETRY if self.retry else None)
                for key, _ in events:
                    if self.selector.get_map().get(key.fd) is key:  # not gone meanwhile
                        key.data(key.fileobj)
                if self.retry:
                    self._make_zygote()
        finally:
            for zygote in self.zygotes.values():
                zygote.kill()

    def _message(self, control: socket.socket) -> None:
        try:
            data = control.recv(_MAX)
        except ConnectionError:
            data = b""
        if not data:  # the executor is gone: so is everything here
            self.control = None
            return
        message: dict[str, Any] = json.loads(data)
        zygote = self.zygotes.get(message.get("zygote", -1))
        if message.get("op") == "kill" and zygote is not None:
            zygote.kill()
        elif message.get("op") == "used" and zygote in self.offered:
            self.offered.remove(zygote)
            self._make_zygote()

    def _send(self, message: dict[str, Any], fds: list[int] | None = None) -> None:
        if self.control is None:
            return
        data = json.dumps(message).encode()
        try:
            socket.send_fds(self.control, [data], fds) if fds else self.control.send(data)
        except OSError:
            self.control = None

    # -- zygotes --------------------------------------------------------------------
    def _make_zygote(self) -> None:
        self.retry = False
        if len(self.offered) >= _POOL:
            return
        self.number += 1
        try:
            zygote = _Zygote(self, self.number)
        except OSError as exc:  # the process limit, say: try again soon
            self.retry = True
            why = _LIMIT if exc.errno == errno.EAGAIN else _reason(exc)
            self._send({"zygote": None, "error": why})
            return
        self.zygotes[zygote.number] = zygote
        self.offered.append(zygote)
        self._watch(zygote.sock, self._zygote_ready)
        self._watch(zygote.pidfd, self._ended)

    def _zygote_ready(self, sock: socket.socket) -> None:
        self.selector.unregister(sock)
        zygote = next(z for z in self.zygotes.values() if z.sock is sock)
        if zygote.take_ready():  # its shell waits: the executor may use it
            self._send({"zygote": zygote.number}, zygote.outer)
        zygote.close_outer()
        self._make_zygote()  # the next one, while this one waits

    def _ended(self, pidfd: int) -> None:
        self.selector.unregister(pidfd)
        zygote = next(z for z in self.zygotes.values() if z.pidfd == pidfd)
        del self.zygotes[zygote.number]
        status = zygote.reap()
        self._send({"zygote": zygote.number, "exit": status})
        zygote.release()
        if zygote in self.offered:  # it died before it was used
            self.offered.remove(zygote)
            self._make_zygote()


class _Zygote:
    """A forked init of a new PID namespace, waiting for one command (see the module)."""

    def __init__(self, launcher: Launcher, number: int) -> None:
        self.number = number
        self.sock, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.mount_ns: int | None = None
        stdin, stdout, stderr, orders = os.pipe(), os.pipe(), os.pipe(), os.pipe()
        inner = [stdin[0], stdout[1], stderr[1], orders[0]]  # its 0, 1, 2 and 3
        self.outer = [stdin[1], stdout[0], stderr[0], orders[1]]  # the executor's
        os.fchown(orders[0], launcher.uid, launcher.gid)  # its shell opens /dev/fd/3
        try:
            _check(_libc.unshare(_CLONE_NEWPID), "unshare")
            try:
                self.pid = os.fork()
            except OSError:
                _check(_libc.setns(launcher.pid_ns, _CLONE_NEWPID), "setns")
                raise
            if self.pid != 0:  # the launcher's next child goes to a new namespace again
                _check(_libc.setns(launcher.pid_ns, _CLONE_NEWPID), "setns")
        except OSError:
            for fd in (*inner, *self.outer):
                os.close(fd)
            self.sock.close()
            child.close()
            raise
        if self.pid == 0:
            try:  # out of the way first, then in place: 0, 1, 2, 3 and the socket at 4
                moved = [
                    fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 100) for fd in [*inner, child.fileno()]
                ]
                for target, fd in enumerate(moved):
                    os.dup2(fd, target)
                os.closerange(5, os.sysconf("SC_OPEN_MAX"))
                _init(socket.socket(fileno=4), launcher)
            finally:
                os._exit(125)
        for fd in inner:
            os.close(fd)
        child.close()
        self.pidfd = os.pidfd_open(self.pid)

    def take_ready(self) -> bool:
        """Take its "ready" and its mount namespace; false if it failed instead."""
        try:
            data, fds, _flags, _addr = socket.recv_fds(self.sock, 4096, 1)
        except OSError:
            data, fds = b"", []
        self.sock.close()
        if data != b"ready" or not fds:
            for fd in fds:
                os.close(fd)
            return False
        self.mount_ns = fds[0]  # held here: its teardown waits until the end is said
        return True

    def close_outer(self) -> None:
        for fd in self.outer:
            os.close(fd)
        self.outer = []

    def kill(self) -> None:
        """KILL the namespace's init: the kernel ends everything else in it."""
        try:
            signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def reap(self) -> int:
        """Its exit status, 128 + the signal that killed it."""
        _, status = os.waitpid(self.pid, 0)
        code = os.waitstatus_to_exitcode(status)
        return 128 - code if code < 0 else code

    def release(self) -> None:
        os.close(self.pidfd)
        if self.mount_ns is not None:
            os.close(self.mount_ns)
        if self.outer:
            self.close_outer()


def _init(sock: socket.socket, launcher: Launcher) -> None:
    """The command's namespace init: its own ``/proc``, the sandbox user, no capabilities,
    the sandbox's directory and environment; then the shell that waits for its orders."""
    uid, gid = launcher.uid, launcher.gid
    try:
        for procs in launcher.joins:  # the scenario's limits: for commands, not the launcher
            with open(procs, "w") as handle:
                handle.write("0")
        _check(_libc.unshare(_CLONE_NEWNS), "unshare")
        _check(_libc.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None), "mount private")
        flags = _MS_NOSUID | _MS_NODEV | _MS_NOEXEC
        _check(_libc.mount(b"proc", b"/proc", b"proc", flags, None), "mount /proc")
        try:  # the launcher's shield from the out-of-memory killer is not for commands
            with open("/proc/self/oom_score_adj", "w") as handle:
                handle.write("0")
        except OSError:
            pass
        mount_ns = os.open("/proc/self/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
        for cap in range(64):  # the bounding set: no capability can ever come back
            if _libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) != 0 and ctypes.get_errno() == 22:
                break  # EINVAL: past the last capability this kernel knows
        if os.getuid() == 0:
            os.setgroups([])
            os.setresgid(gid, gid, gid)
            os.setresuid(uid, uid, uid)  # from root to another user: every capability goes
        _check(_libc.prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0), "prctl")
        _check(_libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl")
        _drop_capabilities()
        _scope()
        socket.send_fds(sock, [b"ready"], [mount_ns])
        sock.close()
        os.close(mount_ns)
        try:
            os.chdir(launcher.cwd)
            waiter = _WAITER
        except OSError:
            waiter = [*_WAITER_CD, launcher.cwd]
        os.execve(waiter[0], waiter, launcher.env)
    except OSError as exc:
        try:
            os.write(2, f"cmbs launcher: {_reason(exc)}\n".encode())
        except OSError:
            pass
    finally:
        os._exit(127)


def _drop_capabilities() -> None:
    """No capability left, not even an inheritable one (the setuid took the others)."""
    header = (ctypes.c_uint32 * 2)(_CAPABILITY_VERSION_3, 0)
    data = (ctypes.c_uint32 * 6)()
    _check(_libc.capset(header, data), "capset")


def _scope() -> None:
    """A Landlock domain of its own (Linux 6.12 and later): no connection to an abstract
    Unix socket made outside it (another command's, the agent program's, the host's) and
    no signal to a process outside it. An older kernel has no such scope: nothing to do."""
    abi = _libc.syscall(_LANDLOCK_CREATE_RULESET, None, 0, _LANDLOCK_CREATE_RULESET_VERSION)
    if abi < 6:
        return
    attr = (ctypes.c_uint64 * 3)(0, 0, _LANDLOCK_SCOPES)  # fs, net, scoped
    ruleset = _libc.syscall(_LANDLOCK_CREATE_RULESET, attr, ctypes.sizeof(attr), 0)
    if ruleset < 0:
        _check(-1, "landlock_create_ruleset")
    try:
        _check(_libc.syscall(_LANDLOCK_RESTRICT_SELF, ruleset, 0), "landlock_restrict_self")
    finally:
        os.close(ruleset)


def _reason(exc: OSError) -> str:
    return exc.strerror or str(exc)


def _start_netguard(setting: dict[str, Any]) -> int:
    """Start the network guard with its descriptor (closed here: no command inherits it)
    and wait until it serves (its pid); if it cannot, it has said why on stderr, and
    nothing starts."""
    fd: int = setting["fd"]
    ready, said = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.dup2(said, 1)
            os.closerange(3, fd)
            os.closerange(fd + 1, os.sysconf("SC_OPEN_MAX"))
            os.execv(setting["argv"][0], setting["argv"])
        finally:
            os._exit(127)
    os.close(said)
    os.close(fd)
    answer = os.read(ready, 64)
    os.close(ready)
    if answer != b"ready\n":
        sys.exit(1)
    return pid


def main(fd: int) -> None:
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    control = socket.socket(fileno=fd)
    config = json.loads(control.recv(_MAX))
    os.makedirs(config["home"], exist_ok=True)
    os.chown(config["home"], config["uid"], config["gid"])
    helpers: list[int] = []  # processes of its own, ended with it
    if config.get("netguard"):  # network by allow-list: see executors/netguard.py
        helpers.append(_start_netguard(config["netguard"]))
    launcher = Launcher(control, config)
    control.send(json.dumps({"ready": True}).encode())
    try:
        launcher.serve()
    finally:
        for pid in helpers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


if __name__ == "__main__":
    main(int(sys.argv[1]))
