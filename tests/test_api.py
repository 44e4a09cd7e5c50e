"""The public API: what ``__all__`` promises is there, and nothing configures logging."""

from __future__ import annotations

import importlib
import pkgutil
import subprocess
import sys
from types import ModuleType

import pytest

import cmbs_async
import executors
from cmbs_async.cli.signals import Interrupted


def test_all_names_are_exported() -> None:
    for package in (cmbs_async, executors):
        assert len(set(package.__all__)) == len(package.__all__)
        for name in package.__all__:
            assert hasattr(package, name), f"{package.__name__}.{name} is missing"
        public = {n for n in vars(package) if not n.startswith("_") and n not in package.__all__}
        modules = {n for n in public if type(getattr(package, n)).__name__ == "module"}
        assert public == modules, f"{package.__name__} exports {public - modules} outside __all__"


def test_importing_configures_no_logging() -> None:
    code = (
        "import logging, structlog, cmbs_async, executors, executors.ssh;"
        "ours = logging.getLogger('cmbs_async');"
        "print(structlog.is_configured(), logging.root.handlers, ours.handlers, ours.level)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["False", "[]", "[]", "0"]


def _modules(package: ModuleType) -> list[ModuleType]:
    names = [info.name for info in pkgutil.walk_packages(package.__path__, f"{package.__name__}.")]
    return [package, *(importlib.import_module(n) for n in names if not n.endswith("__main__"))]


#: Programs that run on their own inside a sandbox or on a remote host, with the standard
#: library only: they cannot import the package's errors.
STANDALONE = {"executors.launcher", "executors.netguard", "executors.remote_launcher"}


def test_every_error_the_library_defines_derives_from_cmbs_error() -> None:
    errors = {
        thing
        for module in [*_modules(cmbs_async), *_modules(executors)]
        if module.__name__ not in STANDALONE
        for thing in vars(module).values()
        if isinstance(thing, type)
        and issubclass(thing, BaseException)
        and thing.__module__ == module.__name__
    }
    assert len(errors) > 15  # the walk found them
    # A signal caught by the command line is no error: it ends the command with 128 + N.
    assert {e for e in errors if not issubclass(e, cmbs_async.CmbsError)} == {Interrupted}
    assert cmbs_async.CmbsError is executors.CmbsError
    public = {
        e for e in errors if not e.__module__.startswith("cmbs_async.cli") and e.__name__[0] != "_"
    }
    assert all(e.__name__ in getattr(sys.modules[e.__module__], "__all__", ()) for e in public)
    library = {e for e in public if not e.__module__.startswith(("executors", "cmbs_async.tools"))}
    assert library <= {getattr(cmbs_async, name) for name in cmbs_async.__all__}


@pytest.mark.anyio
async def test_every_agent_and_the_stock_reviewer_close_with_async_with() -> None:
    async def nothing(turn: cmbs_async.Turn) -> None:
        return None

    for thing in (
        cmbs_async.ScriptedAgent([]),
        cmbs_async.CallableAgent(nothing),
        cmbs_async.StdioAgent("true"),
        cmbs_async.OpenAIAgent(model="m", base_url="http://127.0.0.1:9/v1"),
        cmbs_async.OpenAIReviewer(cmbs_async.SupervisionConfig(base_url="http://127.0.0.1:9/v1")),
    ):
        async with thing as entered:
            assert entered is thing
