"""How much an agent may send in one step, whatever way it comes in.

Every agent message (a stdio line, an MCP tool call, an adapter's call, a model's reply,
a scripted line) passes :func:`bounded` before it is recorded or judged: a step larger
than :data:`STEP_MAX_BYTES` (as the JSON text it is, or would be) is replaced by a small
marker holding its size and SHA-256, which the trail keeps and the gate refuses with one
line (``CONTINUE``, invalid format), the same again on replay. So the audit database
never takes an agent's megabytes, and nothing is silently cut: the agent is told, the
trail says what came.

Within a step the payload models cap what runs: an artifact's content
(:data:`ARTIFACT_MAX_CHARS`), a command (:data:`COMMAND_MAX_CHARS`) and a path
(:data:`PATH_MAX_CHARS`), each refused in one line naming the field and the cap.
"""

from __future__ import annotations

import hashlib
import json
from typing import TypeVar

from pydantic import BaseModel

from ._reading import size_text

__all__ = [
    "ARTIFACT_MAX_CHARS",
    "COMMAND_MAX_CHARS",
    "PATH_MAX_CHARS",
    "STEP_MAX_BYTES",
    "bounded",
    "oversized_reason",
]

#: The most an agent's step may hold, as the JSON text it arrives as (or is sent as).
STEP_MAX_BYTES = 4 * 1024 * 1024
#: The longest content an artifact may have, in characters.
ARTIFACT_MAX_CHARS = 1024 * 1024
#: The longest command an agent may run, in characters (an argument of ``sh -c``: the
#: kernel takes at most 128 KiB).
COMMAND_MAX_CHARS = 64 * 1024
#: The longest path an artifact may be written to (the kernel's ``PATH_MAX``).
PATH_MAX_CHARS = 4096

_KEY = "cmbs_oversized_step"
_PREFIX = '{"' + _KEY + '": '

M = TypeVar("M", bound=str | bytes | BaseModel)


def bounded(message: M, *, max_bytes: int = STEP_MAX_BYTES) -> M | str:
    """``message`` itself if it holds at most ``max_bytes``, else the marker that stands
    for it (its size, its SHA-256 and the cap, as JSON text)."""
    if isinstance(message, str):
        if len(message) * 4 <= max_bytes:  # no character takes more than 4 bytes
            return message
        data = message.encode("utf-8", "surrogatepass")
    elif isinstance(message, bytes):
        data = message
    else:
        data = message.model_dump_json().encode("utf-8", "surrogatepass")
    if len(data) <= max_bytes:
        return message
    marker = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(), "cap": max_bytes}
    return json.dumps({_KEY: marker})


def oversized_reason(message: object) -> str | None:
    """The one-line refusal of a step :func:`bounded` replaced, else ``None``."""
    if not isinstance(message, str) or not message.startswith(_PREFIX) or len(message) > 300:
        return None
    try:
        marker = json.loads(message)[_KEY]
        size, digest, cap = int(marker["bytes"]), str(marker["sha256"]), int(marker["cap"])
    except (ValueError, TypeError, KeyError):
        return None
    return (
        f"larger than {size_text(cap)} (the cap for an agent's step): {size} bytes, "
        f"kept only as their SHA-256 {digest}"
    )
