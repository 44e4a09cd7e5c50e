"""The local executor: each shell command in a bubblewrap sandbox (see
:mod:`executors.sandbox`), or, without one, in its own process group."""

from __future__ import annotations

import os
import re
import signal
import subprocess
from collections.abc import Mapping, Sequence
from functools import partial

import anyio
from anyio.abc import ByteReceiveStream, Process

from .base import (
    DEFAULT_OUTPUT_CAP,
    Closing,
    OutputBuffer,
    PathRefused,
    refused_artifact,
    seed_files,
)
from .observation import CommandEnv, Observation
from .sandbox import (
    INSTALL_HINT,
    SANDBOX_HOME,
    SandboxMode,
    SandboxUnavailable,
    bwrap_argv,
    check_workdir,
    command_env,
    default_hidden,
    find_bwrap,
)
from .workdir import Workdirs

__all__ = ["LocalExecutor"]

_CHILD_PID = re.compile(rb'"child-pid":\s*(\d+)')


class LocalExecutor(Closing):
    """Runs commands with ``/bin/sh -c`` in the workdir and writes artifacts inside it.

    ``sandbox``: ``"bwrap"`` runs every command in a bubblewrap sandbox (its own PID
    namespace: when its shell exits, or on a time-out or cancellation, every process it
    started dies with it); ``"none"`` runs it in a new session whose process group is
    killed (TERM, ``kill_grace`` seconds, KILL), which a command that calls ``setsid``
    escapes; ``"auto"`` (the default) takes bwrap where it works here, else none, which
    :attr:`containment` then says. ``hidden`` names paths a sandboxed command must not
    see, besides the operator's home and the cmbs data directory. Output is capped at
    ``output_cap`` bytes per stream; reading stops ``drain_grace`` seconds after the
    shell exits even if something still holds the pipe.
    """

    def __init__(
        self,
        *,
        sandbox: SandboxMode = "auto",
        hidden: Sequence[str] = (),
        output_cap: int = DEFAULT_OUTPUT_CAP,
        kill_grace: float = 0.5,
        drain_grace: float = 0.2,
    ) -> None:
        if sandbox not in ("auto", "bwrap", "none"):
            raise ValueError(f"sandbox must be auto, bwrap or none, not {sandbox!r}")
        bwrap = find_bwrap() if sandbox != "none" else None
        if sandbox == "bwrap" and bwrap is None:
            raise SandboxUnavailable(
                f"bubblewrap (bwrap) is not available here; install it: {INSTALL_HINT}"
            )
        self._bwrap = bwrap
        self._hidden = (*default_hidden(), *hidden)
        self.output_cap = output_cap
        self.kill_grace = kill_grace
        self.drain_grace = drain_grace
        self._workdirs = Workdirs()

    @property
    def containment(self) -> str:
        """``"bwrap"`` or ``"none"``: what contains this executor's commands."""
        return "bwrap" if self._bwrap is not None else "none"

    async def prepare(self, workdir: str | None, files: Mapping[str, str]) -> str:
        """Create the workdir and hold it open (see :mod:`executors.workdir`), then seed it.

        Sandboxed, a workdir that would expose what the sandbox hides is refused.
        """
        if workdir is not None and self._bwrap is not None:
            check_workdir(workdir, hidden=self._hidden)
        prepared = await anyio.to_thread.run_sync(self._workdirs.open, workdir)
        try:
            await seed_files(self, prepared, files)
        except BaseException:
            with anyio.CancelScope(shield=True):
                release = partial(self._workdirs.release, prepared, remove=workdir is None)
                await anyio.to_thread.run_sync(release)
            raise
        return prepared

    async def cleanup(self, workdir: str, *, remove: bool = True) -> None:
        await anyio.to_thread.run_sync(partial(self._workdirs.release, workdir, remove=remove))

    async def aclose(self) -> None:
        """Let go of every workdir still held (none is deleted)."""
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(self._workdirs.release_all)

    async def write_artifact(self, workdir: str, path: str, content: str) -> Observation:
        start = anyio.current_time()
        try:
            data = content.encode()
            await anyio.to_thread.run_sync(self._workdirs.write, workdir, path, data)
        except PathRefused as exc:
            return refused_artifact(path, str(exc))
        except UnicodeError:
            return refused_artifact(path, f"cannot write {path!r}: not valid UTF-8")
        except OSError as exc:
            return refused_artifact(path, f"cannot write {path!r}: {exc.strerror or exc}")
        return Observation(
            kind="artifact",
            path=path,
            success=True,
            duration_s=anyio.current_time() - start,
        )

    async def run_command(
        self, workdir: str, command: str, *, timeout: float | None, env: CommandEnv | None = None
    ) -> Observation:
        start = anyio.current_time()
        stdout, stderr = OutputBuffer(self.output_cap), OutputBuffer(self.output_cap)
        try:
            process, sandbox = await self._start(workdir, command, env or CommandEnv())
        except (OSError, ValueError) as exc:  # ValueError: a NUL byte in the command
            return Observation(
                kind="command",
                command=command,
                success=False,
                error=f"cannot start the command: {getattr(exc, 'strerror', None) or exc}",
                duration_s=anyio.current_time() - start,
            )
        timed_out = False
        try:
            with anyio.move_on_after(timeout) as scope:
                await self._collect(process, stdout, stderr)
            timed_out = scope.cancelled_caught
        finally:
            with anyio.CancelScope(shield=True):
                await self._reap(process, sandbox)
        status = process.returncode
        found = None if timed_out or status is None or status < 0 else status != 127
        return Observation(
            kind="command",
            command=command,
            success=not timed_out and status == 0,
            exit_status=status,
            program_found=found,
            timed_out=timed_out,
            error=f"command timed out after {timeout:g} s" if timed_out else None,
            stdout=stdout.output(),
            stderr=stderr.output(),
            duration_s=anyio.current_time() - start,
        )

    async def _start(
        self, workdir: str, command: str, declared: CommandEnv
    ) -> tuple[Process, _Sandbox | None]:
        shell = ["/bin/sh", "-c", command]
        if self._bwrap is None:
            process = await anyio.open_process(
                shell,
                cwd=workdir,
                env=command_env(declared, home=None),
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
            return process, None
        where = str(await anyio.Path(workdir).resolve())
        info_read, info_write = os.pipe()
        try:
            argv = bwrap_argv(
                self._bwrap,
                where,
                hidden=self._hidden,
                readable=declared.readable,
                env=command_env(declared, home=SANDBOX_HOME),
                network=declared.network,
                info_fd=info_write,
            )
            process = await anyio.open_process(
                [*argv, *shell],
                env={},
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                pass_fds=(info_write,),
            )
        except BaseException:
            os.close(info_read)
            raise
        finally:
            os.close(info_write)
        return process, _Sandbox(info_read)

    async def _collect(self, process: Process, stdout: OutputBuffer, stderr: OutputBuffer) -> None:
        drained = anyio.Event()
        open_pipes = 2

        async def drain(stream: ByteReceiveStream | None, into: OutputBuffer) -> None:
            nonlocal open_pipes
            if stream is not None:
                async for chunk in stream:
                    into.feed(chunk)
            open_pipes -= 1
            if open_pipes == 0:
                drained.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(drain, process.stdout, stdout)
            tg.start_soon(drain, process.stderr, stderr)
            await process.wait()
            # A grandchild left running may hold the pipes open: stop reading soon.
            with anyio.move_on_after(self.drain_grace):
                await drained.wait()
            tg.cancel_scope.cancel()

    async def _reap(self, process: Process, sandbox: _Sandbox | None) -> None:
        """Make sure nothing the command started is left, then release the process."""
        if sandbox is not None:
            with sandbox:
                await sandbox.end(process, self.kill_grace)
        else:
            await self._kill_group(process)
        with anyio.move_on_after(self.kill_grace):
            await process.wait()
        if process.returncode is None:
            process.kill()
        await process.aclose()

    async def _kill_group(self, process: Process) -> None:
        """TERM the process group, a grace, then KILL what is left of it."""
        group = process.pid
        for signum in (signal.SIGTERM, signal.SIGKILL):
            if not _signal_group(group, signum):
                return
            with anyio.move_on_after(self.kill_grace):
                await process.wait()  # the shell itself, so its zombie does not count
                delay = 0.005
                while _signal_group(group, 0):
                    await anyio.sleep(delay)
                    delay = min(delay * 2, 0.1)
                return


class _Sandbox:
    """The handle on one command's bwrap sandbox: its info pipe tells the sandbox's init."""

    def __init__(self, info_fd: int) -> None:
        self._info = info_fd

    async def end(self, process: Process, grace: float) -> None:
        """KILL the sandbox if it still runs; wait (at most ``grace``) for its PID namespace
        to be empty.

        bwrap may return as soon as the command's shell exits; the namespace's init dies
        after it, and only once the init is gone has the kernel killed every process of
        the namespace. So the wait is on the init (a pidfd), in every case.
        """
        init = self._init_pidfd()
        if process.returncode is None:
            _signal_group(process.pid, signal.SIGKILL)  # bwrap and its init: same group
        if init is None:
            return
        try:
            with anyio.move_on_after(grace):
                await anyio.wait_readable(init)
        finally:
            os.close(init)

    def _init_pidfd(self) -> int | None:
        os.set_blocking(self._info, False)
        try:
            found = _CHILD_PID.search(os.read(self._info, 4096))
            return os.pidfd_open(int(found.group(1))) if found else None
        except OSError:  # not written yet (nothing started), or the init is gone already
            return None

    def __enter__(self) -> _Sandbox:
        return self

    def __exit__(self, *exc_info: object) -> None:
        os.close(self._info)


def _signal_group(group: int, signum: int) -> bool:
    """Send ``signum`` (0: just look) to the group; false once none of it is left."""
    try:
        os.killpg(group, signum)
    except (ProcessLookupError, PermissionError):
        return False
    return True
