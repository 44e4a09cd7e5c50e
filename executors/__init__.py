"""Executors: the only code that touches the world. Local subprocesses here, remote hosts
over SSH in :mod:`executors.ssh`.

Each name below is imported on first use, so that ``from executors import CmbsError``
loads no more than the errors (``cmbs-opa`` starts in a fraction of the time).
"""

import typing

from ._lazy import lazy_names as _lazy_names

if typing.TYPE_CHECKING:
    from .base import DEFAULT_OUTPUT_CAP, Executor, OutputBuffer, confine
    from .errors import CleanupFailed, CmbsError, ExecutorError, PathRefused, SandboxLeak
    from .local import LocalExecutor
    from .null import NullExecutor

__all__ = [
    "DEFAULT_OUTPUT_CAP",
    "CleanupFailed",
    "CmbsError",
    "Executor",
    "ExecutorError",
    "LocalExecutor",
    "NullExecutor",
    "OutputBuffer",
    "PathRefused",
    "SandboxLeak",
    "confine",
]

#: the module each public name lives in
_HOME = {
    "DEFAULT_OUTPUT_CAP": "base",
    "Executor": "base",
    "OutputBuffer": "base",
    "confine": "base",
    "CleanupFailed": "errors",
    "CmbsError": "errors",
    "SandboxLeak": "errors",
    "ExecutorError": "errors",
    "PathRefused": "errors",
    "LocalExecutor": "local",
    "NullExecutor": "null",
}


__getattr__, __dir__ = _lazy_names(__name__, _HOME, __all__)
