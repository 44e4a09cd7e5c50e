"""One-line explanations of validation failures, for users of the CLI and the API."""

from __future__ import annotations

from pydantic import ValidationError

__all__ = ["one_line", "validation_reason"]


def one_line(text: str) -> str:
    """Collapse white space so a message fits on one line."""
    return " ".join(text.split())


def validation_reason(exc: ValidationError) -> str:
    """The first error of a validation failure as ``where: what``."""
    error = exc.errors()[0]
    where = ".".join(str(part) for part in error["loc"]) or "(top level)"
    extra = f" ({len(exc.errors()) - 1} more)" if len(exc.errors()) > 1 else ""
    return one_line(f"{where}: {error['msg']}{extra}")
