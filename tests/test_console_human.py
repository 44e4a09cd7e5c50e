"""The console human of ``--human console``: answers read from a real pipe, and a question
nobody answers that cannot keep the program alive past its deadline."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from io import StringIO

import anyio
import pytest

from cmbs_async.review import ConsoleHuman, HumanRequest

pytestmark = pytest.mark.anyio

REQUEST = HumanRequest(scenario_id="s", step=3, reasoning="the agent went off course")


async def test_answers_come_from_a_pipe_line_by_line() -> None:
    read, write = os.pipe()
    os.write(write, b"what?\nm\nuse the policy report\n")
    os.close(write)
    with os.fdopen(read) as stdin:
        said = StringIO()
        decision = await ConsoleHuman(stdin=stdin, stderr=said).decide(REQUEST)
    assert decision.decision == "modify" and decision.correction == "use the policy report"
    assert "step 3: review paused" in said.getvalue()
    assert said.getvalue().count("[p/a/m]") == 2  # "what?" was asked again


async def test_an_empty_input_aborts() -> None:
    decision = await ConsoleHuman(stdin=StringIO(""), stderr=StringIO()).decide(REQUEST)
    assert decision.decision == "abort"


def test_an_unanswered_question_does_not_outlive_its_deadline() -> None:
    """Nobody types: the deadline cancels the question and the program exits at once,
    with no thread left blocked reading the terminal."""
    program = (
        "import anyio\n"
        "from cmbs_async.review import ConsoleHuman, HumanRequest\n"
        "async def main():\n"
        "    request = HumanRequest(scenario_id='s', step=1, reasoning='r')\n"
        "    with anyio.move_on_after(0.5):\n"
        "        await ConsoleHuman().decide(request)\n"
        "    print('deadline', flush=True)\n"
        "anyio.run(main)\n"
    )
    read, write = os.pipe()  # stdin that stays open and silent
    try:
        started = time.monotonic()
        done = subprocess.run(
            [sys.executable, "-c", program],
            stdin=read,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        took = time.monotonic() - started
    finally:
        os.close(read)
        os.close(write)
    assert done.returncode == 0 and done.stdout == "deadline\n", done.stderr
    assert took < 20  # before the fix it never exited: stdin delivered no line


async def test_an_input_that_cannot_be_polled_is_read_as_it_is() -> None:
    """``/dev/null`` (no event loop can wait on it) is at its end: the question aborts."""
    with open(os.devnull) as stdin:  # noqa: ASYNC230 - never blocks
        decision = await ConsoleHuman(stdin=stdin, stderr=StringIO()).decide(REQUEST)
    assert decision.decision == "abort"


async def test_a_very_long_answer_is_cut_and_the_next_line_read_whole() -> None:
    read, write = os.pipe()
    with os.fdopen(read) as stdin:
        human = ConsoleHuman(stdin=stdin, stderr=StringIO())
        async with anyio.create_task_group() as tg:

            async def type_it() -> None:
                await anyio.to_thread.run_sync(os.write, write, b"m\n" + b"x" * 300_000 + b"\n")
                os.close(write)

            tg.start_soon(type_it)
            decision = await human.decide(REQUEST)
    assert decision.decision == "modify"
    assert set(decision.correction) == {"x"} and len(decision.correction) <= 4096
