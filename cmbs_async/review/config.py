"""The ``[supervision]`` table (seed 003), validated, with its defaults."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .._errors import CmbsError, validation_reason
from .._reading import ReadError, read_toml

__all__ = ["ConfigError", "SupervisionConfig", "load_config"]


#: The largest configuration file read.
CONFIG_MAX_BYTES = 1024 * 1024


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
    try:  # capped in size and nesting: /dev/zero is one line, not the host's memory
        data = read_toml(path, what="a configuration file", max_bytes=CONFIG_MAX_BYTES)
    except ReadError as exc:
        raise ConfigError(str(exc)) from None
    unknown = set(data) - {"supervision"}
    if unknown:
        raise ConfigError(f"{path}: unknown table(s): {', '.join(sorted(unknown))}")
    try:
        return SupervisionConfig.model_validate(data.get("supervision", {}))
    except ValidationError as exc:
        raise ConfigError(f"{path}: supervision.{validation_reason(exc)}") from exc
