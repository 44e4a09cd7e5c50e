"""The local executor: each scenario's commands in a sandbox of its own (see
:mod:`executors.sandbox` and :mod:`executors.sandboxes`), or, without one, each command
in its own process group."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from contextlib import suppress
from functools import partial
from pathlib import Path
from pwd import getpwuid
from typing import TYPE_CHECKING

import anyio
from anyio.abc import Process

from . import snapshot
from .base import (
    DEFAULT_OUTPUT_CAP,
    Closing,
    OutputBuffer,
    PathRefused,
    refused_artifact,
    seed_files,
)
from .canary import prove
from .errors import CleanupFailed, ExecutorError
from .events import EventLogger
from .observation import CommandEnv, Containment, FileChange, InputFile, Observation, Program
from .pipes import read_pipes
from .sandbox import (
    INSTALL_HINT,
    SANDBOX_HOME,
    SandboxMode,
    SandboxSpec,
    SandboxUnavailable,
    SandboxUser,
    check_root,
    check_workdir,
    command_env,
    default_hidden,
    find_bwrap,
    sandbox_user,
)
from .sandboxes import Exit, Run, Sandbox, SandboxBroken, start_sandbox
from .snapshot import diff, identify, locate, take
from .workdir import Workdirs

if TYPE_CHECKING:
    from .snapshot import Snapshot

__all__ = ["LocalExecutor"]

_log = EventLogger("cmbs_async.sandbox")

#: How a limit a command ran into is said in its observation.
_LIMITS = {
    "pids": "ran into the scenario's process limit ({} processes)",
    "memory": "ran into the scenario's memory limit ({} bytes)",
    "tmp": "filled the scenario's /tmp ({} bytes)",
    "shm": "filled the scenario's /dev/shm ({} bytes)",
}


class LocalExecutor(Closing):
    """Runs commands with ``/bin/sh -c`` in the workdir and writes artifacts inside it.

    ``sandbox``: ``"bwrap"`` gives each prepared workdir (each scenario) a bubblewrap
    sandbox, proven by a canary before anything runs in it; its commands run as ``user``
    (by default, as root, a fresh user of the workdir's own: :meth:`SandboxUser.fresh`),
    each in a PID namespace of its own, so that when it exits, or on a time-out or
    cancellation, every process it started dies with it.
    ``"none"`` runs each command in a new session whose process group is killed (TERM,
    ``kill_grace`` seconds, KILL), which a command that calls ``setsid`` escapes;
    ``"auto"`` (the default) takes bwrap where it works here, else none, which
    :attr:`containment` then says.

    Workdirs live under ``workdir_root`` (by default a fresh temporary directory, removed
    with the executor once empty): a workdir elsewhere is refused. ``hidden`` names paths
    a sandboxed command must not see, besides the operator's home and the cmbs data
    directory (name an audit database's ``-wal`` and ``-shm`` files too). Output is capped
    at ``output_cap`` bytes per stream; reading stops ``drain_grace`` seconds after a
    command ends even if something still holds the pipe (taking what the pipe holds then).
    """

    def __init__(
        self,
        *,
        sandbox: SandboxMode = "auto",
        hidden: Sequence[str] = (),
        workdir_root: str | None = None,
        user: str | int | SandboxUser | None = None,
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
        self._user = sandbox_user(user) if bwrap is not None else None
        self._hidden = (*default_hidden(), *hidden)
        self._root_given = os.path.realpath(workdir_root) if workdir_root is not None else None
        if self._root_given is not None:
            check_root(self._root_given, hidden=self._hidden)
        self._root: str | None = None
        self._made: str | None = None  # the topmost directory making the given root made
        self.output_cap = output_cap
        self.kill_grace = kill_grace
        self.drain_grace = drain_grace
        self._workdirs = Workdirs()
        self._users: dict[str, SandboxUser] = {}  # who each prepared workdir's commands run as
        self._sandboxes: dict[tuple[str, str], Sandbox] = {}
        self._starting: dict[tuple[str, str], anyio.Lock] = {}
        self._reports: dict[str, Containment] = {}
        self._declared: dict[str, CommandEnv] = {}  # what prepare was told, by workdir
        self._snapshots: dict[str, Snapshot] = {}  # what each held workdir holds, as last seen

    @property
    def containment(self) -> str:
        """``"bwrap"`` or ``"none"``: what contains this executor's commands."""
        return "bwrap" if self._bwrap is not None else "none"

    @property
    def workdir_root(self) -> str:
        """Where this executor's workdirs live (made on first use: a fresh temporary
        directory if none was given)."""
        if self._root is None:
            if self._root_given is None:
                self._root = os.path.realpath(tempfile.mkdtemp(prefix="cmbs-workdirs-"))
            else:
                given = Path(self._root_given)
                made = next((p for p in (*reversed(given.parents), given) if not p.exists()), None)
                try:
                    os.makedirs(given, mode=0o700, exist_ok=True)
                except OSError as exc:
                    raise ExecutorError(
                        f"cannot make the workdir root {given}: {exc.strerror}"
                    ) from None
                self._made = str(made) if made is not None else None
                self._root = self._root_given
        return self._root

    @property
    def user(self) -> SandboxUser | None:
        """Who every sandboxed command runs as, if one user is fixed (named, or the operator
        where cmbs does not run as root); ``None`` where each workdir gets a user of its
        own (:meth:`SandboxUser.fresh`), and without a sandbox."""
        return self._user

    async def prepare(
        self, workdir: str | None, files: Mapping[str, str], *, env: CommandEnv | None = None
    ) -> str:
        """Create the workdir under the root and hold it open (see :mod:`executors.workdir`),
        seed it, and, sandboxed, start its sandbox and prove it with the canary.

        A workdir outside the root, or one that would expose what the sandbox hides, is
        refused (:class:`ExecutorError`); a sandbox that leaks raises :class:`SandboxLeak`.
        """
        root = self.workdir_root
        if workdir is not None:
            workdir = self.check_workdir(workdir)
        user = (self._user or SandboxUser.fresh()) if self._bwrap is not None else None
        owner = (user.uid, user.gid) if user is not None and user.uid != os.geteuid() else None
        open_ = partial(self._workdirs.open, workdir, root=root, owner=owner)
        prepared = await anyio.to_thread.run_sync(open_)
        if user is not None:
            self._users[prepared] = user
        try:
            await seed_files(self, prepared, files)
            self._snapshots[prepared] = await anyio.to_thread.run_sync(take, prepared)
            self._declared[prepared] = env or CommandEnv()
            if self._bwrap is not None:
                await self._sandbox(prepared, self._declared[prepared])
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self._forget(prepared)
                release = partial(self._workdirs.release, prepared, remove=workdir is None)
                with suppress(CleanupFailed):
                    await anyio.to_thread.run_sync(release)
            raise
        return prepared

    def check_workdir(self, workdir: str) -> str:
        """Where ``workdir`` lies (a relative one: under the root), or :class:`ExecutorError`
        if it is outside the root or would expose what the sandbox hides."""
        path = os.path.join(self.workdir_root, workdir)
        check_workdir(path, hidden=self._hidden, root=self.workdir_root)
        return path

    def containment_of(self, workdir: str) -> Containment:
        found = self._reports.get(workdir)
        if found is not None:
            return found
        if self._bwrap is not None:  # not prepared: nothing is proven yet
            return Containment(sandbox="bwrap", user=str(self._users.get(workdir, self._user)))
        me = getpwuid(os.geteuid())
        return Containment(sandbox="none", user=f"{me.pw_name} ({me.pw_uid})")

    async def cleanup(self, workdir: str, *, remove: bool = True) -> None:
        await self._forget(workdir)
        await anyio.to_thread.run_sync(partial(self._workdirs.release, workdir, remove=remove))

    async def aclose(self) -> None:
        """Close every sandbox and let go of every workdir still held (none is deleted);
        the workdir root goes if it is empty and was made here (a temporary one, or a
        given one that did not exist)."""
        with anyio.CancelScope(shield=True):
            sandboxes, self._sandboxes = self._sandboxes, {}
            for sandbox in sandboxes.values():
                await sandbox.aclose()
            await anyio.to_thread.run_sync(self._workdirs.release_all)
            if self._root is not None and self._root_given is None:
                with suppress(OSError):
                    os.rmdir(self._root)
            elif self._made is not None and self._root is not None:  # what it made, if empty
                for path in (self._root, *map(str, Path(self._root).parents)):
                    with suppress(OSError):
                        os.rmdir(path)
                    if path == self._made:
                        break

    async def write_artifact(self, workdir: str, path: str, content: str) -> Observation:
        start = anyio.current_time()
        if not self._workdirs.holds(workdir):  # not prepared here: under the root, or refused
            self.check_workdir(workdir)
        before = await self._snapshot(workdir)
        try:
            data = content.encode()
            await anyio.to_thread.run_sync(self._workdirs.write, workdir, path, data)
        except PathRefused as exc:
            return refused_artifact(path, str(exc))
        except UnicodeError:
            return refused_artifact(path, f"cannot write {path!r}: not valid UTF-8")
        except OSError as exc:
            return refused_artifact(path, f"cannot write {path!r}: {exc.strerror or exc}")
        observed = Observation(
            kind="artifact", path=path, success=True, duration_s=anyio.current_time() - start
        )
        return await self._changed(workdir, before, observed)

    async def run_command(
        self, workdir: str, command: str, *, timeout: float | None, env: CommandEnv | None = None
    ) -> Observation:
        start = anyio.current_time()
        if "\x00" in command:
            return _not_started(command, "a NUL byte in the command", start)
        before = await self._snapshot(workdir)
        observed = await self._run(workdir, command, command, timeout, env, start)
        return await self._changed(workdir, before, observed)

    async def run_program(
        self,
        workdir: str,
        argv: Sequence[str],
        *,
        timeout: float | None,
        env: CommandEnv | None = None,
        inputs: Sequence[str] = (),
    ) -> Observation:
        start = anyio.current_time()
        command = shlex.join(argv)
        if not argv or not argv[0].startswith("/") or any("\x00" in arg for arg in argv):
            return _not_started(
                command, "not an absolute program path and NUL-free arguments", start
            )
        before = await self._snapshot(workdir)
        real = str(await anyio.Path(workdir).resolve())
        named = await anyio.to_thread.run_sync(partial(_identify_all, real, inputs))
        observed = await self._run(workdir, list(argv), command, timeout, env, start)
        observed = observed.model_copy(update={"argv": tuple(argv), "inputs": named})
        return await self._changed(workdir, before, observed)

    async def resolve_program(
        self, workdir: str, name: str, *, env: CommandEnv | None = None
    ) -> Program | None:
        declared = env or self._declared.get(workdir) or CommandEnv()
        search = command_env(declared, home=None)["PATH"]
        if self._bwrap is None:  # commands run as the operator: only their workdirs are out
            found = await anyio.to_thread.run_sync(
                partial(locate, name, search, [self.workdir_root], None)
            )
            return Program.model_validate(found) if found is not None else None
        # in the sandbox, as its commands: what they see, and what they could write there
        argv = [sys.executable, "-I", "-S", snapshot.__file__, name, search, workdir]
        observed = await self._run(
            workdir, argv, shlex.join(argv), 60, declared, anyio.current_time()
        )
        if not observed.success:
            raise ExecutorError(f"cannot look for {name} in the sandbox: {observed.summary()}")
        found = json.loads(observed.stdout.text or "null")
        return Program.model_validate(found) if found is not None else None

    async def _run(
        self,
        workdir: str,
        command: str | list[str],
        said: str,
        timeout: float | None,
        env: CommandEnv | None,
        start: float,
    ) -> Observation:
        """Run ``command`` (a shell command, or an argument vector) as the workdir's
        commands run; its observation says it as ``said``."""
        declared = env or self._declared.get(workdir) or CommandEnv()
        if self._bwrap is None:
            return await self._run_bare(workdir, command, said, timeout, declared, start)
        real = await anyio.Path(workdir).resolve()
        sandbox = await self._sandbox(str(real), declared)
        stdout, stderr = OutputBuffer(self.output_cap), OutputBuffer(self.output_cap)
        ran = await Run.start(sandbox, command, command_env(declared, home=SANDBOX_HOME), workdir)
        if isinstance(ran, str):
            return _not_started(said, ran, start)
        try:
            with anyio.move_on_after(timeout) as scope:
                await ran.collect(stdout, stderr, self.drain_grace)
        except BaseException:  # cancelled: KILL it; its end needs no witness (nor waiting)
            ran.abandon()
            raise
        with anyio.CancelScope(shield=True):
            await ran.end(self.kill_grace)
        timed_out = scope.cancelled_caught
        observed = self._observed(
            said, ran.exit, sandbox, timed_out, timeout, stdout, stderr, start
        )
        if sandbox.broker is not None:  # network by allow-list: what it refused, said
            observed = await sandbox.broker.observe(observed)
        return observed

    # -- what the workdir holds -------------------------------------------------------
    async def _snapshot(self, workdir: str) -> Snapshot:
        """The workdir as the last action left it (taken now if none was)."""
        found = self._snapshots.get(workdir)
        if found is None:
            found = await anyio.to_thread.run_sync(take, workdir)
        return found

    async def _changed(self, workdir: str, before: Snapshot, observed: Observation) -> Observation:
        """``observed`` with what the action changed in the workdir since ``before``."""
        after = await anyio.to_thread.run_sync(take, workdir, before)
        if self._workdirs.holds(workdir):
            self._snapshots[workdir] = after
        changes = tuple(FileChange.model_validate(change) for change in diff(before, after))
        complete = "" not in after and "" not in before
        return observed.model_copy(update={"changes": changes, "changes_complete": complete})

    # -- the sandbox of a workdir -------------------------------------------------------
    async def _sandbox(self, workdir: str, env: CommandEnv) -> Sandbox:
        """The sandbox of ``workdir`` for what ``env`` declares (made and proven once)."""
        assert self._bwrap is not None
        key = (workdir, env.model_dump_json(include={"network", "readable", "limits"}))
        found = self._sandboxes.get(key)
        if found is not None:
            return found
        lock = self._starting.setdefault(key, anyio.Lock())
        async with lock:
            found = self._sandboxes.get(key)
            if found is not None:
                return found
            check_workdir(workdir, hidden=self._hidden, root=self.workdir_root)
            spec = SandboxSpec.of(
                workdir,
                env,
                root=self.workdir_root,
                user=self._users.get(workdir) or self._user or SandboxUser.fresh(),
                hidden=self._hidden,
            )
            try:
                sandbox = await start_sandbox(
                    self._bwrap, spec, env=command_env(env, home=SANDBOX_HOME)
                )
            except SandboxBroken as exc:
                raise ExecutorError(str(exc)) from None
            try:
                self._reports[workdir] = await self._prove(sandbox, workdir, env)
            except BaseException:
                with anyio.CancelScope(shield=True):
                    await sandbox.aclose()
                raise
            self._sandboxes[key] = sandbox
        self._starting.pop(key, None)
        return sandbox

    async def _prove(self, sandbox: Sandbox, workdir: str, env: CommandEnv) -> Containment:
        """Run the canary in the new sandbox: its report, or :class:`SandboxLeak`."""
        spec = sandbox.spec
        unasked = {"pids", "memory"} - sandbox.limits.keys()
        asked = unasked & env.limits.model_fields_set - {
            name for name in unasked if getattr(env.limits, name) is None
        }
        if asked:
            raise ExecutorError(
                f"the {' and '.join(sorted(asked))} limit cannot be enforced here: "
                f"{sandbox.unenforced}"
            )
        if unasked and any(getattr(spec.limits, name) is not None for name in unasked):
            _log.info("sandbox.limits_not_enforced", limits=sorted(unasked), why=sandbox.unenforced)
        return await prove(
            sandbox, workdir=workdir, hidden=self._hidden, kill_grace=self.kill_grace
        )

    async def _forget(self, workdir: str) -> None:
        """Close the sandboxes of ``workdir``."""
        self._reports.pop(workdir, None)
        self._declared.pop(workdir, None)
        self._snapshots.pop(workdir, None)
        self._users.pop(workdir, None)
        for key in [key for key in self._sandboxes if key[0] == workdir]:
            await self._sandboxes.pop(key).aclose()

    def _observed(
        self,
        command: str,
        exit: Exit | None,
        sandbox: Sandbox,
        timed_out: bool,
        timeout: float | None,
        stdout: OutputBuffer,
        stderr: OutputBuffer,
        start: float,
    ) -> Observation:
        status = exit.status if exit is not None else None
        hit = exit.limits_hit if exit is not None else ()
        limits = sandbox.limits
        said = [_LIMITS[name].format(limits.get(name, "?")) for name in hit if name in _LIMITS]
        if timed_out:
            said.insert(0, f"command timed out after {timeout:g} s")
        return Observation(
            kind="command",
            command=command,
            success=not timed_out and status == 0 and not hit,
            exit_status=status,
            program_found=None if timed_out or status is None else status != 127,
            timed_out=timed_out,
            error="; ".join(said) or None,
            limits_hit=hit,
            stdout=stdout.output(),
            stderr=stderr.output(),
            duration_s=anyio.current_time() - start,
        )

    # -- without a sandbox ------------------------------------------------------------
    async def _run_bare(
        self,
        workdir: str,
        command: str | list[str],
        said: str,
        timeout: float | None,
        declared: CommandEnv,
        start: float,
    ) -> Observation:
        check_workdir(workdir, hidden=(), root=self.workdir_root)
        stdout, stderr = OutputBuffer(self.output_cap), OutputBuffer(self.output_cap)
        out, err = _pipe(), _pipe()
        try:
            process = await anyio.open_process(
                ["/bin/sh", "-c", command] if isinstance(command, str) else command,
                cwd=workdir,
                env=command_env(declared, home=None),
                stdin=subprocess.DEVNULL,
                stdout=out[1],
                stderr=err[1],
                start_new_session=True,
            )
        except BaseException as exc:
            for fd in (*out, *err):
                os.close(fd)
            if isinstance(exc, OSError):
                return _not_started(said, exc.strerror or str(exc), start)
            raise
        os.close(out[1])
        os.close(err[1])

        async def ended() -> bool:
            await process.wait()
            return True

        pipes = [(out[0], stdout), (err[0], stderr)]
        try:
            with anyio.move_on_after(timeout) as scope:
                await read_pipes(pipes, ended, grace=self.drain_grace)
            timed_out = scope.cancelled_caught
        finally:
            with anyio.CancelScope(shield=True):
                await self._kill_group(process)
                with anyio.move_on_after(self.kill_grace):
                    await process.wait()
                if process.returncode is None:
                    process.kill()
                await process.aclose()
            os.close(out[0])
            os.close(err[0])
        status = process.returncode
        found = None if timed_out or status is None or status < 0 else status != 127
        return Observation(
            kind="command",
            command=said,
            success=not timed_out and status == 0,
            exit_status=status,
            program_found=found,
            timed_out=timed_out,
            error=f"command timed out after {timeout:g} s" if timed_out else None,
            stdout=stdout.output(),
            stderr=stderr.output(),
            duration_s=anyio.current_time() - start,
        )

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


def _identify_all(workdir: str, arguments: Sequence[str]) -> tuple[InputFile, ...]:
    """The files ``arguments`` name for a program running in ``workdir``."""
    return tuple(InputFile(argument=arg, **identify(workdir, arg)) for arg in arguments)


def _pipe() -> tuple[int, int]:
    """A pipe for a command's output: its end to read (non-blocking), its end to write."""
    read, write = os.pipe2(os.O_CLOEXEC)
    os.set_blocking(read, False)
    return read, write


def _not_started(command: str, reason: str, start: float) -> Observation:
    return Observation(
        kind="command",
        command=command,
        success=False,
        error=f"cannot start the command: {reason}",
        duration_s=anyio.current_time() - start,
    )


def _signal_group(group: int, signum: int) -> bool:
    """Send ``signum`` (0: just look) to the group; false once none of it is left."""
    try:
        os.killpg(group, signum)
    except (ProcessLookupError, PermissionError):
        return False
    return True
