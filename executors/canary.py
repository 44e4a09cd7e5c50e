"""The canary: proof, at the start of each scenario, that its sandbox holds.

Before the agent's first step a small shell script runs in the new sandbox exactly as a
command would (same user, same namespaces) and tries what a command must not manage:
write outside its workdir, read what is hidden and what only root may read, hold a
capability, make a user namespace, use io_uring or a kernel keyring, and, where the
network is cut or limited, make a Unix socket or connect outside (the system calls
through Python, the only part that needs more than a shell). Every
attempt is a :class:`~executors.observation.Check`; one that succeeds is a leak, and the
scenario ends before it begins.
"""

from __future__ import annotations

import glob
import os
import sys
from collections.abc import Iterable

import anyio

from .base import OutputBuffer
from .errors import ExecutorError, SandboxLeak
from .observation import Check, Containment, Network
from .sandbox import TOOL_DIRS
from .sandboxes import Run, Sandbox

__all__ = ["NOWHERE", "canary", "prove", "read_checks"]

#: The script: each check a line ``name<TAB>target<TAB>yes|no<TAB>detail``; the plan comes
#: in the environment, one path a line, so no path is ever parsed as shell.
_SCRIPT = r"""
IFS='
'
check() { printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4"; }
why() { printf '%s' "${1##*: }"; }
for dir in $CANARY_WRITE; do
    probe="$dir/.cmbs-canary-$$"
    if said=$( { : > "$probe"; } 2>&1 ); then
        rm -f "$probe"; check "write outside the workdir" "$dir" no "created $probe"
    else
        check "write outside the workdir" "$dir" yes "$(why "$said")"
    fi
done
for line in $CANARY_HIDDEN; do
    path=${line%%	*}; shown=$(printf '%s' "${line#*	}" | tr '\t' '\n')
    if [ -d "$path" ]; then
        seen=$(ls -A "$path" 2>/dev/null | grep -vxF -e "$shown" | head -n 5 | tr '\n' ' ')
        if [ -z "$seen" ]; then check "read a hidden path" "$path" yes empty
        else check "read a hidden path" "$path" no "$seen"; fi
    elif [ -e "$path" ] && [ "$(head -c 1 "$path" 2>/dev/null | wc -c)" != 0 ]; then
        check "read a hidden path" "$path" no readable
    else
        check "read a hidden path" "$path" yes "empty or missing"
    fi
done
for path in $CANARY_PRIVATE; do
    if said=$(head -c 1 "$path" 2>&1 >/dev/null); then
        check "read a root-only file" "$path" no readable
    else
        check "read a root-only file" "$path" yes "$(why "$said")"
    fi
done
caps=$(sed -n 's/^CapEff:[[:space:]]*//p' /proc/self/status)
[ "$caps" = 0000000000000000 ] && held=yes || held=no
check "hold a capability" CapEff "$held" "$caps"
uid=$(id -u)
[ "$uid" != 0 ] && held=yes || held=no
check "run as root" uid "$held" "uid $uid"
if unshare -U true 2>/dev/null; then check "make a user namespace" unshare no allowed
else check "make a user namespace" unshare yes refused; fi
"$CANARY_PYTHON" -I -S -c "$CANARY_PROBES"
probe="$CANARY_WORKDIR/.cmbs-canary-$$"
if [ -z "$CANARY_WORKDIR" ]; then check workdir none yes
elif said=$( { : > "$probe"; } 2>&1 ); then rm -f "$probe"; check workdir "$CANARY_WORKDIR" yes
else check workdir "$CANARY_WORKDIR" no "$(why "$said")"; fi
"""

#: The checks that need more than a shell: what the seccomp filter refuses, and, where
#: the network is cut or limited, the network.
_PROBES = r"""
import ctypes, os, platform, socket
def check(name, target, held, detail):
    print("%s\t%s\t%s\t%s" % (name, target, "yes" if held else "no", detail))
libc = ctypes.CDLL(None, use_errno=True)
io_uring_setup, add_key = (425, 248) if platform.machine() == "x86_64" else (425, 217)
params = ctypes.create_string_buffer(120)
fd = libc.syscall(io_uring_setup, 4, params)
def refused(result):
    return result < 0, os.strerror(ctypes.get_errno()) if result < 0 else "allowed"
check("use io_uring", "io_uring_setup", *refused(fd))
key = libc.syscall(add_key, b"user", b"cmbs-canary", b"x", 1, -4)  # the user keyring
check("use a kernel keyring", "add_key", *refused(key))
if os.environ["CANARY_UNIX"]:
    try:
        socket.socket(socket.AF_UNIX, socket.SOCK_STREAM).close()
        check("open a Unix socket", "AF_UNIX", False, "allowed")
    except OSError as exc:
        check("open a Unix socket", "AF_UNIX", True, exc.strerror)
if os.environ["CANARY_OUTSIDE"]:
    host, port = os.environ["CANARY_OUTSIDE"].rsplit(":", 1)
    where = host + ":" + port
    try:
        with socket.create_connection((host, int(port)), timeout=3) as conn:
            if conn.recv(1):  # a guard that accepts a listed port resets what it refuses
                raise TimeoutError
        check("connect outside the network policy", where, True, "closed at once")
    except (TimeoutError, socket.timeout):
        check("connect outside the network policy", where, False, "connected")
    except OSError as exc:
        check("connect outside the network policy", where, True, exc.strerror or "refused")
"""

#: An address of the documentation range: never a real host, so never on an allow-list.
NOWHERE = "192.0.2.1:9"
#: Files only root (and its groups) may read, where they exist.
_ROOT_ONLY = ("/etc/shadow", "/etc/gshadow", "/etc/sudoers", "/etc/ssh/ssh_host_*_key")


def canary(
    *,
    workdir: str | None,
    root: str | None,
    hidden: Iterable[str],
    shown: Iterable[str],
    network: Network,
) -> tuple[str, dict[str, str]]:
    """The canary for a sandbox with this workdir (``None``: an agent program's, which has
    none), root and network: the shell script and the variables it reads (add them to the
    commands' environment).

    ``shown`` are the paths mounted back inside hidden ones (the tools, the workdir,
    what is readable): a hidden directory may hold the way to them, and nothing else.
    """
    write = ["/", "/etc", "/usr", "/var/tmp", *([os.path.dirname(workdir)] if workdir else [])]
    if root is not None:
        write.append(root)
    visible = [os.path.realpath(path) for path in shown]
    hidden_lines = [
        real + "\t" + "\n".join(_first_steps(real, visible))
        for real in dict.fromkeys(os.path.realpath(path) for path in hidden)
        if os.path.lexists(real)
    ]
    env = {
        "CANARY_WORKDIR": workdir or "",
        "CANARY_WRITE": "\n".join(dict.fromkeys(write)),
        "CANARY_HIDDEN": "\n".join(line.replace("\n", "\t") for line in hidden_lines),
        "CANARY_PRIVATE": "\n".join(_private()),
        "CANARY_PYTHON": os.path.realpath(sys.executable),
        "CANARY_PROBES": _PROBES,
        "CANARY_UNIX": "1" if network == "none" else "",
        "CANARY_OUTSIDE": "" if network == "all" else NOWHERE,
    }
    return _SCRIPT, env


async def prove(
    sandbox: Sandbox, *, workdir: str | None, hidden: Iterable[str], kill_grace: float
) -> Containment:
    """Run the canary in the new ``sandbox`` (with ``workdir``, or none: an agent
    program's): what contains it, or :class:`SandboxLeak` naming the first leak
    (:class:`ExecutorError` if the canary cannot run, or commands cannot use the workdir)."""
    spec = sandbox.spec
    shown = [*TOOL_DIRS, *filter(None, [workdir, spec.cwd]), *spec.readable]
    script, variables = canary(
        workdir=workdir, root=spec.root, hidden=hidden, shown=shown, network=spec.network
    )
    stdout, stderr = OutputBuffer(), OutputBuffer()
    ran = await Run.start(sandbox, script, sandbox.env | variables, spec.start_in)
    if isinstance(ran, str):
        raise ExecutorError(f"the sandbox's canary could not start: {ran}")
    try:
        with anyio.fail_after(30):
            await ran.collect(stdout, stderr, 0.2)
    except BaseException:
        ran.abandon()
        raise
    with anyio.CancelScope(shield=True):
        await ran.end(kill_grace)
    try:
        checks, unusable = read_checks(stdout.output().text)
    except ValueError:
        said = " ".join(stderr.output().text.split())[-300:]
        status = f"status {ran.exit.status}" if ran.exit else "no status"
        said = said or f"no report, {status}"
        raise ExecutorError(f"the sandbox's canary failed: {said}") from None
    if sandbox.broker is not None:  # network by allow-list: its refusal was recorded
        checks = (*checks, await sandbox.broker.check_recorded(NOWHERE))
    network = spec.network
    report = Containment(
        sandbox="bwrap",
        user=str(spec.user),
        network=network if isinstance(network, str) else "only " + ", ".join(network),
        limits=sandbox.limits,
        canary=checks,
    )
    if report.leaks:
        leak = report.leaks[0]
        raise SandboxLeak(f"the sandbox leaks: {leak.name}: {leak.target} ({leak.detail})", report)
    if unusable is not None:
        raise ExecutorError(
            f"commands cannot write their workdir {workdir} as {spec.user}: {unusable}"
        )
    return report


def read_checks(stdout: str) -> tuple[tuple[Check, ...], str | None]:
    """The checks the canary printed, and why commands cannot use the workdir (if so);
    ``ValueError`` if it printed no report."""
    checks: list[Check] = []
    workdir: str | None = None
    for line in stdout.splitlines():
        fields = line.split("\t")
        if len(fields) != 4:
            continue
        name, target, held, detail = fields
        if name == "workdir":
            workdir = None if held == "yes" else detail or "cannot write"
            return tuple(checks), workdir
        checks.append(Check(name=name, target=target, held=held == "yes", detail=detail))
    raise ValueError("the canary printed no report")


def _first_steps(directory: str, paths: Iterable[str]) -> list[str]:
    """The entries of ``directory`` that lead to one of ``paths``."""
    steps = set()
    for path in paths:
        relative = os.path.relpath(path, directory)
        if relative != "." and not relative.startswith(".."):
            steps.add(relative.split(os.sep)[0])
    return sorted(steps)


def _private() -> list[str]:
    """The files of :data:`_ROOT_ONLY` that are there and that others may not read (the
    sandbox's user is in none of their groups)."""
    found = []
    for path in sorted({p for pattern in _ROOT_ONLY for p in glob.glob(pattern)}):
        try:
            status = os.stat(path)
        except OSError:
            continue
        if not status.st_mode & 0o004:
            found.append(path)
    return found
