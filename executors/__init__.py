"""Executors: the only code that touches the world. Local subprocesses here, remote hosts
over SSH in :mod:`executors.ssh`."""

from .base import (
    DEFAULT_OUTPUT_CAP,
    CmbsError,
    Executor,
    ExecutorError,
    OutputBuffer,
    PathRefused,
    confine,
)
from .local import LocalExecutor
from .null import NullExecutor

__all__ = [
    "DEFAULT_OUTPUT_CAP",
    "CmbsError",
    "Executor",
    "ExecutorError",
    "LocalExecutor",
    "NullExecutor",
    "OutputBuffer",
    "PathRefused",
    "confine",
]
