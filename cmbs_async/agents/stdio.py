"""An agent that is any program, in any language: turns go to its stdin as JSON lines,
steps come back on its stdout, one line each.

The program is untrusted, so by default it runs in a sandbox of its own (bubblewrap, as
the commands do; see :mod:`executors.sandbox`): the host read-only, the operator's home,
the cmbs data directory, the signing key, the audit database and every workdir out of
sight, a private ``/tmp``, an unprivileged user, an environment of an allow-list and what
it is given, in a PID namespace of its own. It acts only through its pipes: files reach a
workdir only through the write actions the gate sees.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import tempfile
from collections.abc import Mapping, Sequence
from contextlib import suppress
from dataclasses import dataclass, field
from typing import IO, Literal, NoReturn, Protocol

import anyio
from anyio.abc import Process

from executors.canary import prove
from executors.errors import ExecutorError
from executors.observation import Containment, Limits, Network
from executors.sandbox import (
    ALLOWED_ENV,
    TOOL_DIRS,
    SandboxSpec,
    SandboxUser,
    default_hidden,
    find_bwrap,
    sandbox_user,
)
from executors.sandboxes import Job, Sandbox, start_sandbox

from .._closing import Closing
from .._errors import CmbsError
from ..protocol import Turn
from .base import AgentMessage

__all__ = ["AgentProcessError", "AgentSandbox", "Isolation", "StdioAgent"]

_STDERR_KEPT = 64 << 10  # the last bytes of the program's stderr kept for the result
_STDERR_SAID = 2000  # the last characters of it in the error's message, on one line
_GRACE = 1.0  # seconds between asking the program to end and killing it

#: How the program is kept in: ``"sandbox"`` (bubblewrap), ``"group"`` (a process group,
#: on the host as it is), ``"auto"`` (the sandbox where bubblewrap works, else the group).
Isolation = Literal["auto", "sandbox", "group"]


#: what a program says when a file it looked for is outside what its sandbox shows
_NOT_SEEN = re.compile(r"No such file or directory|Permission denied|ENOENT|EACCES")


class AgentProcessError(CmbsError, RuntimeError):
    """The agent program crashed, hung or closed its output; the message says which, with
    the end of its stderr on one line. :attr:`stderr` holds the last 64 KiB of its stderr
    as it wrote them (a run keeps them as its result's ``agent_stderr``)."""

    def __init__(self, message: str, *, stderr: str = "") -> None:
        super().__init__(message)
        self.stderr = stderr


@dataclass(frozen=True)
class AgentSandbox:
    """What the agent program's sandbox hides and shows.

    ``hidden``: paths it must not see besides the operator's home and the cmbs data
    directory: name the signing key and the audit database here (never shown, even when
    named on its command line);
    ``workdir_root``: where the scenarios' workdirs are (hidden: the program sees no
    workdir); ``readable``: files and directories it needs (its own code, a model's
    weights), shown read-only; files named on its command line are shown on their own;
    ``network``: ``"all"`` (the default: it must reach its model), ``"none"`` or the only
    destinations it reaches; ``limits``: what it may use (4 GiB of memory by default);
    ``user``: who it runs as (a user of its own when cmbs runs as root, so that it shares
    nothing with the commands' users).
    """

    hidden: tuple[str, ...] = ()
    workdir_root: str | None = None
    readable: tuple[str, ...] = ()
    network: Network = "all"
    limits: Limits = field(default_factory=lambda: Limits(memory=4 << 30))
    user: str | int | None = None


class StdioAgent(Closing):
    """Starts ``command`` (through ``/bin/sh`` when it is a string) on first use.

    Each turn is written as one JSON line; the next line the program prints is its step,
    passed on verbatim. An empty line or end of output means it has nothing more to say.
    A program that exits with an error, gives no line within ``step_timeout`` seconds, or
    sends a line over ``max_line_bytes`` raises :class:`AgentProcessError` with the tail of
    its stderr (the run ends ``agent_error``). Use as an async context manager, or call
    :meth:`aclose`.

    ``isolate`` (see :data:`Isolation`) and ``sandbox`` say how it is kept in. Its
    environment is ``env`` if given, else the allow-list (``PATH``, ``LANG``, ``LC_*``,
    ``TERM``, ``TZ``) and the operator's variables named in ``pass_env`` (the model key it
    needs, say): never the rest of the operator's environment. It starts in ``cwd`` (the
    operator's current directory by default; inside the sandbox an empty one if that is a
    hidden place). Nothing it starts outlives it: at the end its input is closed, and after
    a second everything left of it is killed.
    """

    def __init__(
        self,
        command: str | Sequence[str],
        *,
        step_timeout: float = 60.0,
        max_line_bytes: int = 1 << 20,
        isolate: Isolation = "auto",
        sandbox: AgentSandbox | None = None,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        pass_env: Sequence[str] = (),
    ) -> None:
        if isolate not in ("auto", "sandbox", "group"):
            raise ValueError(f"isolate must be 'auto', 'sandbox' or 'group', not {isolate!r}")
        self.command = command
        self.label = "stdio:" + (command if isinstance(command, str) else shlex.join(command))
        self.step_timeout = step_timeout
        self.max_line_bytes = max_line_bytes
        self.isolate = isolate
        self.sandbox = sandbox or AgentSandbox()
        self.cwd = os.path.abspath(cwd or os.getcwd())
        self.env = dict(env) if env is not None else _allowed_env(pass_env)
        self._program: _Program | None = None
        self._buffer = bytearray()
        self._stopped = False

    async def next_step(self, turn: Turn) -> AgentMessage | None:
        try:
            return await self._next_step(turn)
        except anyio.get_cancelled_exc_class():
            self._stopped = True  # the deadline, say: its end gets no grace
            raise

    async def _next_step(self, turn: Turn) -> AgentMessage | None:
        program = await self._started()
        try:
            await program.send(turn.model_dump_json().encode() + b"\n")
        except OSError:  # it closed its input: its exit says whether it meant to end
            status = await program.exit_status(2)
            if status is None:
                await self._failed("closed its input")
            if status != 0:
                await self._failed(f"exited with status {status}")
        line = await self._read_line(program)
        if line is None:
            status = await program.exit_status(2)
            if status not in (0, None):
                await self._failed(f"exited with status {status}")
            return None
        text = line.decode("utf-8", "replace").strip()
        return text or None

    async def _read_line(self, program: _Program) -> bytes | None:
        searched = 0
        with anyio.move_on_after(self.step_timeout) as scope:
            while (end := self._buffer.find(b"\n", searched)) < 0:
                if len(self._buffer) > self.max_line_bytes:
                    break
                searched = len(self._buffer)
                chunk = await program.receive()
                if not chunk:
                    rest, self._buffer = bytes(self._buffer), bytearray()
                    return rest or None
                self._buffer += chunk
        if scope.cancelled_caught:
            await self._failed(f"gave no step within {self.step_timeout:g} s")
        if end < 0 or end > self.max_line_bytes:
            await self._failed(f"sent a line over {self.max_line_bytes} bytes")
        line = bytes(self._buffer[:end])
        del self._buffer[: end + 1]
        return line

    async def _started(self) -> _Program:
        if self._program is None:
            bwrap = find_bwrap() if self.isolate != "group" else None
            if self.isolate == "sandbox" and bwrap is None:
                await self._failed("could not start: isolate='sandbox' needs bubblewrap (bwrap)")
            try:
                if bwrap is None:
                    self._program = await _Grouped.start(self.command, self.cwd, self.env)
                else:
                    self._program = await _Sandboxed.start(
                        bwrap, self.command, self.cwd, self.env, self.sandbox
                    )
            except (OSError, ExecutorError) as exc:
                await self._failed(f"could not start: {getattr(exc, 'strerror', None) or exc}")
        assert self._program is not None
        return self._program

    async def _failed(self, what: str) -> NoReturn:
        kept = self._program.stderr_tail() if self._program is not None else ""
        tail = " ".join(kept[-_STDERR_SAID:].split())
        if isinstance(self._program, _Sandboxed) and _NOT_SEEN.search(kept):
            what += (  # the commonest surprise: its sandbox shows only what it was given
                " (in its sandbox an agent program sees the files named on its command line "
                "and what --agent-readable names, not their directories)"
            )
        await self.aclose()
        said = f"agent program {what}" + (f"; stderr: {tail}" if tail else "")
        raise AgentProcessError(said, stderr=kept)

    @property
    def containment(self) -> Containment | None:
        """What contains the program, as its sandbox's canary proved (``None`` before it
        starts, or on the host)."""
        return self._program.containment if isinstance(self._program, _Sandboxed) else None

    async def aclose(self) -> None:
        program, self._program = self._program, None
        if program is not None:
            with anyio.CancelScope(shield=True):
                await program.end(grace=0 if self._stopped else _GRACE)


class _Program(Protocol):
    """A running agent program: its pipes and its end."""

    async def send(self, data: bytes) -> None: ...

    async def receive(self) -> bytes:
        """The next bytes of its output; ``b""`` at its end."""

    async def exit_status(self, wait: float) -> int | None:
        """Its exit status, waiting at most ``wait`` seconds for it (``None``: still runs)."""

    def stderr_tail(self) -> str:
        """The last 64 KiB of its stderr, as text."""

    async def end(self, *, grace: float) -> None:
        """Close its input, ``grace`` seconds, then kill all of it (the caller shields
        this)."""


class _Sandboxed:
    """The program as the one job of a sandbox of its own."""

    def __init__(self, sandbox: Sandbox, job: Job, containment: Containment) -> None:
        self._sandbox = sandbox
        self._job = job
        self._stderr = _Tail()
        self._status: int | None = None
        self.containment = containment

    @classmethod
    async def start(
        cls,
        bwrap: str,
        command: str | Sequence[str],
        cwd: str,
        env: Mapping[str, str],
        options: AgentSandbox,
    ) -> _Sandboxed:
        hidden = (*default_hidden(), *options.hidden)
        out_of_sight = [*hidden, tempfile.gettempdir(), *filter(None, [options.workdir_root])]
        spec = SandboxSpec(
            workdir=None,
            root=options.workdir_root,
            user=sandbox_user(options.user) or SandboxUser.fresh(),
            hidden=hidden,
            readable=(
                *options.readable,
                *_named_files(command, cwd, unseen=out_of_sight, never=options.hidden),
            ),
            network=options.network,
            limits=options.limits,
            cwd=cwd,
        )
        sandbox = await start_sandbox(bwrap, spec, env=env)
        try:
            containment = await prove(sandbox, workdir=None, hidden=hidden, kill_grace=_GRACE)
            job = await sandbox.run(command, env=env, cwd=cwd, stdin=True)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await sandbox.aclose()
            raise
        return cls(sandbox, job, containment)

    async def send(self, data: bytes) -> None:
        assert self._job.stdin is not None
        view = memoryview(data)
        while view:
            try:
                view = view[os.write(self._job.stdin, view) :]
            except BlockingIOError:
                await self._either(self._job.stdin, writable=True)

    async def receive(self) -> bytes:
        while True:
            try:
                return os.read(self._job.stdout, 65536)
            except BlockingIOError:
                await self._either(self._job.stdout)

    async def _either(self, fd: int, *, writable: bool = False) -> None:
        """Wait until ``fd`` is ready, taking the program's stderr meanwhile (a program
        that writes much there must never block on it)."""
        async with anyio.create_task_group() as tg:

            async def ready() -> None:
                await (anyio.wait_writable(fd) if writable else anyio.wait_readable(fd))
                tg.cancel_scope.cancel()

            tg.start_soon(ready)
            while True:
                await anyio.wait_readable(self._job.stderr)
                if not self._stderr.take(self._job.stderr):
                    await anyio.sleep_forever()  # its end: wait for the other

    async def exit_status(self, wait: float) -> int | None:
        if self._status is None:
            with anyio.move_on_after(wait):
                self._status = (await self._sandbox.wait(self._job)).status
        return self._status

    def stderr_tail(self) -> str:
        self._stderr.take(self._job.stderr)
        return self._stderr.text()

    async def end(self, *, grace: float) -> None:
        self._job.close_stdin()
        if grace:
            await self.exit_status(grace)
        self._job.close()
        await self._sandbox.aclose()


class _Tail:
    """The last bytes of a stream, taken without blocking."""

    def __init__(self) -> None:
        self._kept = bytearray()

    def take(self, fd: int) -> bool:
        """Read what ``fd`` has now; false once it is at its end."""
        while True:
            try:
                chunk = os.read(fd, 65536)
            except (BlockingIOError, OSError):
                return True
            if not chunk:
                return False
            self._kept += chunk
            del self._kept[:-_STDERR_KEPT]

    def text(self) -> str:
        return self._kept.decode("utf-8", "replace")


class _Grouped:
    """The program on the host as it is, in a process group of its own (a ``setsid``
    escapes it): where there is no bubblewrap, or ``isolate="group"``."""

    def __init__(self, process: Process, stderr: IO[bytes]) -> None:
        self._process = process
        self._stderr = stderr

    @classmethod
    async def start(
        cls, command: str | Sequence[str], cwd: str, env: Mapping[str, str]
    ) -> _Grouped:
        # stderr goes to a file, not a pipe: a chatty program can never block on it
        stderr = tempfile.TemporaryFile()
        try:
            process = await anyio.open_process(
                command,
                cwd=cwd,
                env=dict(env),
                start_new_session=True,
                stderr=stderr,
            )
        except BaseException:
            stderr.close()
            raise
        return cls(process, stderr)

    async def send(self, data: bytes) -> None:
        assert self._process.stdin is not None
        try:
            await self._process.stdin.send(data)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError) as exc:
            raise OSError("closed") from exc

    async def receive(self) -> bytes:
        assert self._process.stdout is not None
        try:
            return await self._process.stdout.receive()
        except anyio.EndOfStream:
            return b""

    async def exit_status(self, wait: float) -> int | None:
        with anyio.move_on_after(wait):
            await self._process.wait()
        return self._process.returncode

    def stderr_tail(self) -> str:
        self._stderr.seek(0, os.SEEK_END)
        self._stderr.seek(max(self._stderr.tell() - _STDERR_KEPT, 0))
        return self._stderr.read().decode("utf-8", "replace")

    async def end(self, *, grace: float) -> None:
        """TERM the group, ``grace`` seconds, then KILL whatever is left of it."""
        group = self._process.pid
        _signal_group(group, signal.SIGTERM)
        with anyio.move_on_after(grace) as waited:
            await self._gone()
        if waited.cancelled_caught:
            _signal_group(group, signal.SIGKILL)
            with anyio.move_on_after(_GRACE):
                await self._gone()
        if self._process.returncode is None:
            with suppress(ProcessLookupError):
                self._process.kill()
        await self._process.aclose()
        self._stderr.close()

    async def _gone(self) -> None:
        await self._process.wait()
        # no event says a group is empty (its members are not our children): poll /proc
        while _running_in_group(self._process.pid):  # noqa: ASYNC110
            await anyio.sleep(0.05)


def _allowed_env(pass_env: Sequence[str], source: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The allow-list of the operator's environment, and the names the agent is given."""
    return {
        name: value
        for name, value in source.items()
        if name in ALLOWED_ENV or name.startswith("LC_") or name in pass_env
    }


def _named_files(
    command: str | Sequence[str], cwd: str, *, unseen: Sequence[str], never: Sequence[str]
) -> list[str]:
    """The files a command line names (its script, say) that lie where the sandbox would
    not show them (``unseen``), as absolute paths; never one of the secrets ``never``
    names (the signing key, the audit database), even if named."""
    try:
        words = shlex.split(command) if isinstance(command, str) else list(command)
    except ValueError:
        return []
    places = [os.path.realpath(place) for place in unseen]
    secrets = [os.path.realpath(secret) for secret in never]
    named = []
    for word in words:
        path = os.path.realpath(os.path.join(cwd, word))
        shown = any(_under(path, tool) for tool in TOOL_DIRS)  # the interpreter, say
        secret = any(_under(path, hidden) for hidden in secrets)
        if os.path.isfile(path) and not (shown or secret) and any(_under(path, p) for p in places):
            named.append(os.path.abspath(os.path.join(cwd, word)))
    return named


def _under(path: str, place: str) -> bool:
    return path == place or path.startswith(place.rstrip("/") + "/")


def _signal_group(pgid: int, signum: int) -> None:
    with suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signum)


def _running_in_group(pgid: int) -> bool:
    """Whether a process of group ``pgid`` still runs (zombies do not count: where pid 1
    does not reap orphans, they stay forever)."""
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as handle:
                state, _, group = handle.read().rsplit(")", 1)[1].split()[:3]
        except OSError:  # gone
            continue
        if int(group) == pgid and state != "Z":
            return True
    return False
