"""The errors of the lowest layer, importing nothing: what a tool as small as ``cmbs-opa``
can raise without loading the rest."""

from __future__ import annotations

__all__ = ["CleanupFailed", "CmbsError", "ExecutorError", "PathRefused", "SandboxLeak"]


class CmbsError(Exception):
    """The root of every error cmbs-async raises on purpose; ``cmbs_async.CmbsError``.

    Each error also derives from the built-in exception it stands for (``ValueError``
    for an invalid file or path, ``RuntimeError`` for a part that cannot work), so code
    that catches those keeps working. It is defined here, in the lowest layer, so that
    executor errors share it.
    """


class ExecutorError(CmbsError, RuntimeError):
    """The executor itself cannot work (no workdir, no connection); ends the run."""


class PathRefused(CmbsError, ValueError):
    """An artifact path would leave the workdir."""


class SandboxLeak(ExecutorError):
    """The canary found a new sandbox leaking (the message says what); nothing ran in it.

    ``containment`` is the :class:`executors.observation.Containment` the canary measured.
    """

    def __init__(self, message: str, containment: object) -> None:
        super().__init__(message)
        self.containment = containment


class CleanupFailed(ExecutorError):
    """A workdir could not be removed after its run; the message says what is left."""
