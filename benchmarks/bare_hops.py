"""The floor under the actor runtime: its four stream hops per step, with no work at all.

Three tasks joined by four anyio memory object streams pass one item around per step,
exactly as agent, supervisor and executor do, through the same hop helpers, but nothing
else happens. Imported by the other benchmarks; run alone it prints microseconds per
step at 1, 100 and 1,000 rings in flight: ``python benchmarks/bare_hops.py``.
"""

from __future__ import annotations

import statistics
import time

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from cmbs_async._streams import receive, send


async def _ring(steps: int) -> None:
    turns_send, turns_recv = anyio.create_memory_object_stream[int](1)
    steps_send, steps_recv = anyio.create_memory_object_stream[int](1)
    requests_send, requests_recv = anyio.create_memory_object_stream[int](1)
    replies_send, replies_recv = anyio.create_memory_object_stream[int](1)

    async def echo(
        inbox: MemoryObjectReceiveStream[int], outbox: MemoryObjectSendStream[int]
    ) -> None:
        async with inbox, outbox:
            while True:
                try:
                    await send(outbox, await receive(inbox))
                except (anyio.EndOfStream, anyio.BrokenResourceError):
                    return

    async def supervisor() -> None:
        async with turns_send, steps_recv, requests_send, replies_recv:
            await send(turns_send, 0)
            for number in range(steps):
                await send(requests_send, await receive(steps_recv))
                await receive(replies_recv)
                if number < steps - 1:
                    await send(turns_send, number)

    async with anyio.create_task_group() as tg:
        tg.start_soon(echo, turns_recv, steps_send)
        tg.start_soon(echo, requests_recv, replies_send)
        tg.start_soon(supervisor)


async def hop_cost(rings: int, in_flight: int, steps: int = 10) -> float:
    """Microseconds per step for ``rings`` rings of ``steps`` steps, ``in_flight`` at once."""
    limiter = anyio.CapacityLimiter(in_flight)

    async def one() -> None:
        async with limiter:
            await _ring(steps)

    start = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for _ in range(rings):
            tg.start_soon(one)
    return (time.perf_counter() - start) / (rings * steps) * 1e6


def main() -> None:
    for backend in ("asyncio", "trio"):
        costs = {
            n: statistics.median(anyio.run(hop_cost, 2000, n, backend=backend) for _ in range(3))
            for n in (1, 100, 1000)
        }
        row = "  ".join(f"{n:>5,} in flight {us:5.1f} us" for n, us in costs.items())
        print(f"{backend:8} {row}  (ratio at 1,000: {costs[1] / costs[1000]:.2f})")


if __name__ == "__main__":
    main()
