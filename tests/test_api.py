"""The public API: what ``__all__`` promises is there, and nothing configures logging."""

from __future__ import annotations

import subprocess
import sys

import pytest

import cmbs_async
import executors


def test_all_names_are_exported() -> None:
    for package in (cmbs_async, executors):
        assert len(set(package.__all__)) == len(package.__all__)
        for name in package.__all__:
            assert hasattr(package, name), f"{package.__name__}.{name} is missing"
        public = {n for n in vars(package) if not n.startswith("_") and n not in package.__all__}
        modules = {n for n in public if type(getattr(package, n)).__name__ == "module"}
        assert public == modules, f"{package.__name__} exports {public - modules} outside __all__"


def test_importing_configures_no_logging() -> None:
    code = "import structlog, cmbs_async, executors;print(structlog.is_configured())"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"


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
