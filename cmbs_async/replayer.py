"""Replay: run the gate and the reconciler again over a recorded session (no agent, no
executor, no model) and check that every verdict comes out the same; or judge it again
under another profile, the recorded observations fed to the new gate, nothing re-run."""

from __future__ import annotations

from dataclasses import dataclass, field

from pydantic import ValidationError

from ._errors import validation_reason
from .audit.shape import data_problem
from .audit.store import AuditError, AuditRecord, AuditStore, RecordKind
from .gate import Decision, Gate
from .profile import Profile
from .protocol import MasksView, Observation, Verdict
from .records import decision_record, flag_data, recorded_message
from .review.layer import REORIENTED, ReviewAction, ReviewState
from .stopped import stopped_by

__all__ = ["ReplayReport", "ReplayedStep", "replay"]


@dataclass(frozen=True)
class ReplayedStep:
    """One step as the gate judged it again: its verdict and message, and the masks once
    what the step ran was observed; and, as a run's trace says them
    (:class:`~cmbs_async.result.TraceEntry`), which mask stopped a ``BLOCK`` or
    ``CONTINUE`` and why the evidence rule refused the output of what it ran (a signal
    matched it), if it did."""

    step: int
    verdict: Verdict
    message: str
    masks: MasksView
    stopped_by: str | None = None
    refused: str | None = None


@dataclass(frozen=True)
class ReplayReport:
    session_id: str
    decisions: int
    reconciles: int
    mismatches: tuple[str, ...]
    steps: tuple[ReplayedStep, ...] = ()

    @property
    def identical(self) -> bool:
        return not self.mismatches


def replay(store: AuditStore, session_id: str, *, profile: Profile | None = None) -> ReplayReport:
    """Re-derive every recorded decision and reconcile result of ``session_id``.

    With ``profile``, judge the recorded steps under it instead of the recorded one: each
    verdict that changes is a mismatch (an observation the new gate did not allow is not
    fed to it). A record without what replay reads of it (a decision with no verdict, a
    session with no profile, an observation that is not one) is an :class:`AuditError`,
    one line.
    """
    records = iter(store.records(session_id))
    first = next(records, None)
    if first is None or first.kind is not RecordKind.SESSION:
        raise AuditError(f"no session {session_id} in the audit store")
    _check_shape(first)
    if not isinstance(first.data.get("profile"), dict):
        raise _unreadable(first, "it holds no profile to judge the steps with")
    try:
        recorded = Profile.model_validate(first.data["profile"])
    except ValidationError as exc:
        raise _unreadable(first, f"its profile is not one ({validation_reason(exc)})") from None
    profile = profile or recorded
    replayer = _Replayer(Gate(profile), reviewing=first.data.get("review") is not None)
    for record in records:
        _check_shape(record)
        replayer.feed(record)
    return ReplayReport(
        session_id,
        replayer.decisions,
        replayer.reconciles,
        tuple(replayer.mismatches),
        tuple(replayer.steps.values()),
    )


#: What a step the recorded run did not let run is observed as, judged again.
_NOT_RUN = Observation(
    kind="command", success=False, error="not run: the recorded run did not allow it"
)


def _check_shape(record: AuditRecord) -> None:
    problem = data_problem(record)
    if problem is not None:
        raise _unreadable(record, f"not of its kind's shape: {problem}")


def _unreadable(record: AuditRecord, problem: str) -> AuditError:
    return AuditError(
        f"session {record.session_id} record {record.seq} ({record.kind.value}): {problem}; "
        "`cmbs audit verify` says more"
    )


@dataclass
class _Replayer:
    """The supervisor's side of a run, driven by its records instead of its actors."""

    gate: Gate
    reviewing: bool
    state: ReviewState = field(default_factory=ReviewState)
    decisions: int = 0
    steps: dict[int, ReplayedStep] = field(default_factory=dict)
    reconciles: int = 0
    mismatches: list[str] = field(default_factory=list)
    raw: str | bytes = ""
    reoriented: bool = False
    last: Decision | None = None

    def feed(self, record: AuditRecord) -> None:
        data, step = record.data, record.step
        if record.kind is RecordKind.STEP:
            self.raw, self.reoriented = recorded_message(data), False
            if self.reviewing:
                self._reconcile(step, data.get("flags", []))
        elif record.kind is RecordKind.SUPERVISION:
            self.reoriented = data.get("action") == ReviewAction.REORIENT
        elif record.kind is RecordKind.DECISION:
            self._decide(step, data)
        elif record.kind is RecordKind.EVIDENCE:
            if self.gate.masks.chain != data:
                self.mismatches.append(f"step {step}: the evidence chain differs")
        elif record.kind is RecordKind.OBSERVATION:
            try:
                observation = Observation.model_validate(data)
            except ValidationError as exc:
                problem = f"not of its kind's shape ({validation_reason(exc)})"
                raise _unreadable(record, problem) from None
            if not self.gate.awaiting_observation:  # judged otherwise now: nothing ran for it
                return
            self.gate.observe(observation)
            self._replayed(step, observed=True)
            last = self.last
            if self.reviewing and last is not None and last.step is not None and step is not None:
                self.state.note_executed(step, last.step, observation)

    def _replayed(self, step: int | None, *, observed: bool = False) -> None:
        """Note the last decision, with the masks as they now are, for ``step``: which mask
        stopped it, and (``observed``: what it ran was) why the evidence rule refused its
        output, as the runtime traces them."""
        if step is not None and self.last is not None:
            last, masks = self.last, self.gate.masks
            stopped = last.verdict in (Verdict.BLOCK, Verdict.CONTINUE)
            self.steps[step] = ReplayedStep(
                step,
                last.verdict,
                last.message,
                self.gate.masks_view,
                stopped_by=stopped_by(last, masks) if stopped else None,
                refused=masks.refused if observed else None,
            )

    def _reconcile(self, step: int | None, recorded: object) -> None:
        parsed = self.gate.parse(self.raw)
        flags = self.state.flags(parsed) if parsed is not None else ()
        self.reconciles += 1
        if flag_data(flags) != recorded:
            self.mismatches.append(f"step {step}: reconcile flags differ")

    def _decide(self, step: int | None, recorded: dict[str, object]) -> None:
        gate = self.gate
        if gate.awaiting_observation:  # allowed now, refused when recorded: it never ran
            gate.observe(_NOT_RUN)
        self.last = gate.withhold(REORIENTED) if self.reoriented else gate.decide(self.raw)
        self.decisions += 1
        self._replayed(step)
        replayed = decision_record(self.last).data
        if replayed != recorded:
            self.mismatches.append(
                f"step {step}: recorded {recorded['verdict']} {recorded['message']!r}, "
                f"replayed {replayed['verdict']} {replayed['message']!r}"
            )
