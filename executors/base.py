"""The executor protocol and what every executor shares: workdir confinement and
capped output capture."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import PurePosixPath
from typing import Protocol, Self, runtime_checkable

from .errors import CleanupFailed, CmbsError, ExecutorError, PathRefused, SandboxLeak
from .observation import CommandEnv, Containment, Observation, Output, Program

__all__ = [
    "DEFAULT_OUTPUT_CAP",
    "CleanupFailed",
    "Closing",
    "CmbsError",
    "Executor",
    "ExecutorError",
    "OutputBuffer",
    "PathRefused",
    "SandboxLeak",
    "confine",
    "refused_artifact",
    "seed_files",
]

DEFAULT_OUTPUT_CAP = 64 * 1024


class Closing:
    """``async with obj:`` closes ``obj`` on the way out, through its ``aclose``.

    Whoever creates an executor (or an agent, a reviewer, a client) closes it.
    """

    async def aclose(self) -> None:
        """Release what this object holds; it holds nothing unless a subclass says so."""

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


@runtime_checkable
class Executor(Protocol):
    """Runs what the gate allowed and reports what really happened.

    One executor may serve many scenarios at once; each call names its workdir.
    :attr:`containment` says what keeps a command from outliving its run or reaching
    outside its workdir (``"bwrap"``, ``"none"``, ...), once :meth:`prepare` has run.
    Failures of the action itself are observations, never exceptions; only a broken
    executor raises :class:`ExecutorError`.
    """

    @property
    def containment(self) -> str:
        """What contains the commands (``"bwrap"``, ``"pidns"``, ``"none"``, ...)."""
        ...

    async def prepare(
        self, workdir: str | None, files: Mapping[str, str], *, env: CommandEnv | None = None
    ) -> str:
        """Create the workdir (a fresh temporary one for ``None``), seed ``files``, return it.

        ``env`` is what the scenario declares for its commands: a sandboxing executor
        builds the workdir's sandbox from it now and proves it (:meth:`containment_of`),
        raising :class:`SandboxLeak` if it does not hold.
        """
        ...

    def containment_of(self, workdir: str) -> Containment:
        """What contains the commands of a workdir :meth:`prepare` returned, as proven."""
        ...

    async def write_artifact(self, workdir: str, path: str, content: str) -> Observation:
        """Write ``content`` to ``path``, relative to and confined in ``workdir``.

        Every action's observation says what it changed in the workdir (``changes``: the
        files created, changed or removed, by inode and content hash)."""
        ...

    async def run_command(
        self, workdir: str, command: str, *, timeout: float | None, env: CommandEnv | None = None
    ) -> Observation:
        """Run ``command`` through a shell in ``workdir``; kill all of it on timeout or cancel.

        ``env`` is what the scenario declares for the command's environment (none: what
        :meth:`prepare` was given for the workdir).
        """
        ...

    async def run_program(
        self,
        workdir: str,
        argv: Sequence[str],
        *,
        timeout: float | None,
        env: CommandEnv | None = None,
        inputs: Sequence[str] = (),
    ) -> Observation:
        """Run ``argv`` exactly as it is, with no shell (``argv[0]`` an absolute path, as
        :meth:`resolve_program` gives it), in ``workdir``, like :meth:`run_command`.

        ``inputs`` are arguments that name input files: each is identified just before the
        program starts (:class:`~executors.observation.InputFile`). The observation says
        ``argv`` and ``inputs``.
        """
        ...

    async def resolve_program(
        self, workdir: str, name: str, *, env: CommandEnv | None = None
    ) -> Program | None:
        """The program ``name`` as the workdir's commands find it on their ``PATH``, if it
        lies outside every place they (or the agent) can write: its real path and content
        hash. ``None`` if there is no such program."""
        ...

    async def cleanup(self, workdir: str, *, remove: bool = True) -> None:
        """Let go of a workdir :meth:`prepare` returned (and its sandbox); delete it too if
        ``remove``, raising :class:`CleanupFailed` if some of it is left."""
        ...

    async def aclose(self) -> None:
        """Release what the executor holds (connections, held workdirs); ``async with``."""
        ...

    async def __aenter__(self) -> Self: ...

    async def __aexit__(self, *exc_info: object) -> None: ...


def confine(path: str) -> PurePosixPath:
    """The relative path of an artifact, or :class:`PathRefused` if it could escape."""
    if not path or "\x00" in path:
        raise PathRefused("artifact path is empty or contains a NUL byte")
    pure = PurePosixPath(path)
    if pure.is_absolute() or path.startswith("~"):
        raise PathRefused(f"artifact path {path!r} is absolute; paths are relative to the workdir")
    if ".." in pure.parts:
        raise PathRefused(f"artifact path {path!r} contains '..'")
    if not pure.parts or pure.name in ("", "."):
        raise PathRefused(f"artifact path {path!r} names no file")
    return pure


async def seed_files(executor: Executor, workdir: str, files: Mapping[str, str]) -> None:
    """Write a scenario's starting files; one that cannot be written breaks the executor."""
    for path, content in files.items():
        observation = await executor.write_artifact(workdir, path, content)
        if not observation.success:
            raise ExecutorError(f"cannot seed scenario file: {observation.error}")


def refused_artifact(path: str, reason: str) -> Observation:
    """The observation for an artifact that was not written."""
    return Observation(kind="artifact", path=path, success=False, error=reason)


class OutputBuffer:
    """Keeps the first and last ``cap // 2`` bytes of a stream and counts the rest."""

    def __init__(self, cap: int = DEFAULT_OUTPUT_CAP) -> None:
        self._half = max(cap // 2, 1)
        self._head = bytearray()
        self._tail = bytearray()
        self.total = 0

    def feed(self, data: bytes) -> None:
        self.total += len(data)
        room = self._half - len(self._head)
        if room > 0:
            self._head += data[:room]
            data = data[room:]
        if data:
            self._tail += data
            if len(self._tail) > self._half:
                del self._tail[: len(self._tail) - self._half]

    def output(self) -> Output:
        kept = len(self._head) + len(self._tail)
        return Output(
            head=self._head.decode("utf-8", "replace"),
            tail=self._tail.decode("utf-8", "replace"),
            total_bytes=self.total,
            truncated=self.total > kept,
        )
