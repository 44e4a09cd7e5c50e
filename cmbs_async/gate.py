"""The CMBS gate: a permissive, stateful gatekeeper that observes execution outcomes and
blocks only epistemically invalid transitions (seed 000).

Pure and synchronous: no I/O, no clock, no domain knowledge. Per step, in order:
schema check, belief consistency against the masks, action legality (rules 1-4),
verdict. Observations are applied to the masks when they arrive, after execution.
Usable on its own inside any agent loop::

    gate = Gate(load_profile("ciso"))
    decision = gate.decide(raw_step)
    if decision.needs_execution:
        gate.observe(await run_it(decision))

What the gate judges (consistency, legality, the final posture) is a :class:`Rules`
object, replaceable for baselines and experiments; the bookkeeping is the gate's.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeAlias, cast

from pydantic import ValidationError

from ._bounds import oversized_reason
from ._errors import CmbsError, validation_reason
from .evaluators import Evaluation
from .masks import Masks
from .profile import ActionSpec, Profile
from .protocol import (
    PAYLOAD_MODELS,
    ActionKind,
    AgentStep,
    ArtifactPayload,
    Belief,
    CommandPayload,
    EmptyPayload,
    EvaluationPayload,
    MasksView,
    Observation,
    Posture,
    PosturePayload,
    Response,
    Verdict,
)

__all__ = ["Decision", "Gate", "Messages", "ObservationOwed", "Payload", "Rules"]

#: A step's payload, as the gate parsed it under its action's kind.
Payload: TypeAlias = (
    ArtifactPayload | CommandPayload | EvaluationPayload | PosturePayload | EmptyPayload
)


class ObservationOwed(CmbsError, RuntimeError):
    """``decide()`` was called while an allowed action's observation was still owed: the
    masks would judge the next step without what that action really did."""


class Messages:
    """The only things the gate ever says: neutral, procedural, never a hint."""

    INVALID_FORMAT = "Invalid format. Re-emit."
    INCONSISTENT = "Belief inconsistent with observations."
    POSTURE_WITHOUT_EVIDENCE = "Posture declaration not permitted without successful execution."
    POSTURE_INADMISSIBLE = "Posture declaration not permitted; posture not admissible."
    TERMINATION_BLOCKED = "Termination blocked; belief incomplete."
    CAPABILITY_UNAVAILABLE = "Action blocked; capability observed unavailable. Continue."
    ALLOWED = "Action allowed."
    POSTURE_ACCEPTED = "Posture declaration accepted."
    TERMINATED = "Termination accepted."


@dataclass(frozen=True, slots=True, kw_only=True)
class Decision:
    """The gate's verdict on one step, with what it parsed.

    ``evaluation`` is set when what must run is an evaluation (an action of kind
    ``run_evaluation``, or a command that parses exactly into one of its signals'
    evaluators): run exactly its ``argv``, with no shell, as
    :meth:`~executors.base.Executor.run_program` does, the program resolved by
    :meth:`~executors.base.Executor.resolve_program`; only such a run's output may move a
    posture.
    """

    step_number: int
    verdict: Verdict
    message: str
    detail: str | None = None
    step: AgentStep | None = None
    spec: ActionSpec | None = None
    payload: Payload | None = None
    evaluation: Evaluation | None = None

    @property
    def action_type(self) -> str | None:
        return None if self.step is None else self.step.action.type

    @property
    def needs_execution(self) -> bool:
        """Allowed, and something must run for it: feed the outcome to ``observe``."""
        return (
            self.verdict is Verdict.ALLOW and self.spec is not None and self.spec.kind in _EXECUTED
        )


_EXECUTED = (ActionKind.WRITE_ARTIFACT, ActionKind.RUN_COMMAND, ActionKind.RUN_EVALUATION)


class Rules:
    """What the gate judges: belief consistency, action legality (rules 1-4) and the
    posture a terminated run reports. The seed's rules, as they stand here.

    To change them (a baseline that allows everything, say), subclass and override any of
    the three methods, then pass an instance: ``Gate(profile, rules=...)`` or
    ``run_scenario(..., rules=...)``. Each method reads the masks, never changes them,
    and returns; the bookkeeping stays the gate's whatever the rules say: the masks move
    only on observations (and a consistent step's posture claim joins their history), an
    allowed posture declaration is recorded, an allowed action that runs awaits its
    observation, and a step that is not well formed never reaches the rules (it gets
    ``CONTINUE``, :attr:`Messages.INVALID_FORMAT`).
    """

    def inconsistency(self, masks: Masks, belief: Belief) -> str | None:
        """Where ``belief`` exceeds or contradicts the masks (``"belief.evidence"``, say),
        or ``None``. An inconsistent step gets ``CONTINUE`` with this as its detail."""
        return masks.inconsistency(belief)

    def legality(self, masks: Masks, spec: ActionSpec, payload: Payload) -> tuple[Verdict, str]:
        """The verdict on a consistent step and its neutral message: ``ALLOW``, ``BLOCK``
        or ``TERMINATE`` (which ends the run)."""
        if isinstance(payload, PosturePayload):  # rule 1
            if masks.evidence != "successful":
                return Verdict.BLOCK, Messages.POSTURE_WITHOUT_EVIDENCE
            if not masks.posture_admissible[payload.posture]:
                return Verdict.BLOCK, Messages.POSTURE_INADMISSIBLE
            return Verdict.ALLOW, Messages.POSTURE_ACCEPTED
        if spec.kind is ActionKind.TERMINATE:  # rule 2
            if not masks.termination_allowed:
                return Verdict.BLOCK, Messages.TERMINATION_BLOCKED
            return Verdict.TERMINATE, Messages.TERMINATED
        required = spec.required(payload.path if isinstance(payload, ArtifactPayload) else None)
        if required is not None and masks.affordances[required] == "unavailable":
            return Verdict.BLOCK, Messages.CAPABILITY_UNAVAILABLE  # rule 3
        return Verdict.ALLOW, Messages.ALLOWED  # rule 4

    def final_posture(self, masks: Masks, declared: Posture | None) -> Posture | None:
        """The posture a terminated run reports: the stable claim, once termination is
        earned (``declared`` is the last posture declaration allowed, if any)."""
        if not masks.termination_allowed:
            return None
        claim = masks.posture_history[-1]
        return None if claim == "unknown" else claim


class Gate:
    """The supervisor's whole judgement for one scenario, under ``rules`` (the seed's by
    default)."""

    def __init__(self, profile: Profile, *, rules: Rules | None = None) -> None:
        self.profile = profile
        self.rules = rules if rules is not None else Rules()
        self.masks = Masks.for_profile(profile)
        self.step_count = 0
        self.declared_posture: Posture | None = None
        self.last_observation: Observation | None = None
        self._awaiting: ActionSpec | None = None
        self._required: str | None = None  # the affordance the awaited action needed
        self._evaluation: Evaluation | None = None  # what the awaited action must run
        self._wrote: str | None = None  # the SHA-256 of what the awaited action writes

    @property
    def masks_view(self) -> MasksView:
        return self.masks.view()

    @property
    def awaiting_observation(self) -> bool:
        return self._awaiting is not None

    def decide(self, raw: str | bytes | Mapping[str, Any] | AgentStep) -> Decision:
        """Judge one agent message; never raises, whatever the message, but
        :class:`ObservationOwed` while the last allowed action's observation is owed."""
        if self._awaiting is not None:
            raise ObservationOwed(
                f"step {self.step_count} ({self._awaiting.kind.value}) was allowed to run: "
                "pass what running it observed to observe() before deciding the next step"
            )
        self.step_count += 1
        self._awaiting = None
        number = self.step_count

        parsed = self._parse(raw)
        if isinstance(parsed, str):
            return Decision(
                step_number=number,
                verdict=Verdict.CONTINUE,
                message=Messages.INVALID_FORMAT,
                detail=parsed,
            )
        step, spec, payload, evaluation = parsed

        where = self.rules.inconsistency(self.masks, step.belief)
        if where is not None:
            return Decision(
                step_number=number,
                verdict=Verdict.CONTINUE,
                message=Messages.INCONSISTENT,
                detail=where,
                step=step,
                spec=spec,
            )
        self.masks.record_claim(step.belief.posture)

        verdict, message = self.rules.legality(self.masks, spec, payload)
        if verdict is Verdict.ALLOW:
            if isinstance(payload, PosturePayload):
                self.declared_posture = payload.posture
            elif spec.kind is not ActionKind.TERMINATE:
                self._awaiting = spec
                path = payload.path if isinstance(payload, ArtifactPayload) else None
                self._required = spec.required(path)
                self._evaluation = evaluation
                self._wrote = (
                    hashlib.sha256(payload.content.encode()).hexdigest()
                    if isinstance(payload, ArtifactPayload)
                    else None
                )
        return Decision(
            step_number=number,
            verdict=verdict,
            message=message,
            step=step,
            spec=spec,
            payload=payload,
            evaluation=evaluation if verdict is Verdict.ALLOW else None,
        )

    def parse(self, raw: str | bytes | Mapping[str, Any] | AgentStep) -> AgentStep | None:
        """The step ``raw`` holds if it is well formed under the profile, else ``None``."""
        parsed = self._parse(raw)
        return parsed[0] if isinstance(parsed, tuple) else None

    def withhold(self, message: str, detail: str | None = None) -> Decision:
        """Count a step that a layer above the gate did not let through: masks stay as they are."""
        self.step_count += 1
        self._awaiting = None
        return Decision(
            step_number=self.step_count, verdict=Verdict.CONTINUE, message=message, detail=detail
        )

    def observe(self, observation: Observation) -> None:
        """Apply what really happened when the last allowed action ran."""
        if self._awaiting is None:
            raise RuntimeError("no allowed action is awaiting an observation")
        self.masks.apply(
            self._awaiting,
            observation,
            self.profile,
            required=self._required,
            evaluation=self._evaluation,
            wrote=self._wrote,
            step=self.step_count,
        )
        self.last_observation = observation
        self._awaiting = None

    def response(self, decision: Decision) -> Response:
        """The neutral answer to send back to the agent for ``decision``."""
        return Response(
            step=decision.step_number,
            verdict=decision.verdict,
            message=decision.message,
            detail=decision.detail,
            masks=self.masks.view(),
            last_observation=self.last_observation,
        )

    @property
    def final_posture(self) -> Posture | None:
        """The posture a run ends with, as the rules say (by default the stable claim,
        once termination is earned)."""
        return self.rules.final_posture(self.masks, self.declared_posture)

    def _parse(
        self, raw: str | bytes | Mapping[str, Any] | AgentStep
    ) -> tuple[AgentStep, ActionSpec, Payload, Evaluation | None] | str:
        too_large = oversized_reason(raw)  # a step over the cap, kept as its size and hash
        if too_large is not None:
            return too_large
        try:
            if isinstance(raw, AgentStep):
                step = raw
            elif isinstance(raw, str | bytes | bytearray):
                step = AgentStep.model_validate_json(raw)
            else:
                step = AgentStep.model_validate(raw)
        except ValidationError as exc:
            return validation_reason(exc)
        spec = self.profile.actions.get(step.action.type)
        if spec is None:
            return f"action.type: unknown action type {step.action.type!r}"
        for name in step.belief.affordances:
            if name not in self.masks.affordances:
                return f"belief.affordances.{name}: unknown affordance"
        try:
            # PAYLOAD_MODELS maps every kind to one member of Payload
            payload = cast(Payload, PAYLOAD_MODELS[spec.kind].model_validate(step.action.payload))
        except ValidationError as exc:
            return f"action.payload.{validation_reason(exc)}"
        try:
            evaluation = self._evaluation_of(step.action.type, spec, payload)
        except ValueError as exc:
            return f"action.payload.{exc}"
        return step, spec, payload, evaluation

    def _evaluation_of(self, name: str, spec: ActionSpec, payload: Payload) -> Evaluation | None:
        """The evaluation an action is: the one it names, or the first of its signals'
        evaluators its command parses exactly into."""
        evaluators = self.profile.evaluators
        if isinstance(payload, EvaluationPayload) and spec.evaluator is not None:
            values = dict(payload.model_extra or {})
            return evaluators[spec.evaluator].build(spec.evaluator, values)
        if not isinstance(payload, CommandPayload):
            return None
        for signal in spec.posture_signals:
            for evaluator in self.profile.signals[signal].evaluators:
                fitted = evaluators[evaluator].fit(evaluator, payload.command)
                if fitted is not None:
                    return fitted
        return None
