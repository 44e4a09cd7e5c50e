"""The belief masks (seed 001, masks A-E) and their purely observational updates.

Masks move only on what an executor observed, after the fact: evidence never moves
backwards, an affordance is set only by a command that needed it, a posture is
eliminated only by an explicit signal in the output of a successful evaluation: one of
the profile's evaluators, run as the argument vector the gate judged (no shell), by a
program resolved outside every writable place, over input files that are not the agent's
own writing by content (whatever their names: a copy, rename or link of a file a write
action made is still that file).
"""

from __future__ import annotations

import posixpath
import re
import shlex
from dataclasses import dataclass, field
from typing import Any

from .evaluators import Evaluation
from .profile import ActionSpec, Profile
from .protocol import (
    EVIDENCE_ORDER,
    AffordanceState,
    Belief,
    EvidenceState,
    InputFile,
    MasksView,
    Observation,
    PostureClaim,
)

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
    #: content the agent's write actions made (SHA-256 -> the path it was written as)
    agent_content: dict[str, str] = field(default_factory=dict)
    #: content commands made (SHA-256 -> "step N: command"), for the provenance chain
    produced: dict[str, str] = field(default_factory=dict)
    #: why the last observation's output, which a signal matched, moved no posture
    refused: str | None = None
    #: the last evaluation's provenance chain: program, inputs and where each came from,
    #: what it eliminated or why it was refused
    chain: dict[str, Any] | None = None

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
        evaluation: Evaluation | None = None,
        wrote: str | None = None,
        step: int | None = None,
    ) -> None:
        """Move the masks on what ``observation`` shows about an action of kind ``spec``
        that needed the affordance ``required`` (``spec.required(path)``).

        ``evaluation`` is what the gate judged the action to be, if an evaluation;
        ``wrote`` the SHA-256 of a write action's content; ``step`` its number."""
        self.refused = None
        self.chain = None
        if required is not None and observation.kind == "command":
            self._capability(required, observation, profile.providers.get(required, ()))
        self._provenance(observation, wrote, step)
        if not observation.success:
            return
        if spec.evidence_on_success is not None and (
            EVIDENCE_ORDER[spec.evidence_on_success] > EVIDENCE_ORDER[self.evidence]
        ):
            self.evidence = spec.evidence_on_success
        for name in spec.posture_signals:
            signal = profile.signals[name]
            eliminated = signal.eliminates(observation)
            if eliminated is None:
                continue
            refused = self._refusal(signal.evaluators, evaluation, observation)
            if evaluation is not None and observation.argv is not None:
                self.chain = self._chain(name, evaluation, observation, eliminated, refused)
            if refused is not None:
                self.refused = f"{name}: {refused}"
            else:
                self.posture_admissible[eliminated] = False

    def _provenance(self, observation: Observation, wrote: str | None, step: int | None) -> None:
        """Remember whose content each file the action made holds."""
        if wrote is not None and observation.success and observation.path is not None:
            self.agent_content.setdefault(wrote, observation.path)
        command = (observation.command or "")[:200]
        said = f"step {step}: {command}" if step is not None else command
        for change in observation.changes:
            digest = change.sha256
            if change.change == "removed" or digest is None:
                continue
            if observation.kind == "artifact":
                self.agent_content.setdefault(digest, change.path)
            elif digest not in self.agent_content:
                self.produced.setdefault(digest, said)

    def _refusal(
        self, evaluators: tuple[str, ...], evaluation: Evaluation | None, observed: Observation
    ) -> str | None:
        """Why an observation a signal matched may not move a posture, or ``None``."""
        if not evaluators:
            return None
        if evaluation is None or evaluation.evaluator not in evaluators:
            return "not one of the signal's evaluators, run as its argument vector"
        program = observed.program
        if (
            observed.argv is None
            or program is None
            or program.name not in evaluation.programs
            or observed.argv != (program.path, *evaluation.argv[1:])
        ):
            return "what ran is not the evaluation the gate judged"
        changed = {c.path for c in observed.changes} | {c.source for c in observed.changes}
        for found in observed.inputs:
            why = self._file_refusal(found)
            if why is not None:
                return why
            if found.path is not None and found.path in changed:
                return f"its {found.role} {found.argument[:60]!r} changed while it ran"
        identified = {(found.role, found.argument) for found in observed.inputs}
        for role, arguments in (("input", evaluation.inputs), ("file", evaluation.files)):
            for argument in arguments:
                if (role, argument) not in identified:
                    return f"its {role} {argument[:60]!r} was not identified"
        return None

    def _file_refusal(self, found: InputFile) -> str | None:
        """Why a file an evaluation was handed keeps its output from counting, or ``None``."""
        named = f"its {found.role} {found.argument[:60]!r}"
        if found.sha256 is None:
            if found.role == "variable" and found.outside != "no such file":
                return None  # where the operator put it, outside the workdir
            return f"{named} is not a file in the workdir ({found.outside})"
        if found.role != "file" and found.sha256 in self.agent_content:
            wrote = self.agent_content[found.sha256]
            return f"{named} is the agent's own writing ({wrote[:60]!r})"
        return None

    def _chain(
        self,
        signal: str,
        evaluation: Evaluation,
        observed: Observation,
        eliminated: str,
        refused: str | None,
    ) -> dict[str, Any]:
        """The provenance chain of an evaluation: collector -> input -> evaluation -> posture."""
        inputs = []
        for found in observed.inputs:
            digest = found.sha256
            if digest is None:
                origin = None
            elif digest in self.agent_content:
                origin = f"the agent's write action ({self.agent_content[digest]})"
            else:
                origin = self.produced.get(digest, "in the workdir before the run")
            inputs.append(found.model_dump(mode="json") | {"origin": origin})
        program = observed.program.model_dump(mode="json") if observed.program else None
        return {
            "signal": signal,
            "evaluator": evaluation.evaluator,
            "argv": list(observed.argv or ()),
            "program": program,
            "inputs": inputs,
            "eliminates": None if refused else eliminated,
            "refused": refused,
        }

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
