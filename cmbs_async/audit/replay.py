"""Replay: run the gate and the reconciler again over a recorded session (no agent, no
executor, no model) and check that every verdict comes out the same."""

from __future__ import annotations

import base64
from dataclasses import dataclass

from ..gate import Decision, Gate
from ..profile import Profile
from ..protocol import Observation
from ..review.layer import REORIENTED, ReviewState
from .sqlite import AuditError, SQLiteAuditStore

__all__ = ["ReplayReport", "replay"]


@dataclass(frozen=True)
class ReplayReport:
    session_id: str
    decisions: int
    reconciles: int
    mismatches: tuple[str, ...]

    @property
    def identical(self) -> bool:
        return not self.mismatches


def replay(store: SQLiteAuditStore, session_id: str) -> ReplayReport:
    """Re-derive every recorded decision and reconcile result of ``session_id``."""
    records = list(store.records(session_id))
    if not records or records[0].kind != "session":
        raise AuditError(f"no session {session_id} in {store.path}")
    gate = Gate(Profile.model_validate(records[0].data["profile"]))
    state = ReviewState()
    reviewing = records[0].data.get("review") is not None
    mismatches: list[str] = []
    decisions = reconciles = 0
    raw: str | bytes = ""
    reoriented = False
    last: Decision | None = None
    for record in records[1:]:
        data, step = record.data, record.step
        if record.kind == "step":
            raw = base64.b64decode(data["raw_b64"]) if "raw_b64" in data else data["raw"]
            reoriented = False
            if reviewing:
                parsed = gate.parse(raw)
                flags = state.flags(parsed) if parsed is not None else ()
                recorded = data.get("flags", [])
                again = [flag.model_dump(mode="json") for flag in flags]
                reconciles += 1
                if again != recorded:
                    mismatches.append(f"step {step}: reconcile flags differ")
        elif record.kind == "supervision":
            reoriented = data["action"] == "reorient"
        elif record.kind == "decision":
            last = gate.withhold(REORIENTED) if reoriented else gate.decide(raw)
            decisions += 1
            replayed = {
                "action": last.action_type,
                "verdict": last.verdict.value,
                "message": last.message,
                "detail": last.detail,
            }
            if replayed != data:
                mismatches.append(
                    f"step {step}: recorded {data['verdict']} {data['message']!r}, "
                    f"replayed {replayed['verdict']} {replayed['message']!r}"
                )
        elif record.kind == "observation":
            observation = Observation.model_validate(data)
            gate.observe(observation)
            if reviewing and last is not None and last.step is not None and step is not None:
                state.note_executed(step, last.step, observation)
    return ReplayReport(session_id, decisions, reconciles, tuple(mismatches))
