"""Executors: the only code that touches the world. Local subprocesses here, remote hosts
over SSH in :mod:`executors.ssh`.

Each name below is imported on first use, so that ``from executors import CmbsError``
loads no more than the errors (``cmbs-opa`` starts in a fraction of the time).
"""

import importlib
import typing

if typing.TYPE_CHECKING:
    from .base import DEFAULT_OUTPUT_CAP, Executor, OutputBuffer, confine
    from .errors import CmbsError, ExecutorError, PathRefused
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

#: the module each public name lives in
_HOME = {
    "DEFAULT_OUTPUT_CAP": "base",
    "Executor": "base",
    "OutputBuffer": "base",
    "confine": "base",
    "CmbsError": "errors",
    "ExecutorError": "errors",
    "PathRefused": "errors",
    "LocalExecutor": "local",
    "NullExecutor": "null",
}


def __getattr__(name: str) -> object:
    module = _HOME.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # looked up once
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
