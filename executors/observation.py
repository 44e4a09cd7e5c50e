"""What an executor is told and what it reports: the scenario's declared environment for
its commands, and the observation of what really happened when an action ran.

The lowest layer of cmbs-async: these models import nothing of the rest, so that
``executors`` stands on its own and ``cmbs_async`` builds on it (``cmbs_async.protocol``
re-exports them).
"""

from __future__ import annotations

import ipaddress
import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field

__all__ = [
    "ENV_NAME",
    "Check",
    "CommandEnv",
    "Containment",
    "Destination",
    "FileChange",
    "InputFile",
    "Limits",
    "Network",
    "Observation",
    "Output",
    "PassedName",
    "Program",
    "parse_size",
]

#: What an environment variable's name may be (for the shell's sake, here and remotely).
ENV_NAME = r"^[A-Za-z_][A-Za-z0-9_]*$"


def _not_a_secret(name: str) -> str:
    if name.startswith("CMBS_") or "API_KEY" in name.upper():
        raise ValueError(
            f"{name} may hold the operator's credentials: it cannot be passed to commands"
        )
    return name


#: A variable an operator passes from their environment to commands: never cmbs's own
#: settings (``CMBS_*``, which hold the agent's and the reviewer's API keys) nor an API key.
PassedName = Annotated[str, Field(pattern=ENV_NAME), AfterValidator(_not_a_secret)]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Output(_Model):
    """A captured output stream, capped: the first and last bytes, and the total size."""

    head: str = ""
    tail: str = ""
    total_bytes: int = 0
    truncated: bool = False

    @property
    def text(self) -> str:
        """Head and tail joined, with a marker where bytes were dropped."""
        if not self.truncated:
            return self.head + self.tail
        dropped = self.total_bytes - len(self.head.encode()) - len(self.tail.encode())
        return f"{self.head}\n[... {max(dropped, 0)} bytes not kept ...]\n{self.tail}"


_SIZE = re.compile(r"^\s*(\d+)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(value: object) -> object:
    """``"512MiB"``, ``"2G"``, ``"4096"`` as a number of bytes (``K``, ``M``, ``G``, ``T``
    are powers of 1024, with or without ``iB``/``B``); anything else is left as it is."""
    if isinstance(value, str):
        found = _SIZE.match(value)
        if found is None:
            raise ValueError(f"{value!r} is not a size (say 512MiB, 2GiB or a number of bytes)")
        unit = (found.group(2) or "").upper().rstrip("B").rstrip("I")
        return int(found.group(1)) * _UNITS[unit]
    return value


Size = Annotated[int, BeforeValidator(parse_size), Field(gt=0)]


class Limits(_Model):
    """What one scenario's commands may use together, each ``None`` for no limit.

    ``pids``: processes and threads at once; ``memory``: bytes of memory (what the
    sandbox's ``/tmp`` and ``/dev/shm`` hold counts too); ``tmp`` and ``shm``: the size
    of the private ``/tmp`` and ``/dev/shm``. A command that hits one fails, and its
    observation says which; another scenario never notices.
    """

    pids: int | None = Field(default=512, ge=16)
    memory: Size | None = 2 << 30
    tmp: Size | None = 256 << 20
    shm: Size | None = 64 << 20


_HOST_LABEL = re.compile(r"^(?!-)[A-Za-z0-9_-]{1,63}(?<!-)$")


def _destination(entry: str) -> str:
    """``HOST:PORT``, ``*.DOMAIN:PORT`` or ``[IPV6]:PORT``, checked and normalized."""
    host, sep, port = entry.strip().rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{entry!r}: expected HOST:PORT (a port from 1 to 65535)")
    if host.startswith("[") and host.endswith("]"):
        try:
            return f"[{ipaddress.IPv6Address(host[1:-1]).compressed}]:{int(port)}"
        except ValueError:
            raise ValueError(f"{entry!r}: not an IPv6 address in brackets") from None
    name = host[2:] if host.startswith("*.") else host
    labels = name.rstrip(".").split(".")
    if not name or len(name) > 253 or not all(_HOST_LABEL.match(label) for label in labels):
        raise ValueError(f"{entry!r}: {host!r} is not a host name or address")
    return f"{host.rstrip('.').lower()}:{int(port)}"


#: One place a sandboxed command may connect to: ``HOST:PORT``, ``*.DOMAIN:PORT`` (any
#: name under DOMAIN), ``[IPV6]:PORT``.
Destination = Annotated[str, AfterValidator(_destination)]


def _network(value: Any) -> Any:
    if value is True or value == "on":  # the older spellings
        return "all"
    if value is False:
        return "none"
    if isinstance(value, list):
        return tuple(value)
    return value


#: ``"all"``, ``"none"``, or the destinations allowed (nothing else is reachable).
Network = Annotated[Literal["all", "none"] | tuple[Destination, ...], BeforeValidator(_network)]


class CommandEnv(_Model):
    """What a scenario declares for its commands' environment and sandbox.

    ``values`` are set as given; ``pass_env`` names variables copied from the operator's
    environment where set (``KUBECONFIG``, say); ``network`` is ``"all"``, ``"none"``
    (no network and no host Unix socket) or a tuple of destinations, the only ones a
    sandboxed command reaches; ``readable`` names host files a sandboxed command may read
    although hidden or not readable to its user (the key for a target host, say);
    ``limits`` bound what the scenario's commands use together. Nothing else of the
    operator's environment reaches a command but an allow-list (``PATH``, ``LANG``,
    ``LC_*``, ``TERM``, ``TZ``).
    """

    values: dict[Annotated[str, Field(pattern=ENV_NAME)], str] = Field(default_factory=dict)
    pass_env: tuple[PassedName, ...] = ()
    network: Network = "all"
    readable: tuple[str, ...] = ()
    limits: Limits = Field(default_factory=Limits)


class Check(_Model):
    """One thing the canary tried inside a new sandbox, and whether the sandbox held."""

    name: str
    target: str
    held: bool
    detail: str = ""


class Containment(_Model):
    """What contains a workdir's commands, as its executor set it up and proved it.

    ``sandbox`` says what keeps them in (``"bwrap"``, ``"none"``, over SSH ``"pidns"`` and
    so on); ``user`` who they run as; ``network`` what they reach; ``limits`` what they may
    use; ``canary`` what was tried at the start, each check held or not.
    """

    sandbox: str
    user: str | None = None
    network: str = "all"
    limits: dict[str, int] = Field(default_factory=dict)
    canary: tuple[Check, ...] = ()

    @property
    def leaks(self) -> tuple[Check, ...]:
        """The checks that did not hold."""
        return tuple(check for check in self.canary if not check.held)


class FileChange(_Model):
    """A file an action created, changed, renamed, linked or removed in the workdir, known
    by its inode and the SHA-256 of its content (a symbolic link: its ``target``). A rename
    or a hard link names the ``source`` path whose inode it took."""

    path: str
    change: Literal["created", "changed", "renamed", "linked", "removed"]
    kind: Literal["file", "link", "other"]
    inode: int
    sha256: str | None = None
    target: str | None = None
    source: str | None = None


class InputFile(_Model):
    """The file an argument of a program named, identified just before the program ran:
    a regular file inside the workdir (its relative ``path``, inode and content hash), or
    ``outside`` saying why it is not one. ``role`` says what the evaluation reads it as:
    an ``input`` (judged by provenance), a ``file`` it must find in the workdir (a
    policy), or a ``variable``'s file (``KUBECONFIG``: judged by provenance, and may lie
    outside the workdir, where the operator put it)."""

    argument: str
    role: Literal["input", "file", "variable"] = "input"
    path: str | None = None
    inode: int | None = None
    sha256: str | None = None
    outside: str | None = None


class Program(_Model):
    """A program resolved to an absolute path outside every writable place, with the
    SHA-256 of its content."""

    name: str
    path: str
    sha256: str


class Observation(_Model):
    """What really happened when an allowed action ran.

    ``program_found`` is false when the shell could not find the program (exit 127),
    ``None`` when it is not known (an artifact, a killed command, a lost connection).
    ``limits_hit`` names the scenario's limits the command ran into (``"pids"``,
    ``"memory"``, ``"tmp"``, ``"shm"``); ``network_refused`` the connections the sandbox
    refused it (``"10.0.0.9:443"``), each a reason the command may have failed.

    A program run as an argument vector, with no shell, says so: ``argv`` is exactly what
    ran, ``program`` the file it was, ``inputs`` the files its input arguments named.
    ``changes`` is what the action did to the workdir (``changes_complete`` false when the
    workdir held too many files to say all of it).
    """

    kind: Literal["command", "artifact"]
    action: str | None = None
    command: str | None = None
    path: str | None = None
    success: bool
    exit_status: int | None = None
    program_found: bool | None = None
    timed_out: bool = False
    error: str | None = None
    limits_hit: tuple[str, ...] = ()
    network_refused: tuple[str, ...] = ()
    argv: tuple[str, ...] | None = None
    program: Program | None = None
    inputs: tuple[InputFile, ...] = ()
    changes: tuple[FileChange, ...] = ()
    changes_complete: bool = True
    stdout: Output = Field(default_factory=Output)
    stderr: Output = Field(default_factory=Output)
    duration_s: float = 0.0

    def summary(self) -> str:
        """A few words on what happened, for step tables."""
        if self.kind == "artifact":
            return f"wrote {self.path}" if self.success else f"refused: {self.error}"
        if self.timed_out or self.exit_status is None:
            return self.error or "no exit status"
        first = (self.stdout.head or self.stderr.head).strip().splitlines()
        said = f": {first[0][:40]}" if first else ""
        return f"exit {self.exit_status}{said}"
