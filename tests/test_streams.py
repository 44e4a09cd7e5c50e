"""The actors' stream hops keep anyio's semantics: items, end of stream, cancellation."""

from __future__ import annotations

import anyio
import pytest

from cmbs_async._streams import receive, send

pytestmark = pytest.mark.anyio


async def test_receive_gets_an_item_sent_while_it_waits() -> None:
    sender, receiver = anyio.create_memory_object_stream[int](1)
    got: list[int] = []

    async def consume() -> None:
        got.append(await receive(receiver))
        got.append(await receive(receiver))

    async with sender, receiver, anyio.create_task_group() as tg:
        tg.start_soon(consume)
        await anyio.wait_all_tasks_blocked()
        await send(sender, 1)
        await anyio.wait_all_tasks_blocked()
        await send(sender, 2)
    assert got == [1, 2]


async def test_receive_takes_a_buffered_item_and_ends_when_the_sender_closes() -> None:
    sender, receiver = anyio.create_memory_object_stream[int](1)
    async with receiver:
        sender.send_nowait(7)
        assert await receive(receiver) == 7
        ended = False

        async def consume() -> None:
            nonlocal ended
            with pytest.raises(anyio.EndOfStream):
                await receive(receiver)
            ended = True

        async with anyio.create_task_group() as tg:
            tg.start_soon(consume)
            await anyio.wait_all_tasks_blocked()
            await sender.aclose()
        assert ended


async def test_closing_the_receiving_end_wakes_its_waiter() -> None:
    sender, receiver = anyio.create_memory_object_stream[int](0)
    woke: list[type[BaseException]] = []

    async def consume() -> None:
        try:
            await receive(receiver)
        except (anyio.ClosedResourceError, anyio.EndOfStream) as exc:
            woke.append(type(exc))

    with anyio.fail_after(5):
        async with sender, anyio.create_task_group() as tg:
            tg.start_soon(consume)
            await anyio.wait_all_tasks_blocked()
            await receiver.aclose()
            await sender.aclose()
    assert len(woke) == 1


async def test_a_cancelled_receive_leaves_no_waiter_to_swallow_items() -> None:
    sender, receiver = anyio.create_memory_object_stream[int](0)
    async with sender, receiver:
        with anyio.move_on_after(0.01) as scope:
            await receive(receiver)
        assert scope.cancelled_caught
        with pytest.raises(anyio.WouldBlock):  # nobody is waiting any more
            sender.send_nowait(1)
        async with anyio.create_task_group() as tg:
            tg.start_soon(send, sender, 2)
            assert await receive(receiver) == 2


async def test_once_cancelled_no_buffered_item_is_taken_or_sent() -> None:
    """The deadline fired with a request buffered: no actor starts one more action."""
    sender, receiver = anyio.create_memory_object_stream[int](2)
    async with sender, receiver:
        sender.send_nowait(1)
        with anyio.CancelScope() as scope:
            scope.cancel()
            await receive(receiver)
        assert scope.cancelled_caught
        with anyio.CancelScope() as scope:
            scope.cancel()
            await send(sender, 2)
        assert scope.cancelled_caught
        assert receiver.receive_nowait() == 1  # still there, untaken
        with pytest.raises(anyio.WouldBlock):  # and nothing was sent
            receiver.receive_nowait()
