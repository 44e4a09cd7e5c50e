"""The review layer on top of the gate: reconcile every step, supervise flagged ones,
reorient with a bounded number of attempts, pause to a human. It can stop more than
the gate, never allow more: a step it lets through still goes to the gate."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from enum import StrEnum

import anyio
from pydantic import BaseModel, ConfigDict

from ..protocol import AgentStep, Assessment, Commitment, Observation
from .config import SupervisionConfig
from .human import HumanChannel, HumanDecision, HumanRequest
from .reconcile import Flag, reconcile
from .reviewer import Reviewer, ReviewerError, ReviewRequest, ReviewVerdict, Verdict3

__all__ = [
    "REORIENTED",
    "Review",
    "ReviewAction",
    "ReviewLayer",
    "ReviewState",
    "SupervisionRecord",
]

#: What the agent is told, beside the correction, when a review sends it back.
REORIENTED = "Step not executed; supervisor correction attached. Re-attempt the step."


class ReviewAction(StrEnum):
    PROCEED = "proceed"
    REORIENT = "reorient"
    ABORT = "abort"
    PAUSED_NO_HUMAN = "paused_no_human"


class SupervisionRecord(BaseModel):
    """The seed's supervision record for one reviewed step (signed in the audit trail)."""

    model_config = ConfigDict(frozen=True)

    step: int
    reviewed_step: int | None
    flags: tuple[Flag, ...]
    verdict: Verdict3
    reasoning: str
    correction: str = ""
    fail_closed: bool = False
    human: HumanDecision | None = None
    action: ReviewAction
    attempts: int = 0


@dataclass(frozen=True)
class Review:
    """What a caller hands ``run_scenario`` to turn the review layer on."""

    reviewer: Reviewer
    config: SupervisionConfig = field(default_factory=SupervisionConfig)
    human: HumanChannel | None = None


@dataclass
class ReviewState:
    """Pure bookkeeping shared by the live layer and replay: what was last executed."""

    last_commitment: Commitment | None = None
    last_executed_step: int | None = None
    last_trace: str = ""
    attempts: dict[int, int] = field(default_factory=lambda: defaultdict(int))

    def flags(self, step: AgentStep) -> tuple[Flag, ...]:
        return reconcile(step.assessment, self.last_commitment)

    def note_executed(self, number: int, step: AgentStep, observation: Observation | None) -> None:
        self.last_commitment = step.commitment
        self.last_executed_step = number
        payload = step.action.payload
        what = payload.get("command") or payload.get("path") or payload.get("posture") or ""
        lines = [f"step {number}: {step.action.type} {str(what)[:500]}"]
        if observation is not None:
            lines.append(f"result: {observation.summary()}")
            if observation.stdout.text.strip():
                lines.append(f"stdout: {observation.stdout.text[:1000]}")
            if observation.stderr.text.strip():
                lines.append(f"stderr: {observation.stderr.text[:500]}")
        self.last_trace = "\n".join(lines)


class ReviewLayer:
    """One scenario's review: decides what happens to a flagged step before the gate sees it."""

    def __init__(self, review: Review, *, goal: str, scenario_id: str) -> None:
        self.review = review
        self.config = review.config
        self.goal = goal
        self.scenario_id = scenario_id
        self.state = ReviewState()

    async def assess(
        self, number: int, step: AgentStep, flags: tuple[Flag, ...]
    ) -> SupervisionRecord | None:
        """``None`` when no review is needed; otherwise what the review decided."""
        if not flags and not self.config.always_supervise:
            return None
        verdict, fail_closed = await self._ask_reviewer(step, flags)
        key = self.state.last_executed_step or 0
        attempts = self.state.attempts[key]
        reasoning = verdict.reasoning
        if verdict.verdict is Verdict3.REORIENT:
            attempts = self.state.attempts[key] = attempts + 1
            if attempts <= self.config.max_reorient_attempts:
                return self._record(
                    number, flags, verdict, fail_closed, ReviewAction.REORIENT, attempts=attempts
                )
            reasoning = f"{reasoning} (reorient attempts exhausted: {attempts - 1})"
            verdict = ReviewVerdict(verdict=Verdict3.PAUSE, reasoning=reasoning)
        if verdict.verdict is Verdict3.CONTINUE:
            return self._record(
                number, flags, verdict, fail_closed, ReviewAction.PROCEED, attempts=attempts
            )
        human = self.review.human
        if human is None:
            return self._record(
                number, flags, verdict, fail_closed, ReviewAction.PAUSED_NO_HUMAN, attempts=attempts
            )
        decision = await human.decide(
            HumanRequest(
                scenario_id=self.scenario_id,
                step=number,
                reasoning=reasoning,
                action=step.action.type,
                payload=step.action.payload,
            )
        )
        if decision.decision == "modify":
            self.state.attempts[key] += 1
            verdict = ReviewVerdict(
                verdict=Verdict3.PAUSE, reasoning=reasoning, correction=decision.correction
            )
            action = ReviewAction.REORIENT
        else:
            action = ReviewAction.PROCEED if decision.decision == "proceed" else ReviewAction.ABORT
        return self._record(
            number,
            flags,
            verdict,
            fail_closed,
            action,
            attempts=self.state.attempts[key],
            human=decision,
        )

    async def _ask_reviewer(
        self, step: AgentStep, flags: tuple[Flag, ...]
    ) -> tuple[ReviewVerdict, bool]:
        request = ReviewRequest(
            goal=self.goal,
            commitment=_describe(self.state.last_commitment),
            trace=self.state.last_trace,
            assessment=_describe(step.assessment),
            flags=flags,
        )
        try:
            with anyio.fail_after(self.config.timeout_seconds):
                return await self.review.reviewer.review(request), False
        except (ReviewerError, TimeoutError) as exc:
            why = str(exc) or f"no verdict within {self.config.timeout_seconds:g} s"
            if isinstance(exc, TimeoutError):
                why = f"no verdict within {self.config.timeout_seconds:g} s"
            fallback = Verdict3(self.config.fail_closed_verdict)
            correction = (
                "The review of the last step could not be completed; re-check it before going on."
                if fallback is Verdict3.REORIENT
                else ""
            )
            return ReviewVerdict(
                verdict=fallback, reasoning=f"fail-closed: {why}", correction=correction
            ), True

    def _record(
        self,
        number: int,
        flags: tuple[Flag, ...],
        verdict: ReviewVerdict,
        fail_closed: bool,
        action: ReviewAction,
        *,
        attempts: int,
        human: HumanDecision | None = None,
    ) -> SupervisionRecord:
        correction = (
            (human.correction if human else verdict.correction)
            if (action is ReviewAction.REORIENT)
            else ""
        )
        return SupervisionRecord(
            step=number,
            reviewed_step=self.state.last_executed_step,
            flags=flags,
            verdict=verdict.verdict,
            reasoning=verdict.reasoning,
            correction=correction,
            fail_closed=fail_closed,
            human=human,
            action=action,
            attempts=attempts,
        )


def _describe(checkpoint: Commitment | Assessment | None) -> str:
    if checkpoint is None:
        return ""
    return checkpoint.model_dump_json(indent=2)
