"""``async with`` for the library's agents, reviewers and clients: whoever creates one
closes it, with ``async with`` or :meth:`Closing.aclose`."""

from __future__ import annotations

from typing import Self

__all__ = ["Closing"]


class Closing:
    """``async with obj:`` closes ``obj`` on the way out, through its ``aclose``."""

    async def aclose(self) -> None:
        """Release what this object holds; it holds nothing unless a subclass says so."""

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()
