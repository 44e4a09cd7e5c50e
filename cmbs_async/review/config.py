"""The ``[supervision]`` table (seed 003), validated, with its defaults."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .._errors import CmbsError, validation_reason

__all__ = ["ConfigError", "SupervisionConfig", "load_config"]


class ConfigError(CmbsError, ValueError):
    """A configuration file could not be read or is not valid; the message is one line."""


class SupervisionConfig(BaseModel):
    """How the review layer runs.

    ``base_url`` is an OpenAI-compatible endpoint (``http://127.0.0.1:8000/v1``); its key,
    if any, is read from the environment variable ``api_key_env`` and never stored.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = "claude-sonnet"
    max_reorient_attempts: int = Field(default=3, ge=0)
    timeout_seconds: float = Field(default=30.0, gt=0)
    always_supervise: bool = False
    base_url: str | None = None
    api_key_env: str = "CMBS_REVIEWER_API_KEY"
    max_tokens: int = Field(default=400, ge=16)
    fail_closed_verdict: Literal["PAUSE", "REORIENT", "CONTINUE"] = "PAUSE"


def load_config(path: str | Path) -> SupervisionConfig:
    """Read the ``[supervision]`` table of a TOML file (a missing table means defaults)."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text("utf-8"))
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from exc
    unknown = set(data) - {"supervision"}
    if unknown:
        raise ConfigError(f"{path}: unknown table(s): {', '.join(sorted(unknown))}")
    try:
        return SupervisionConfig.model_validate(data.get("supervision", {}))
    except ValidationError as exc:
        raise ConfigError(f"{path}: supervision.{validation_reason(exc)}") from exc
