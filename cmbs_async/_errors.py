"""How errors reach the user: one root class, one-line reasons, one failure at a time.

:class:`CmbsError` is defined with the executors, the lowest layer, so that their errors
share it; every error the library raises on purpose derives from it.
"""

from __future__ import annotations

import difflib
import functools
from collections.abc import Awaitable, Callable, Collection, Coroutine
from typing import Any, ParamSpec, TypeVar

from pydantic import ValidationError

from executors import CmbsError

__all__ = ["CmbsError", "one_line", "single_failure", "validation_reason"]

P = ParamSpec("P")
T = TypeVar("T")


def one_line(text: str) -> str:
    """Collapse white space so a message fits on one line."""
    return " ".join(text.split())


def validation_reason(exc: ValidationError, *, fields: Collection[str] = ()) -> str:
    """The first error of a validation failure as ``where: what``; a top-level name that
    is not one of ``fields`` (the model's) names the field it is closest to."""
    error = exc.errors()[0]
    where = ".".join(str(part) for part in error["loc"]) or "(top level)"
    what = error["msg"]
    if error["type"] == "extra_forbidden" and len(error["loc"]) == 1 and fields:
        close = difflib.get_close_matches(str(error["loc"][0]), fields, n=1, cutoff=0.6)
        what = f"not a field here{f' (did you mean {close[0]}?)' if close else ''}"
    extra = f" ({len(exc.errors()) - 1} more)" if len(exc.errors()) > 1 else ""
    return one_line(f"{where}: {what}{extra}")


def single_failure(
    function: Callable[P, Awaitable[T]],
) -> Callable[P, Coroutine[Any, Any, T]]:
    """Let ``function`` raise a lone failure from its task groups as itself.

    Task groups wrap what their tasks raise in an :class:`ExceptionGroup`, nested once
    per task group it passes through. When the group holds a single exception, the caller
    gets that exception (its traceback and cause intact); several at once stay a group.
    Cancellation is untouched: anyio raises it bare.
    """

    @functools.wraps(function)
    async def wrapper(*args: P.args, **kwargs: P.kwargs) -> T:
        try:
            return await function(*args, **kwargs)
        except BaseExceptionGroup as group:
            failure: BaseException = group
        while isinstance(failure, BaseExceptionGroup) and len(failure.exceptions) == 1:
            failure = failure.exceptions[0]
        raise failure  # outside the handler: no "during handling" chain back to the group

    return wrapper
