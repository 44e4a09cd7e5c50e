"""Progress of a batch: a live bar on a terminal, a plain line per run otherwise."""

from __future__ import annotations

import sys
import time
from collections.abc import Collection
from typing import Any, TextIO

from .._text import escape_controls
from ..result import Outcome

__all__ = ["Progress"]


class Progress:
    """``retried`` names the keys of runs done again (``--retry-errors``): their lines
    say so."""

    def __init__(
        self,
        total: int,
        *,
        already: int = 0,
        stream: TextIO | None = None,
        retried: Collection[str] = (),
    ) -> None:
        self.stream = stream or sys.stderr
        self.retried = frozenset(retried)
        self.live = self.stream.isatty()
        self.total = total
        self.done = already
        self.failed = 0
        self.running = 0
        self.started = time.monotonic()
        self._ran = 0
        self._last_draw = 0.0

    def start(self) -> None:
        self.running += 1
        self._draw()

    def finish(self, record: dict[str, Any]) -> None:
        self.running -= 1
        self.done += 1
        self._ran += 1
        if record.get("outcome") != Outcome.TERMINATED:
            self.failed += 1
        if self.live:
            self._draw()
        else:
            again = ", retried" if record.get("key") in self.retried else ""
            line = (
                f"[{self.done}/{self.total}] {record.get('scenario_id')} {record.get('agent')} "
                f"#{record.get('repeat')}: {record.get('outcome')} "
                f"({float(record.get('duration_s') or 0):.2f} s{again})"
            )
            self.stream.write(escape_controls(line) + "\n")
            self.stream.flush()

    def close(self) -> None:
        if self.live:
            self._draw(force=True)
            self.stream.write("\n")
            self.stream.flush()

    def _draw(self, force: bool = False) -> None:
        now = time.monotonic()
        if not self.live or (not force and now - self._last_draw < 0.1):
            return
        self._last_draw = now
        elapsed = now - self.started
        left = self.total - self.done
        eta = f"{elapsed / self._ran * left:.0f}s" if self._ran else "?"
        width = 30
        filled = int(width * self.done / self.total) if self.total else width
        self.stream.write(
            f"\r[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} done, "
            f"{self.running} running, {self.failed} not earned, {elapsed:.0f}s elapsed, ETA {eta} "
        )
        self.stream.flush()
