"""Structured events through the standard :mod:`logging` module, as httpx does.

Events are written with structlog's API (``log.info("scenario.finished", outcome=...)``)
and handed to ``logging.getLogger(name)``: an application that configures nothing sees
only warnings (on stderr, through logging's last-resort handler), one that configures
``logging`` gets every event at the levels it asks for, and structlog's global
configuration is neither used nor changed. The loggers live here, in the lowest layer,
because executors log too; :mod:`cmbs_async.events` uses the same.

A record's message is the event name followed by its fields as ``key=value`` (strings
quoted and escaped unless they are plain words, so an event is always one line); the
fields also come as attributes of the record (``extra``), with ``event`` for the name. A
field named like an attribute every record has (``message``, ``name``, ``args``, ...)
gets a trailing underscore there.
"""

from __future__ import annotations

import inspect
import json
import logging
import re
from typing import Any

import structlog
from structlog.contextvars import merge_contextvars
from structlog.typing import EventDict, FilteringBoundLogger, WrappedLogger

__all__ = ["EventLogger"]

_LEVELS = (logging.DEBUG, logging.INFO, logging.WARNING, logging.ERROR, logging.CRITICAL)
_RESERVED = frozenset(logging.makeLogRecord({}).__dict__) | {"message", "asctime"}
_PLUMBING = ("structlog.", __name__)
_WORD = re.compile(r"[\w.:/@+-]+", re.ASCII)


class EventLogger:
    """Events for the standard logger ``name`` (``cmbs_async`` or one of its children).

    Log through it directly, or :meth:`bind` once and log through what it returns: that
    logger drops an event below the level ``logging`` had for ``name`` when it was bound
    in one method call that returns at once, building nothing. The runtime binds once
    per run.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._logger = logging.getLogger(name)
        self._filtered: dict[int, FilteringBoundLogger] = {}  # by level; they never change

    def bind(self, **context: Any) -> FilteringBoundLogger:
        """A logger carrying ``context``, filtered at the level ``logging`` has now."""
        level = next((lv for lv in _LEVELS if self._logger.isEnabledFor(lv)), logging.CRITICAL)
        logger = self._filtered.get(level)
        if logger is None:
            proxy = structlog.wrap_logger(
                self._logger,
                wrapper_class=structlog.make_filtering_bound_logger(level),
                processors=[merge_contextvars, _to_logging],
            )
            logger = self._filtered[level] = proxy.bind()
        return logger.bind(**context) if context else logger

    def debug(self, event: str, **fields: Any) -> None:
        self.bind().debug(event, **fields)

    def info(self, event: str, **fields: Any) -> None:
        self.bind().info(event, **fields)

    def warning(self, event: str, **fields: Any) -> None:
        self.bind().warning(event, **fields)

    def error(self, event: str, **fields: Any) -> None:
        self.bind().error(event, **fields)


def _to_logging(
    logger: WrappedLogger, method: str, event_dict: EventDict
) -> tuple[tuple[str], dict[str, Any]]:
    """The last processor: the arguments of the ``logging.Logger`` call."""
    event = str(event_dict.pop("event"))
    fields = (f"{key}={_text(value)}" for key, value in event_dict.items() if value is not None)
    text = " ".join([event, *fields])
    extra = {(f"{key}_" if key in _RESERVED else key): value for key, value in event_dict.items()}
    return (text,), {"extra": {"event": event, **extra}, "stacklevel": _call_site()}


def _call_site() -> int:
    """The ``stacklevel`` that makes the record name the code that logged the event (its
    ``funcName`` and ``lineno``), not structlog's call into ``logging``."""
    frame = inspect.currentframe()
    for _ in range(3):  # this function, _to_logging, structlog's _process_event
        frame = frame.f_back if frame is not None else None
    level = 1  # the frame that calls logging: structlog's
    while frame is not None and frame.f_globals.get("__name__", "").startswith(_PLUMBING):
        frame, level = frame.f_back, level + 1
    return level


def _text(value: object) -> str:
    """A field's value in the message: as it is if it is a number or a plain word."""
    if isinstance(value, bool | int | float):
        return str(value)
    if isinstance(value, str) and _WORD.fullmatch(value):
        return value
    return json.dumps(value, default=str)  # quoted, with control characters escaped
