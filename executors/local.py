"""The local executor: shell commands as subprocesses in their own process group."""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Mapping
from pathlib import Path

import anyio
from anyio.abc import ByteReceiveStream, Process

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

__all__ = ["LocalExecutor"]


class LocalExecutor:
    """Runs commands with ``/bin/sh -c`` in the workdir and writes artifacts inside it.

    Every command starts a new session, so the whole process group (grandchildren too)
    is killed on timeout, on cancellation, and when the command's shell exits: TERM,
    ``kill_grace`` seconds, then KILL. Output is capped at ``output_cap`` bytes per
    stream, and reading stops ``drain_grace`` seconds after the shell exits even if a
    grandchild still holds the pipe.
    """

    def __init__(
        self,
        *,
        output_cap: int = DEFAULT_OUTPUT_CAP,
        kill_grace: float = 0.5,
        drain_grace: float = 0.2,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.output_cap = output_cap
        self.kill_grace = kill_grace
        self.drain_grace = drain_grace
        self.env = dict(env) if env is not None else None

    async def prepare(self, workdir: str | None, files: Mapping[str, str]) -> str:
        try:
            if workdir is None:
                workdir = await anyio.to_thread.run_sync(lambda: tempfile.mkdtemp(prefix="cmbs-"))
            else:
                await anyio.Path(workdir).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ExecutorError(f"cannot create workdir {workdir}: {exc.strerror}") from exc
        await seed_files(self, workdir, files)
        return workdir

    async def cleanup(self, workdir: str) -> None:
        await anyio.to_thread.run_sync(lambda: shutil.rmtree(workdir, ignore_errors=True))

    async def write_artifact(self, workdir: str, path: str, content: str) -> Observation:
        start = anyio.current_time()
        try:
            await anyio.to_thread.run_sync(_write_confined, workdir, path, content)
        except PathRefused as exc:
            return refused_artifact(path, str(exc))
        except OSError as exc:
            return refused_artifact(path, f"cannot write {path!r}: {exc.strerror or exc}")
        return Observation(
            kind="artifact",
            path=path,
            success=True,
            duration_s=anyio.current_time() - start,
        )

    async def run_command(
        self, workdir: str, command: str, *, timeout: float | None
    ) -> Observation:
        start = anyio.current_time()
        stdout, stderr = OutputBuffer(self.output_cap), OutputBuffer(self.output_cap)
        try:
            process = await anyio.open_process(
                ["/bin/sh", "-c", command],
                cwd=workdir,
                env=self.env,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        except OSError as exc:
            return Observation(
                kind="command",
                command=command,
                success=False,
                error=f"cannot start /bin/sh: {exc.strerror or exc}",
            )
        timed_out = False
        try:
            with anyio.move_on_after(timeout) as scope:
                await self._collect(process, stdout, stderr)
            timed_out = scope.cancelled_caught
        finally:
            with anyio.CancelScope(shield=True):
                await self._reap(process)
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

    async def _reap(self, process: Process) -> None:
        """Kill what is left of the command's process group, then release the process."""
        group = process.pid
        for signum in (signal.SIGTERM, signal.SIGKILL):
            if not _signal_group(group, signum):
                break
            with anyio.move_on_after(self.kill_grace):
                while _group_alive(group):  # noqa: ASYNC110 - no event tells a group is gone
                    await anyio.sleep(0.01)
        with anyio.move_on_after(self.kill_grace):
            await process.wait()
        if process.returncode is None:
            process.kill()
        await process.aclose()


def _signal_group(group: int, signum: int) -> bool:
    try:
        os.killpg(group, signum)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def _group_alive(group: int) -> bool:
    """Whether any process of the group is still running (zombies do not count)."""
    try:
        os.killpg(group, 0)
    except (ProcessLookupError, PermissionError):
        return False
    proc = Path("/proc")
    if not proc.is_dir():
        return True
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == group and fields[0] != "Z":
            return True
    return False


def _write_confined(workdir: str, path: str, content: str) -> None:
    """Write inside ``workdir`` only: no absolute path, no ``..``, no symlink leading out."""
    relative = confine(path)
    root = os.path.realpath(workdir)
    parent = os.path.realpath(os.path.join(root, *relative.parts[:-1]))
    if os.path.commonpath([root, parent]) != root:
        raise PathRefused(f"artifact path {path!r} leads outside the workdir through a link")
    os.makedirs(parent, exist_ok=True)
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(os.path.join(parent, relative.name), flags, 0o644)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # the final component is a symbolic link
            raise PathRefused(f"artifact path {path!r} is a symbolic link") from exc
        raise
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        handle.write(content)
