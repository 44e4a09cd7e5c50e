"""RECONCILE (seed 002): a cheap, deterministic filter over the agent's self-assessment.

No model, no I/O. Only when a flag is raised (or ``always_supervise``) is a reviewer asked.
"""

from __future__ import annotations

from enum import StrEnum

from pydantic import BaseModel, ConfigDict

from ..protocol import Assessment, Commitment

__all__ = ["CONFIDENCE_THRESHOLD", "MAX_ASSUMPTIONS", "Flag", "Severity", "reconcile"]

CONFIDENCE_THRESHOLD = 0.7
MAX_ASSUMPTIONS = 3


class Severity(StrEnum):
    LOW = "low"
    MEDIUM = "medium"
    HIGH = "high"


class Flag(BaseModel):
    """One raised trigger."""

    model_config = ConfigDict(frozen=True)

    trigger: str
    severity: Severity
    detail: str


def reconcile(assessment: Assessment | None, commitment: Commitment | None) -> tuple[Flag, ...]:
    """The seed's five triggers over a post-checkpoint and its step's pre-checkpoint."""
    flags: list[Flag] = []
    if assessment is not None:
        if assessment.concerns:
            flags.append(
                Flag(
                    trigger="concerns_raised",
                    severity=Severity.MEDIUM,
                    detail=f"{len(assessment.concerns)} concern(s) reported",
                )
            )
        if not assessment.commitment_met:
            flags.append(
                Flag(
                    trigger="commitment_not_met",
                    severity=Severity.HIGH,
                    detail="the agent says its commitment was not met",
                )
            )
        if assessment.scope_changed:
            flags.append(
                Flag(
                    trigger="scope_deviation",
                    severity=Severity.HIGH,
                    detail="the scope changed during execution",
                )
            )
        if assessment.confidence < CONFIDENCE_THRESHOLD:
            flags.append(
                Flag(
                    trigger="low_confidence",
                    severity=Severity.MEDIUM,
                    detail=f"confidence {assessment.confidence:g} < {CONFIDENCE_THRESHOLD:g}",
                )
            )
    if commitment is not None and len(commitment.assumptions) > MAX_ASSUMPTIONS:
        flags.append(
            Flag(
                trigger="excess_assumptions",
                severity=Severity.LOW,
                detail=f"{len(commitment.assumptions)} assumptions > {MAX_ASSUMPTIONS}",
            )
        )
    return tuple(flags)
