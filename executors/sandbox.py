"""The sandbox every local command runs in: bubblewrap, one PID namespace per command.

What a command sees: the host filesystem read-only; its workdir the only writable path;
a private ``/tmp`` with ``HOME`` inside it; the operator's home, the cmbs data directory
(signing key, audit database) and any path the operator names hidden; an environment
built from an allow-list plus what the scenario declares. When the command's shell
exits, or the sandbox is killed, the kernel ends every process of its PID namespace,
``setsid`` and double forks included. All capabilities are dropped, so even a root
sandbox cannot remount the host writable.

What it cannot protect: anything the command can read (now only the host's world-
readable files and its workdir) can still be sent out over the network unless the
scenario says ``network: none``.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Literal

from .base import ExecutorError
from .observation import CommandEnv

__all__ = [
    "ALLOWED_ENV",
    "INSTALL_HINT",
    "SANDBOX_HOME",
    "SandboxMode",
    "SandboxUnavailable",
    "bwrap_argv",
    "check_workdir",
    "command_env",
    "default_hidden",
    "find_bwrap",
]

SandboxMode = Literal["auto", "bwrap", "none"]

#: Variables a command inherits from the operator's environment (``LC_*`` too).
ALLOWED_ENV = ("PATH", "LANG", "LANGUAGE", "TERM", "TZ")

#: How to get bubblewrap on Debian and Ubuntu.
INSTALL_HINT = "apt-get install bubblewrap"
#: ``HOME`` inside the sandbox: a private directory under its own ``/tmp``.
SANDBOX_HOME = "/tmp/home"


class SandboxUnavailable(ExecutorError):
    """``sandbox="bwrap"`` was asked for where bubblewrap does not work."""


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


def bwrap_argv(
    bwrap: str,
    workdir: str,
    *,
    hidden: Iterable[str],
    readable: Iterable[str] = (),
    env: Mapping[str, str],
    network: bool,
    info_fd: int,
) -> list[str]:
    """The bwrap command line that runs what follows it confined to ``workdir`` (absolute).

    ``hidden`` is looked up on disk for every command: a key or database created after
    the executor was made is hidden all the same. ``readable`` paths are mounted back,
    read-only, over whatever hides them.
    """
    argv = [
        bwrap,
        "--ro-bind", "/", "/",
        "--dev", "/dev",
        "--proc", "/proc",
        "--tmpfs", "/tmp",
        "--dir", SANDBOX_HOME,
    ]  # fmt: skip
    present = _existing(hidden)
    tools = _tools_under(present)
    inside_tools = [p for p in present if any(Path(p).is_relative_to(t) for t in tools)]
    for path in present:
        argv += _hide(path)
    for path in tools:  # the interpreter and the tools it runs, shown again...
        argv += ["--ro-bind", path, path]
    for path in inside_tools:  # ...but not a secret that lies among them
        argv += _hide(path)
    for path in _existing(readable):  # what the scenario declared, read-only
        argv += ["--ro-bind", path, path]
    argv += [
        "--bind", workdir, workdir,
        "--chdir", workdir,
        "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
        "--die-with-parent",
        "--cap-drop", "ALL",
        "--clearenv",
        "--info-fd", str(info_fd),
    ]  # fmt: skip
    if not network:
        argv.append("--unshare-net")
    for name, value in env.items():
        argv += ["--setenv", name, value]
    return [*argv, "--"]


def check_workdir(workdir: str, *, hidden: Iterable[str]) -> None:
    """Refuse a workdir whose writable mount would undo the sandbox: ``/``, or a directory
    holding a hidden path, the shared ``/tmp``, or the tools commands run (a changed
    interpreter would run the agent's code outside the sandbox later)."""
    real = os.path.realpath(workdir)
    guarded = [*_existing(hidden), tempfile.gettempdir(), *_TOOLS]
    covered = (
        "/" if real == "/" else next((p for p in guarded if Path(p).is_relative_to(real)), None)
    )
    if covered is not None:
        raise ExecutorError(
            f"workdir {real} would let commands change {covered}: "
            "give the scenario a directory of its own"
        )


def _hide(path: str) -> list[str]:
    return ["--tmpfs", path] if os.path.isdir(path) else ["--ro-bind", "/dev/null", path]


def _existing(paths: Iterable[str]) -> list[str]:
    found = []
    for path in paths:
        real = os.path.realpath(path)
        if real != "/" and os.path.exists(real):
            found.append(real)
    return found


#: Python's installation, its venv, and where this package's code lies (a source tree, for
#: an editable install): what the tools a command runs (cmbs-opa, ansible) are made of.
_TOOLS = tuple(
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
    return [tool for tool in _TOOLS if any(Path(tool).is_relative_to(d) for d in dirs)]
