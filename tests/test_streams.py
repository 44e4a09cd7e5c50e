"""The actors' stream hops keep anyio's semantics: items, end of stream, cancellation."""

from __future__ import annotations

import anyio
import pytest

from cmbs_async._streams import receive, send, wait_next

pytestmark = pytest.mark.anyio


async def test_wait_next_gets_an_item_sent_while_it_waits() -> None:
    sender, receiver = anyio.create_memory_object_stream[int](1)
    got: list[int] = []

    async def consume() -> None:
        got.append(await wait_next(receiver))
        got.append(await wait_next(receiver))

    async with sender, receiver, anyio.create_task_group() as tg:
        tg.start_soon(consume)
        await anyio.wait_all_tasks_blocked()
        await send(sender, 1)
        await anyio.wait_all_tasks_blocked()
        await send(sender, 2)
    assert got == [1, 2]


async def test_wait_next_takes_a_buffered_item_and_ends_when_the_sender_closes() -> None:
    sender, receiver = anyio.create_memory_object_stream[int](1)
    async with receiver:
        sender.send_nowait(7)
        assert await wait_next(receiver) == 7
        ended = False

        async def consume() -> None:
            nonlocal ended
            with pytest.raises(anyio.EndOfStream):
                await wait_next(receiver)
            ended = True

        async with anyio.create_task_group() as tg:
            tg.start_soon(consume)
            await anyio.wait_all_tasks_blocked()
            await sender.aclose()
        assert ended


async def test_a_cancelled_wait_next_leaves_no_waiter_to_swallow_items() -> None:
    sender, receiver = anyio.create_memory_object_stream[int](0)
    async with sender, receiver:
        with anyio.move_on_after(0.01) as scope:
            await wait_next(receiver)
        assert scope.cancelled_caught
        with pytest.raises(anyio.WouldBlock):  # nobody is waiting any more
            sender.send_nowait(1)
        async with anyio.create_task_group() as tg:
            tg.start_soon(send, sender, 2)
            assert await receive(receiver) == 2
