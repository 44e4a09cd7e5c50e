"""The belief masks (seed 001, masks A-E) and their purely observational updates.

Masks move only on what an executor observed, after the fact: evidence never moves
backwards, an affordance is set only by a command that needed it, a posture is
eliminated only by an explicit signal in the output of a successful evaluator the
profile names, run as a plain command over input the agent did not write.
"""

from __future__ import annotations

import posixpath
import re
import shlex
from dataclasses import dataclass, field

from .profile import ActionSpec, Profile
from .protocol import (
    EVIDENCE_ORDER,
    AffordanceState,
    Belief,
    EvidenceState,
    MasksView,
    Observation,
    PostureClaim,
)
from .provenance import written_path

__all__ = ["Masks"]


@dataclass
class Masks:
    """Mask state for one scenario: A affordance, B evidence, C posture, D stability.

    E (termination eligibility) is derived, never stored.
    """

    affordances: dict[str, AffordanceState]
    stability_window: int = 2
    evidence: EvidenceState = "none"
    posture_admissible: dict[str, bool] = field(
        default_factory=lambda: {"compliant": True, "non_compliant": True}
    )
    posture_history: list[PostureClaim] = field(default_factory=list)
    missing: set[str] = field(default_factory=set)  # programs observed missing (exit 127)
    written: set[str] = field(default_factory=set)  # workdir files the agent's write actions made
    #: why the last observation's output, which a signal matched, moved no posture
    refused: str | None = None

    @classmethod
    def for_profile(cls, profile: Profile) -> Masks:
        return cls(
            affordances=dict.fromkeys(profile.affordances, "unknown"),
            stability_window=profile.stability_window,
        )

    # D: stability ------------------------------------------------------------------
    @property
    def posture_stable(self) -> bool:
        """The last N posture claims are equal and not ``unknown``."""
        window = self.posture_history[-self.stability_window :]
        return (
            len(window) == self.stability_window
            and window[0] != "unknown"
            and all(claim == window[0] for claim in window)
        )

    # E: termination eligibility ----------------------------------------------------
    @property
    def termination_allowed(self) -> bool:
        return (
            self.evidence == "successful"
            and sum(self.posture_admissible.values()) == 1
            and self.posture_stable
        )

    # Updates (after execution, never before) -----------------------------------------
    def apply(
        self,
        spec: ActionSpec,
        observation: Observation,
        profile: Profile,
        *,
        required: str | None,
    ) -> None:
        """Move the masks on what ``observation`` shows about an action of kind ``spec``
        that needed the affordance ``required`` (``spec.required(path)``)."""
        self.refused = None
        if required is not None and observation.kind == "command":
            self._capability(required, observation, profile.providers.get(required, ()))
        if not observation.success:
            return
        if observation.kind == "artifact" and observation.path:
            self.written.add(written_path(observation.path))
        if spec.evidence_on_success is not None and (
            EVIDENCE_ORDER[spec.evidence_on_success] > EVIDENCE_ORDER[self.evidence]
        ):
            self.evidence = spec.evidence_on_success
        for name in spec.posture_signals:
            signal = profile.signals[name]
            eliminated = signal.eliminates(observation)
            if eliminated is None:
                continue
            refused = signal.refusal(observation, self.written)
            if refused is not None:
                self.refused = f"{name}: {refused}"
            else:
                self.posture_admissible[eliminated] = False

    def _capability(
        self, affordance: str, observation: Observation, providers: tuple[str, ...]
    ) -> None:
        """A program found makes its affordance available; one missing makes it
        unavailable once every program that provides it was observed missing (with no
        providers named, or no program to be told from the observation, at once)."""
        if observation.program_found is None:
            return
        program = _program(observation)
        if observation.program_found:
            if not providers or program is None or program in providers:
                self.affordances[affordance] = "available"
            return
        if program is not None:
            self.missing.add(program)
        if not providers or program is None or set(providers) <= self.missing:
            self.affordances[affordance] = "unavailable"

    def record_claim(self, claim: PostureClaim) -> None:
        self.posture_history.append(claim)

    # Consistency -----------------------------------------------------------------------
    def inconsistency(self, belief: Belief) -> str | None:
        """Which part of a claimed belief exceeds or contradicts the masks, if any.

        ``unknown`` is always consistent; evidence may be understated, never overstated.
        """
        for name, claimed in sorted(belief.affordances.items()):
            if claimed != "unknown" and claimed != self.affordances.get(name, "unknown"):
                return f"belief.affordances.{name}"
        if EVIDENCE_ORDER[belief.evidence] > EVIDENCE_ORDER[self.evidence]:
            return "belief.evidence"
        if belief.posture != "unknown" and not self.posture_admissible[belief.posture]:
            return "belief.posture"
        return None

    def view(self) -> MasksView:
        # Built from state this class already keeps valid: no need to validate again.
        return MasksView.model_construct(
            affordances=dict(self.affordances),
            evidence=self.evidence,
            posture_admissible=dict(self.posture_admissible),
            posture_history=tuple(self.posture_history),
            posture_stable=self.posture_stable,
            termination_allowed=self.termination_allowed,
        )


_NOT_FOUND = re.compile(r"([^\s:]+): (?:command )?not found")


def _program(observation: Observation) -> str | None:
    """The program a command ran, or the one its shell could not find, as a bare name."""
    if observation.program_found is False:
        said = _NOT_FOUND.search(observation.stderr.text)
        if said is not None:
            return posixpath.basename(said.group(1))
    try:
        words = shlex.split(observation.command or "")
    except ValueError:
        return None
    return posixpath.basename(words[0]) if words else None
