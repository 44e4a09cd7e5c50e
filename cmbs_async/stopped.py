"""Which mask kept a step from going through, in words: what a run's trace, the terminal,
a replay and the viewer say beside a ``BLOCK`` or ``CONTINUE``."""

from __future__ import annotations

from .gate import Decision, Messages
from .masks import Masks
from .protocol import ArtifactPayload
from .review.layer import REORIENTED

__all__ = ["stopped_by"]


def stopped_by(decision: Decision, masks: Masks) -> str | None:
    """Which mask kept a step from going through, in words, as the gate's message and
    detail and the masks say; ``None`` for a message the gate's own rules never give."""
    message, detail = decision.message, decision.detail or ""
    admissible = " and ".join(p for p, ok in masks.posture_admissible.items() if ok) or "none"
    evidence = f"evidence ({masks.evidence}, not successful)"
    if message == Messages.INVALID_FORMAT:
        return "no mask: the step is not well formed"
    if message == REORIENTED:
        return "no mask: the review sent the step back"
    if message == Messages.INCONSISTENT:
        if detail == "belief.evidence":
            return f"evidence (the belief claims more than {masks.evidence})"
        if detail == "belief.posture":
            return f"posture admissibility (the belief's posture is eliminated: {admissible} left)"
        if detail.startswith("belief.affordances."):
            name = detail.removeprefix("belief.affordances.")
            return f"affordance {name} ({masks.affordances.get(name, 'unknown')})"
        return None
    if message == Messages.POSTURE_WITHOUT_EVIDENCE:
        return evidence
    if message == Messages.POSTURE_INADMISSIBLE:
        return f"posture admissibility (only {admissible} admissible)"
    if message == Messages.CAPABILITY_UNAVAILABLE:  # the affordance the action needs
        payload = decision.payload
        path = payload.path if isinstance(payload, ArtifactPayload) else None
        needed = decision.spec.required(path) if decision.spec is not None else None
        return f"affordance {needed} (unavailable)" if needed is not None else None
    if message == Messages.TERMINATION_BLOCKED:
        why = []
        if masks.evidence != "successful":
            why.append(evidence)
        if sum(masks.posture_admissible.values()) != 1:
            why.append(f"posture admissibility ({admissible} admissible, one needed)")
        if not masks.posture_stable:
            claims = ", ".join(masks.posture_history[-masks.stability_window :]) or "none"
            window = masks.stability_window
            why.append(f"stability (last claims: {claims}; {window} equal and known needed)")
        return "; ".join(why) or None
    return None
