"""The gate: rules 1-4, belief consistency, mask updates, and invariants over any
sequence of steps (hypothesis)."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cmbs_async import (
    ActionKind,
    ActionSpec,
    Belief,
    Decision,
    Gate,
    Masks,
    Messages,
    Observation,
    Output,
    Payload,
    PosturePayload,
    Rules,
    Verdict,
    load_profile,
)
from cmbs_async.protocol import EVIDENCE_ORDER, Posture

from .helpers import evaluation_ran, step

PROFILE = load_profile("ciso")


#: An evaluator the CISO profile admits, run as a plain command.
EVALUATE = "opa eval --data p.rego --input in.json data.check.result --format raw"


def ran(
    exit_status: int, stdout: str = "", *, found: bool | None = None, command: str = EVALUATE
) -> Observation:
    return Observation(
        kind="command",
        command=command,
        success=exit_status == 0,
        exit_status=exit_status,
        program_found=(exit_status != 127) if found is None else found,
        stdout=Output(head=stdout, total_bytes=len(stdout)),
        **(evaluation_ran(command) if command == EVALUATE else {}),
    )


WROTE = Observation(kind="artifact", path="p.yaml", success=True)


def earn_violation(gate: Gate) -> None:
    """Write an artifact and run an evaluator whose output shows a violation."""
    assert gate.decide(step("generate_script", {"path": "c.sh", "content": "x"})).needs_execution
    gate.observe(WROTE)
    assert gate.decide(step("check_status", {"command": EVALUATE})).needs_execution
    gate.observe(ran(0, "false\n"))


def test_rule1_posture_declaration_needs_successful_evidence() -> None:
    gate = Gate(PROFILE)
    decision = gate.decide(step("declare_posture", {"posture": "compliant"}, posture="compliant"))
    assert decision.verdict is Verdict.BLOCK
    assert decision.message == Messages.POSTURE_WITHOUT_EVIDENCE
    assert gate.declared_posture is None


def test_rule1_an_eliminated_posture_cannot_be_declared() -> None:
    gate = Gate(PROFILE)
    earn_violation(gate)
    decision = gate.decide(step("declare_posture", {"posture": "compliant"}, evidence="successful"))
    assert (decision.verdict, decision.message) == (Verdict.BLOCK, Messages.POSTURE_INADMISSIBLE)
    decision = gate.decide(
        step("declare_posture", {"posture": "non_compliant"}, posture="non_compliant")
    )
    assert decision.verdict is Verdict.ALLOW
    assert gate.declared_posture == "non_compliant"


def test_rule2_termination_must_be_earned() -> None:
    gate = Gate(PROFILE)
    assert gate.decide(step("terminate")).verdict is Verdict.BLOCK
    earn_violation(gate)
    # evidence and one admissible posture, but no stable claim yet
    blocked = gate.decide(step("terminate", evidence="successful"))
    assert (blocked.verdict, blocked.message) == (Verdict.BLOCK, Messages.TERMINATION_BLOCKED)
    gate.decide(step("declare_posture", {"posture": "non_compliant"}, posture="non_compliant"))
    done = gate.decide(step("terminate", posture="non_compliant", evidence="successful"))
    assert done.verdict is Verdict.TERMINATE
    assert gate.final_posture == "non_compliant"


def test_rule2_failed_execution_earns_nothing() -> None:
    gate = Gate(PROFILE)
    gate.decide(step("check_status", {"command": "x"}))
    gate.observe(ran(1, "false\n"))
    assert gate.masks.evidence == "none"
    assert gate.masks.posture_admissible == {"compliant": True, "non_compliant": True}


def test_rule3_unavailable_capability_is_blocked_and_others_are_not() -> None:
    gate = Gate(PROFILE)
    assert gate.decide(step("execute_opa", {"command": "opa eval x"})).needs_execution
    gate.observe(ran(127, command="opa eval x"))
    assert gate.masks.affordances["opa_eval"] == "unknown"  # cmbs-opa may be there
    assert gate.decide(step("execute_opa", {"command": "cmbs-opa eval x"})).needs_execution
    gate.observe(ran(127, command="cmbs-opa eval x"))
    assert gate.masks.affordances["opa_eval"] == "unavailable"
    blocked = gate.decide(step("execute_opa", {"command": "opa eval y"}))
    assert (blocked.verdict, blocked.message) == (Verdict.BLOCK, Messages.CAPABILITY_UNAVAILABLE)
    assert gate.decide(step("execute_kubectl", {"command": "kubectl get po"})).needs_execution


def test_rule3_a_failing_but_present_program_is_available() -> None:
    gate = Gate(PROFILE)
    gate.decide(step("execute_kubectl", {"command": "kubectl get polr"}))
    gate.observe(ran(1, command="kubectl get polr"))
    assert gate.masks.affordances["k8s_policy"] == "available"


def test_rule4_bad_ideas_are_allowed() -> None:
    gate = Gate(PROFILE)
    for _ in range(3):
        decision = gate.decide(step("generate_policy", {"path": "p.yaml", "content": "not: [yaml"}))
        assert decision.verdict is Verdict.ALLOW
        gate.observe(Observation(kind="artifact", path="p.yaml", success=False, error="x"))


@pytest.mark.parametrize(
    ("raw", "detail"),
    [
        ("{not json", "Invalid JSON"),
        (step("make_coffee"), "unknown action type"),
        (step("execute_kubectl", {}), "action.payload.command"),
        (step("declare_posture", {"posture": "maybe"}), "action.payload.posture"),
        (step("terminate", affordances={"gpu": "available"}), "unknown affordance"),
        (json.dumps({"belief": {}, "action": {"type": "terminate"}, "extra": 1}), "extra"),
        (b"\xff\xfe", "Invalid JSON"),
        ("[]", "should be an object"),
    ],
)
def test_invalid_format_is_answered_with_continue(raw: str, detail: str) -> None:
    decision = Gate(PROFILE).decide(raw)
    assert decision.verdict is Verdict.CONTINUE
    assert decision.message == Messages.INVALID_FORMAT
    assert decision.detail is not None and detail in decision.detail


@pytest.mark.parametrize(
    ("claim", "where"),
    [
        ({"evidence": "attempted"}, "belief.evidence"),
        ({"affordances": {"k8s_policy": "available"}}, "belief.affordances.k8s_policy"),
        ({"affordances": {"opa_eval": "unavailable"}}, "belief.affordances.opa_eval"),
    ],
)
def test_claims_beyond_observation_are_inconsistent(claim: dict[str, object], where: str) -> None:
    decision = Gate(PROFILE).decide(step("check_status", {"command": "true"}, **claim))  # type: ignore[arg-type]
    assert (decision.verdict, decision.message) == (Verdict.CONTINUE, Messages.INCONSISTENT)
    assert decision.detail == where


def test_contradicting_an_eliminated_posture_is_inconsistent() -> None:
    gate = Gate(PROFILE)
    earn_violation(gate)
    decision = gate.decide(step("check_status", {"command": "x"}, posture="compliant"))
    assert decision.detail == "belief.posture"


def test_unknown_and_understated_claims_are_consistent() -> None:
    gate = Gate(PROFILE)
    earn_violation(gate)
    decision = gate.decide(step("check_status", {"command": "x"}, evidence="attempted"))
    assert decision.verdict is Verdict.ALLOW


def test_observe_without_an_allowed_action_is_a_usage_error() -> None:
    gate = Gate(PROFILE)
    gate.decide(step("terminate"))
    with pytest.raises(RuntimeError):
        gate.observe(WROTE)


def test_response_carries_masks_and_last_observation() -> None:
    gate = Gate(PROFILE)
    decision = gate.decide(step("generate_script", {"path": "a.sh", "content": ""}))
    gate.observe(WROTE)
    response = gate.response(decision)
    assert response.masks.evidence == "attempted"
    assert response.last_observation == WROTE
    assert response.verdict is Verdict.ALLOW


def test_decision_fields_are_keyword_only() -> None:
    with pytest.raises(TypeError):
        Decision(1, Verdict.ALLOW, Messages.ALLOWED)  # type: ignore[call-arg]
    decision = Decision(step_number=1, verdict=Verdict.ALLOW, message=Messages.ALLOWED)
    assert (decision.payload, decision.needs_execution) == (None, False)


# --- the rules are public and replaceable; the bookkeeping is not ------------------------


class NoCommands(Rules):
    """A stricter rule set: nothing runs a command; claims are never checked; the run
    reports the last posture declared."""

    def inconsistency(self, masks: Masks, belief: Belief) -> str | None:
        return None

    def legality(self, masks: Masks, spec: ActionSpec, payload: Payload) -> tuple[Verdict, str]:
        if spec.kind is ActionKind.RUN_COMMAND:
            return Verdict.BLOCK, "No commands here."
        return super().legality(masks, spec, payload)

    def final_posture(self, masks: Masks, declared: Posture | None) -> Posture | None:
        return declared


def test_replaced_rules_change_the_verdicts() -> None:
    gate = Gate(PROFILE, rules=NoCommands())
    blocked = gate.decide(step("check_status", {"command": "true"}, evidence="successful"))
    assert (blocked.verdict, blocked.message, blocked.detail) == (
        Verdict.BLOCK,
        "No commands here.",
        None,  # an overstated belief went through: this rule set checks none
    )
    assert not blocked.needs_execution and not gate.awaiting_observation
    with pytest.raises(RuntimeError):  # nothing ran, so nothing can be observed
        gate.observe(ran(0, "true\n"))
    # the rules it did not override are the seed's: no posture without evidence
    declared = gate.decide(step("declare_posture", {"posture": "compliant"}))
    assert (declared.verdict, declared.message) == (
        Verdict.BLOCK,
        Messages.POSTURE_WITHOUT_EVIDENCE,
    )
    assert isinstance(declared.payload, PosturePayload)


def test_the_bookkeeping_stays_the_gates_whatever_the_rules() -> None:
    class AllowAll(NoCommands):
        def legality(self, masks: Masks, spec: ActionSpec, payload: Payload) -> tuple[Verdict, str]:
            return Verdict.ALLOW, Messages.ALLOWED

    gate = Gate(PROFILE, rules=AllowAll())
    assert gate.decide("{not json").message == Messages.INVALID_FORMAT  # never reaches rules
    allowed = gate.decide(step("declare_posture", {"posture": "non_compliant"}))
    assert allowed.verdict is Verdict.ALLOW and not allowed.needs_execution
    assert gate.declared_posture == "non_compliant" and gate.final_posture == "non_compliant"
    assert gate.masks.evidence == "none"  # allowing a claim earns nothing
    assert gate.decide(step("check_status", {"command": EVALUATE})).needs_execution
    gate.observe(ran(1, "false\n"))
    assert gate.masks.evidence == "none"  # a failure earns nothing either
    assert gate.decide(step("check_status", {"command": EVALUATE})).needs_execution
    gate.observe(ran(0, "false\n"))
    assert gate.masks.view().evidence == "successful"
    assert gate.masks.posture_admissible == {"compliant": False, "non_compliant": True}
    assert gate.step_count == 4


# --- invariants over arbitrary sequences -------------------------------------------------

ACTIONS = [*PROFILE.actions, "bogus"]
STATES = ["unknown", "available", "unavailable", "bogus"]

beliefs = st.fixed_dictionaries(
    {
        "affordances": st.dictionaries(
            st.sampled_from([*PROFILE.affordances, "gpu"]), st.sampled_from(STATES), max_size=3
        ),
        "posture": st.sampled_from(["unknown", "compliant", "non_compliant", "bad"]),
        "evidence": st.sampled_from(["none", "attempted", "successful", "lots"]),
    }
)
payloads: st.SearchStrategy[dict[str, str]] = st.one_of(
    st.fixed_dictionaries({"command": st.sampled_from(["true", "opa eval", ""])}),
    st.fixed_dictionaries({"path": st.sampled_from(["a", "../a"]), "content": st.text(max_size=5)}),
    st.fixed_dictionaries({"posture": st.sampled_from(["compliant", "non_compliant", "x"])}),
    st.just({}),
)
well_formed = st.builds(
    lambda b, a, p: json.dumps({"belief": b, "action": {"type": a, "payload": p}}),
    beliefs,
    st.sampled_from(ACTIONS),
    payloads,
)
messages = st.one_of(well_formed, st.text(max_size=30), st.binary(max_size=10))
outputs = st.sampled_from(["", "false\n", "true\n", "a b c 1 2 0 0 0 1m\n", "a b 0 0 0 0 0 1m\n"])
observations = st.builds(
    lambda code, out, kind: (
        ran(code, out)
        if kind == "command"
        else Observation(kind="artifact", path="a", success=code == 0)
    ),
    st.sampled_from([0, 1, 2, 127]),
    outputs,
    st.sampled_from(["command", "artifact"]),
)


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(messages, observations), max_size=25))
def test_gate_invariants_hold_for_any_sequence(sequence: list[tuple[object, Observation]]) -> None:
    gate = Gate(PROFILE)
    evidence = 0
    for raw, observation in sequence:
        before = gate.masks.view()
        decision = gate.decide(raw)  # type: ignore[arg-type]  # never raises
        spec = decision.spec
        if decision.verdict in (Verdict.ALLOW, Verdict.TERMINATE) and spec is not None:
            if spec.kind == "declare_posture":
                assert before.evidence == "successful"
            path = getattr(decision.payload, "path", None)
            required = spec.required(path)
            if required is not None:
                assert before.affordances[required] != "unavailable"
        if decision.verdict is Verdict.TERMINATE:
            assert before.evidence == "successful"
            assert sum(before.posture_admissible.values()) == 1
            assert gate.masks.posture_stable
        if spec is not None and spec.kind == "terminate" and not gate.masks.termination_allowed:
            assert decision.verdict is not Verdict.TERMINATE
        if decision.needs_execution:
            gate.observe(observation)
        assert EVIDENCE_ORDER[gate.masks.evidence] >= evidence
        evidence = EVIDENCE_ORDER[gate.masks.evidence]
        assert decision.message in vars(Messages).values()


class Arbitrary(Rules):
    """Rules that check no belief and return whatever verdict the test sets."""

    verdict = Verdict.ALLOW

    def inconsistency(self, masks: Masks, belief: Belief) -> str | None:
        return None

    def legality(self, masks: Masks, spec: ActionSpec, payload: Payload) -> tuple[Verdict, str]:
        return self.verdict, "whatever"


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(messages, observations, st.sampled_from(list(Verdict))), max_size=25))
def test_masks_move_only_on_observations_whatever_the_rules(
    sequence: list[tuple[object, Observation, Verdict]],
) -> None:
    rules = Arbitrary()
    gate = Gate(PROFILE, rules=rules)
    for raw, observation, verdict in sequence:
        rules.verdict = verdict
        before = gate.masks.view()
        decision = gate.decide(raw)  # type: ignore[arg-type]  # never raises
        after = gate.masks.view()
        assert (after.affordances, after.evidence, after.posture_admissible) == (
            before.affordances,
            before.evidence,
            before.posture_admissible,
        )
        assert gate.awaiting_observation is decision.needs_execution
        if decision.needs_execution:
            gate.observe(observation)
        else:
            with pytest.raises(RuntimeError):
                gate.observe(observation)
