"""Reading output pipes: a reader that runs late still gets all a command wrote."""

from __future__ import annotations

import os

import anyio
import pytest

from executors.base import OutputBuffer
from executors.pipes import read_pipes

pytestmark = pytest.mark.anyio


async def test_what_a_pipe_held_at_the_end_is_read_though_its_writer_keeps_it_open() -> None:
    read, write = os.pipe()
    os.set_blocking(read, False)
    os.write(write, b"x" * 50_000)  # written before the end, the writer still holding it
    into = OutputBuffer()

    async def ended() -> bool:
        return True

    try:
        with anyio.fail_after(10):  # a writer holding the pipe does not hold the reader
            await read_pipes([(read, into)], ended, grace=0)
    finally:
        os.close(read)
        os.close(write)
    assert into.total == 50_000


async def test_a_cancelled_reader_keeps_what_the_pipe_held() -> None:
    read, write = os.pipe()
    os.set_blocking(read, False)
    os.write(write, b"partial")
    into = OutputBuffer()

    async def ended() -> bool:
        await anyio.sleep_forever()
        return True

    try:
        with anyio.move_on_after(0):
            await read_pipes([(read, into)], ended, grace=1)
    finally:
        os.close(read)
        os.close(write)
    assert into.output().text == "partial"
