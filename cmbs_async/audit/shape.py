"""The shape of a record, as those who read it back need it.

Two levels. :func:`body_problem` is the store's own: a record's signed body is one JSON
object with exactly its seven fields, each of its type (``verify`` checks every record
against it). :func:`data_problem` is the readers': what ``cmbs audit show`` and replay
take from each kind of record this runtime writes (a decision's ``verdict`` and
``message``, a step's ``raw`` text, ...). A store accepts any data for any kind, so the
second is not a test of integrity; a reader that finds a record without what it needs
says so in one line instead of failing on a missing key.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping
from typing import Any

from .store import AuditRecord, RecordKind

__all__ = ["BODY_FIELDS", "body_problem", "data_problem"]

#: The fields of a record's signed body.
BODY_FIELDS = ("session_id", "seq", "kind", "step", "ts", "prev", "data")
_FIELD_SET = frozenset(BODY_FIELDS)
_KINDS = frozenset(kind.value for kind in RecordKind)
_NONE = type(None)

#: For each kind: the fields of its data a reader uses, and the types each may have.
#: Required ones are listed in ``_REQUIRED``; the others, when present, must fit too.
_FIELDS: dict[RecordKind, dict[str, tuple[type, ...]]] = {
    RecordKind.SESSION: {
        "scenario": (dict,),
        "profile": (dict,),
        "review": (dict, _NONE),
        "public_key": (str,),
    },
    RecordKind.STEP: {"raw": (str,), "raw_b64": (str,), "flags": (list,)},
    RecordKind.SUPERVISION: {"verdict": (str,), "action": (str,)},
    RecordKind.DECISION: {
        "action": (str, _NONE),
        "verdict": (str,),
        "message": (str,),
        "detail": (str, _NONE),
    },
    RecordKind.OBSERVATION: {
        "kind": (str,),
        "stdout": (dict, _NONE),
        "stderr": (dict, _NONE),
        "error": (str, _NONE),
    },
    RecordKind.END: {"outcome": (str,), "reason": (str, _NONE)},
}
_REQUIRED: dict[RecordKind, tuple[str, ...]] = {
    RecordKind.SESSION: ("public_key",),
    RecordKind.SUPERVISION: ("verdict",),
    RecordKind.DECISION: ("verdict", "message"),
    RecordKind.OBSERVATION: ("kind",),
    RecordKind.END: ("outcome",),
}


def body_problem(body: object, *, first: bool) -> str | None:
    """What makes ``body`` (a parsed record body) not of a record's shape, or ``None``.

    ``first``: the session's first record, which must be a ``session`` record naming
    its public key.
    """
    if (  # the common case, in one expression (verify asks this of every record)
        type(body) is dict
        and body.keys() == _FIELD_SET
        and type(body["session_id"]) is str
        and type(body["seq"]) is int
        and body["kind"] in _KINDS
        and (body["step"] is None or type(body["step"]) is int)
        and type(body["ts"]) in (int, float)
        and type(body["prev"]) is str
        and type(body["data"]) is dict
        and not first
    ):
        return None
    if not isinstance(body, Mapping):
        return "it is not a JSON object"
    if body.keys() != _FIELD_SET:
        missing = sorted(_FIELD_SET - set(body))
        extra = sorted(set(body) - _FIELD_SET)
        return "its fields are not a record's (" + _listed(missing, extra) + ")"
    if not isinstance(body["session_id"], str) or not _is_int(body["seq"]):
        return "its session_id or seq is of the wrong type"
    if body["kind"] not in _KINDS:
        return f"{_quoted(body['kind'])} is not a kind of record"
    if body["step"] is not None and not _is_int(body["step"]):
        return "its step is of the wrong type"
    if not isinstance(body["ts"], int | float) or isinstance(body["ts"], bool):
        return "its ts is not a time"
    if not isinstance(body["prev"], str) or not isinstance(body["data"], dict):
        return "its prev is not text or its data not an object"
    if first and body["kind"] != RecordKind.SESSION.value:
        return "the session's first record is not a session record"
    if first and not isinstance(body["data"].get("public_key"), str):
        return "the session's first record names no public key"
    return None


def data_problem(record: AuditRecord) -> str | None:
    """What a reader needs of ``record``'s data and does not find, or ``None``."""
    data: dict[str, Any] = record.data
    missing = [name for name in _REQUIRED.get(record.kind, ()) if name not in data]
    if missing:
        return f"its data has no {', '.join(missing)}"
    for name, types in _FIELDS.get(record.kind, {}).items():
        if name in data and not isinstance(data[name], types):
            return f"its {name} is of the wrong type"
    if record.kind is RecordKind.STEP:
        if "raw" not in data and "raw_b64" not in data:
            return "its data has no raw message"
        if "raw" not in data:
            try:
                base64.b64decode(data["raw_b64"])
            except (binascii.Error, ValueError):
                return "its raw_b64 is not base64"
    return None


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _listed(missing: list[str], extra: list[str]) -> str:
    parts = []
    if missing:
        parts.append("no " + ", ".join(missing))
    if extra:
        parts.append("also " + ", ".join(_quoted(name) for name in extra[:3]))
    return "; ".join(parts)


def _quoted(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
