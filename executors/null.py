"""An executor that runs nothing: every action succeeds at once with empty output.

For dry runs of agents and gates, and for measuring the runtime's own overhead.
"""

from __future__ import annotations

from collections.abc import Mapping

from .base import Closing
from .observation import CommandEnv, Containment, Observation

__all__ = ["NullExecutor"]


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

    async def cleanup(self, workdir: str, *, remove: bool = True) -> None:
        return None
