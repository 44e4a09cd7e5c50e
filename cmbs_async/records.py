"""What a run writes to its audit trail: one builder per kind of record, shared by the
runtime that writes them and :func:`cmbs_async.replay` that derives them again, so the
two cannot drift apart."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterable, Mapping
from typing import Any

from ._bounds import bounded
from .agents.base import AgentMessage
from .audit.store import Entry, RecordKind
from .gate import Decision
from .profile import Profile
from .protocol import AgentStep, Observation
from .result import ScenarioResult
from .review.config import SupervisionConfig
from .review.layer import SupervisionRecord
from .review.reconcile import Flag
from .scenario import ScenarioSpec

__all__ = [
    "decision_record",
    "end_record",
    "flag_data",
    "observation_record",
    "recordable",
    "recorded_message",
    "session_data",
    "step_record",
    "supervision_record",
]


def session_data(
    spec: ScenarioSpec,
    profile: Profile,
    review: SupervisionConfig | None,
    *,
    agent: str | None = None,
) -> dict[str, Any]:
    """The session's first record: everything replay needs to judge the run again, and
    which agent ran (its label, for the viewer)."""
    return {
        "agent": agent,
        "scenario": spec.model_dump(mode="json"),
        "profile": profile.model_dump(mode="json"),
        "review": review.model_dump(mode="json") if review is not None else None,
    }


def step_record(number: int, message: AgentMessage, flags: Iterable[Flag]) -> Entry:
    """The agent's message as it arrived, with the reconciler's flags (if any)."""
    data = _raw(message)
    flagged = flag_data(flags)
    if flagged:
        data["flags"] = flagged
    return Entry(RecordKind.STEP, number, data)


def flag_data(flags: Iterable[Flag]) -> list[dict[str, Any]]:
    """Flags as a step record holds them."""
    return [flag.model_dump(mode="json") for flag in flags]


def recorded_message(data: Mapping[str, Any]) -> str | bytes:
    """The agent's message from a step record's data, as the gate saw it."""
    if "raw_b64" in data:
        return base64.b64decode(data["raw_b64"])
    return str(data["raw"])


def supervision_record(number: int, supervision: SupervisionRecord) -> Entry:
    return Entry(RecordKind.SUPERVISION, number, supervision.model_dump(mode="json"))


def decision_record(decision: Decision) -> Entry:
    """The gate's verdict: what replay must derive again, field for field."""
    return Entry(
        RecordKind.DECISION,
        decision.step_number,
        {
            "action": decision.action_type,
            "verdict": decision.verdict.value,
            "message": decision.message,
            "detail": decision.detail,
        },
    )


def observation_record(number: int, observation: Observation) -> Entry:
    return Entry(RecordKind.OBSERVATION, number, observation.model_dump(mode="json"))


def evidence_record(number: int, chain: dict[str, Any]) -> Entry:
    """An evaluation's provenance chain (collector -> input -> evaluation -> posture), as
    :attr:`~cmbs_async.masks.Masks.chain` gives it."""
    return Entry(RecordKind.EVIDENCE, number, chain)


def end_record(result: ScenarioResult) -> Entry:
    """How the run ended (its summary without the trace: the records are the trace)."""
    return Entry(RecordKind.END, None, result.summary() | {"trace": None})


def _raw(message: AgentMessage) -> dict[str, Any]:
    """The agent's message as it arrived, in a form replay can feed to the gate again."""
    if isinstance(message, str):
        return {"raw": message}
    if isinstance(message, bytes | bytearray):
        try:
            return {"raw": bytes(message).decode("utf-8")}
        except UnicodeDecodeError:
            return {"raw_b64": base64.b64encode(bytes(message)).decode()}
    if isinstance(message, AgentStep):
        return {"raw": message.model_dump_json()}
    return {"raw": json_text(message)}


def recordable(message: AgentMessage) -> str | bytes | AgentStep:
    """The agent's message in a form the trail keeps exactly, for the gate to judge: text,
    bytes and steps as they are; anything else (a mapping, with values JSON lacks or not)
    as JSON text, foreign values as their ``repr``. Replay then sees what the gate saw.
    A message over the step cap is kept as its size and hash only (see :mod:`._bounds`)."""
    if isinstance(message, str | bytes | AgentStep):
        return bounded(message)
    if isinstance(message, bytearray):
        return bounded(bytes(message))
    return bounded(json_text(message))


def json_text(value: object) -> str:
    """``value`` as JSON text; what JSON cannot hold becomes its ``repr``."""
    if isinstance(value, Mapping):
        value = dict(value)
    try:
        return json.dumps(value, default=repr)
    except (TypeError, ValueError):  # keys JSON cannot hold, a cycle: the whole as its repr
        return json.dumps(repr(value))
