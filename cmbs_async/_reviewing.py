"""The review layer as the supervisor sees it: screen a step, rule on it, learn what ran.
A run without a review gets a reviewer that passes every step through untouched, so the
supervisor never asks which one it has (and parses nothing the gate will parse anyway)."""

from __future__ import annotations

from typing import Protocol

from .agents.base import AgentMessage
from .gate import Decision, Gate
from .protocol import AgentStep, Observation
from .review.layer import Review, ReviewLayer, SupervisionRecord
from .review.reconcile import Flag

__all__ = ["Reviewing", "reviewing"]


class Reviewing(Protocol):
    def screen(self, message: AgentMessage) -> tuple[AgentStep | None, tuple[Flag, ...]]:
        """The step ``message`` holds, if it was parsed, and the reconciler's flags on it."""

    async def assess(
        self, number: int, step: AgentStep | None, flags: tuple[Flag, ...]
    ) -> SupervisionRecord | None:
        """The review's ruling on a parsed step, or ``None`` when it makes none."""

    def executed(self, decision: Decision, observation: Observation) -> None:
        """Note what ran for ``decision``: the next step is reconciled against it."""


def reviewing(review: Review | None, gate: Gate, *, goal: str, scenario_id: str) -> Reviewing:
    """The review layer for one scenario (``review``), or none."""
    if review is None:
        return _Unreviewed()
    return _Reviewed(ReviewLayer(review, goal=goal, scenario_id=scenario_id), gate)


class _Unreviewed:
    def screen(self, message: AgentMessage) -> tuple[AgentStep | None, tuple[Flag, ...]]:
        return None, ()

    async def assess(
        self, number: int, step: AgentStep | None, flags: tuple[Flag, ...]
    ) -> SupervisionRecord | None:
        return None

    def executed(self, decision: Decision, observation: Observation) -> None:
        pass


class _Reviewed:
    def __init__(self, layer: ReviewLayer, gate: Gate) -> None:
        self._layer = layer
        self._gate = gate

    def screen(self, message: AgentMessage) -> tuple[AgentStep | None, tuple[Flag, ...]]:
        step = self._gate.parse(message)
        return step, self._layer.state.flags(step) if step is not None else ()

    async def assess(
        self, number: int, step: AgentStep | None, flags: tuple[Flag, ...]
    ) -> SupervisionRecord | None:
        return None if step is None else await self._layer.assess(number, step, flags)

    def executed(self, decision: Decision, observation: Observation) -> None:
        if decision.step is not None:
            self._layer.state.note_executed(decision.step_number, decision.step, observation)
