"""``async with`` for the library's agents, reviewers and clients: whoever creates one
closes it. The base class lives with the executors, the lowest layer, which use it too."""

from __future__ import annotations

from executors.base import Closing

__all__ = ["Closing"]
