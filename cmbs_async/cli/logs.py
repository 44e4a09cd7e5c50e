"""Where the command line's events go: stderr, as console text or JSON lines.

The library only hands its events to the standard logger ``cmbs_async``; this is the one
place that gives them an output, for the duration of a command.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal

import structlog
from structlog.stdlib import ExtraAdder, ProcessorFormatter

__all__ = ["LEVELS", "logging_to_stderr"]

LEVELS = ("debug", "info", "warning", "error")


@contextmanager
def logging_to_stderr(
    level: str = "warning", fmt: Literal["console", "json"] = "console"
) -> Iterator[None]:
    """While the block runs, events at ``level`` and above go to stderr, one a line."""
    renderer: structlog.types.Processor = (
        structlog.processors.JSONRenderer()
        if fmt == "json"
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        ProcessorFormatter(
            foreign_pre_chain=[
                ExtraAdder(),  # the event's name and fields, from the record's attributes
                structlog.stdlib.add_log_level,
                structlog.processors.TimeStamper(fmt="iso", utc=True),
            ],
            processors=[ProcessorFormatter.remove_processors_meta, renderer],
        )
    )
    logger = logging.getLogger("cmbs_async")
    level_before = logger.level
    logger.addHandler(handler)
    logger.setLevel(level.upper())
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level_before)
