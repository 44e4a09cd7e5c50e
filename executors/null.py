"""An executor that runs nothing: every action succeeds at once with empty output.

For dry runs of agents and gates, and for measuring the runtime's own overhead.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence

from .base import Closing
from .observation import CommandEnv, Containment, InputFile, Observation, Program

__all__ = ["NullExecutor"]

_NOTHING = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"  # sha256(b"")


class NullExecutor(Closing):
    """Every command exits 0 with no output; every artifact is 'written' nowhere."""

    async def prepare(
        self, workdir: str | None, files: Mapping[str, str], *, env: CommandEnv | None = None
    ) -> str:
        return workdir or "."

    def containment_of(self, workdir: str) -> Containment:
        return Containment(sandbox=self.containment)

    async def write_artifact(self, workdir: str, path: str, content: str) -> Observation:
        return Observation(kind="artifact", path=path, success=True)

    #: Nothing runs, so nothing needs containing.
    containment = "nothing runs"

    async def run_command(
        self,
        workdir: str,
        command: str,
        *,
        timeout: float | None,
        env: CommandEnv | None = None,
    ) -> Observation:
        return Observation(
            kind="command", command=command, success=True, exit_status=0, program_found=True
        )

    async def run_program(
        self,
        workdir: str,
        argv: Sequence[str],
        *,
        timeout: float | None,
        env: CommandEnv | None = None,
        inputs: Sequence[str] = (),
    ) -> Observation:
        observed = await self.run_command(workdir, shlex.join(argv), timeout=timeout, env=env)
        named = tuple(InputFile(argument=arg, outside="nothing runs") for arg in inputs)
        return observed.model_copy(update={"argv": tuple(argv), "inputs": named})

    async def resolve_program(
        self, workdir: str, name: str, *, env: CommandEnv | None = None
    ) -> Program | None:
        """Every program 'exists', nowhere: a path no file has, the hash of nothing."""
        return Program(name=name, path=f"/nonexistent/{name}", sha256=_NOTHING)

    async def cleanup(self, workdir: str, *, remove: bool = True) -> None:
        return None
