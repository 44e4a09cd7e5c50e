"""What an executor is told and what it reports: the scenario's declared environment for
its commands, and the observation of what really happened when an action ran.

The lowest layer of cmbs-async: these models import nothing of the rest, so that
``executors`` stands on its own and ``cmbs_async`` builds on it (``cmbs_async.protocol``
re-exports them).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

__all__ = ["ENV_NAME", "CommandEnv", "Observation", "Output", "PassedName"]

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


class CommandEnv(_Model):
    """What a scenario declares for its commands' environment.

    ``values`` are set as given; ``pass_env`` names variables copied from the operator's
    environment where set (``KUBECONFIG``, say); ``network`` false cuts a sandboxed
    command off the network; ``readable`` names host paths a sandboxed command may read
    even where they lie in a hidden place (the key for a target host, say). Nothing else
    of the operator's environment reaches a command but an allow-list (``PATH``, ``LANG``,
    ``LC_*``, ``TERM``, ``TZ``).
    """

    values: dict[Annotated[str, Field(pattern=ENV_NAME)], str] = Field(default_factory=dict)
    pass_env: tuple[PassedName, ...] = ()
    network: bool = True
    readable: tuple[str, ...] = ()


class Observation(_Model):
    """What really happened when an allowed action ran.

    ``program_found`` is false when the shell could not find the program (exit 127),
    ``None`` when it is not known (an artifact, a killed command, a lost connection).
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
