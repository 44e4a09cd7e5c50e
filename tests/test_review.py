"""The review layer: reconcile triggers, strict verdict parsing, and what CONTINUE,
REORIENT and PAUSE do to a run (with an in-process reviewer and human)."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from cmbs_async import Outcome, ScenarioSpec, Verdict, run_scenario
from cmbs_async.protocol import Assessment, Commitment
from cmbs_async.review import (
    CallbackHuman,
    ConfigError,
    HumanDecision,
    HumanRequest,
    OpenAIReviewer,
    Review,
    ReviewerError,
    ReviewRequest,
    ReviewVerdict,
    SupervisionConfig,
    Verdict3,
    load_config,
    parse_verdict,
    reconcile,
)
from executors import NullExecutor

from .helpers import ChatApp, ScriptedReviewer, assessed, completion, replaying, step

pytestmark = pytest.mark.anyio


# -- reconcile -----------------------------------------------------------------------------


def test_reconcile_triggers_and_thresholds() -> None:
    quiet = Assessment(commitment_met=True, confidence=0.7)
    assert reconcile(quiet, Commitment(interpretation="x", assumptions=("a", "b", "c"))) == ()
    loud = Assessment(
        commitment_met=False, scope_changed=True, confidence=0.69, concerns=("paginated",)
    )
    flags = reconcile(loud, Commitment(interpretation="x", assumptions=("a", "b", "c", "d")))
    assert [(f.trigger, f.severity.value) for f in flags] == [
        ("concerns_raised", "medium"),
        ("commitment_not_met", "high"),
        ("scope_deviation", "high"),
        ("low_confidence", "medium"),
        ("excess_assumptions", "low"),
    ]
    assert reconcile(None, None) == ()


# -- parsing -------------------------------------------------------------------------------


def test_parse_verdict_is_strict() -> None:
    ok = parse_verdict(
        "VERDICT: REORIENT\nREASONING: Agent called an\nexternal service.\n"
        "CORRECTION: Use only the API."
    )
    assert ok == ReviewVerdict(
        verdict=Verdict3.REORIENT,
        reasoning="Agent called an external service.",
        correction="Use only the API.",
    )
    assert parse_verdict("- **VERDICT:** continue\n- REASONING: fine").verdict is Verdict3.CONTINUE
    for bad, why in [
        ("I think it is fine", "no VERDICT"),
        ("VERDICT: MAYBE\nREASONING: x", "not CONTINUE"),
        ("VERDICT: PAUSE", "no REASONING"),
        ("VERDICT: REORIENT\nREASONING: x", "without a CORRECTION"),
        ("VERDICT: PAUSE\nVERDICT: CONTINUE\nREASONING: x", "more than one"),
    ]:
        with pytest.raises(ReviewerError, match=why):
            parse_verdict(bad)


# -- the layer in a run ----------------------------------------------------------------------


CONTINUE = ReviewVerdict(verdict=Verdict3.CONTINUE, reasoning="fine")
REORIENT = ReviewVerdict(
    verdict=Verdict3.REORIENT, reasoning="out of scope", correction="Stay in the workdir."
)
PAUSE = ReviewVerdict(verdict=Verdict3.PAUSE, reasoning="needs a human")
SPEC = ScenarioSpec(id="reviewed", goal="check", deadline_s=20)


async def test_unflagged_steps_never_reach_the_reviewer() -> None:
    reviewer = ScriptedReviewer(PAUSE)
    agent, _ = replaying(
        step("check_status", {"command": "true"}), assessed("check_status", {"command": "true"})
    )
    result = await run_scenario(
        SPEC, agent=agent, executor=NullExecutor(), review=Review(reviewer=reviewer)
    )
    assert result.outcome is Outcome.AGENT_FINISHED
    assert reviewer.requests == []


async def test_continue_lets_the_gate_decide_as_usual() -> None:
    reviewer = ScriptedReviewer(CONTINUE)
    agent, _ = replaying(
        step("check_status", {"command": "true"}),
        assessed("declare_posture", {"posture": "compliant"}, confidence=0.2),
    )
    result = await run_scenario(
        SPEC, agent=agent, executor=NullExecutor(), review=Review(reviewer=reviewer)
    )
    assert len(reviewer.requests) == 1
    request = reviewer.requests[0]
    assert request.goal == "check" and "step 1: check_status true" in request.trace
    assert [f.trigger for f in request.flags] == ["low_confidence"]
    # the review let it through, and the gate allows it: the check before earned the evidence
    assert result.trace[1].verdict is Verdict.ALLOW


async def test_the_review_never_allows_more_than_the_gate() -> None:
    reviewer = ScriptedReviewer(CONTINUE)
    agent, _ = replaying(
        step("generate_script", {"path": "a", "content": "x"}),
        assessed("terminate", confidence=0.1),
    )
    result = await run_scenario(
        SPEC,
        agent=agent,
        executor=NullExecutor(),
        review=Review(reviewer=reviewer, config=SupervisionConfig(always_supervise=True)),
    )
    assert result.trace[1].verdict is Verdict.BLOCK
    assert result.outcome is Outcome.AGENT_FINISHED


async def test_reorient_sends_the_correction_and_counts_attempts() -> None:
    reviewer = ScriptedReviewer(REORIENT)
    flagged = assessed("check_status", {"command": "true"}, scope_changed=True)
    agent, seen = replaying(step("check_status", {"command": "true"}), *[flagged] * 5)
    result = await run_scenario(
        SPEC,
        agent=agent,
        executor=NullExecutor(),
        review=Review(reviewer=reviewer, config=SupervisionConfig(max_reorient_attempts=2)),
    )
    corrected = seen[2].response
    assert corrected is not None and corrected.correction == "Stay in the workdir."
    assert corrected.verdict is Verdict.CONTINUE
    assert "Re-attempt" in corrected.message
    assert [t.observed for t in result.trace[1:3]] == [None, None]  # nothing executed
    assert result.outcome is Outcome.PAUSED_NO_HUMAN  # the third REORIENT became PAUSE
    assert "reorient attempts exhausted" in (result.reason or "")
    assert result.steps == 3  # the paused step never reached the gate


@pytest.mark.parametrize(
    ("answer", "outcome", "executed"),
    [
        (HumanDecision(decision="proceed"), Outcome.AGENT_FINISHED, True),
        (HumanDecision(decision="abort"), Outcome.ABORTED_BY_HUMAN, False),
        (HumanDecision(decision="modify", correction="Only read."), Outcome.AGENT_FINISHED, False),
    ],
)
async def test_pause_asks_the_human(
    answer: HumanDecision, outcome: Outcome, executed: bool
) -> None:
    asked: list[HumanRequest] = []

    async def human(request: HumanRequest) -> HumanDecision:
        asked.append(request)
        return answer

    agent, seen = replaying(
        step("check_status", {"command": "true"}),
        assessed("check_status", {"command": "true"}, commitment_met=False),
    )
    result = await run_scenario(
        SPEC,
        agent=agent,
        executor=NullExecutor(),
        review=Review(reviewer=ScriptedReviewer(PAUSE), human=CallbackHuman(human)),
    )
    assert result.outcome is outcome
    assert asked[0].reasoning == "needs a human" and asked[0].step == 2
    if outcome is not Outcome.ABORTED_BY_HUMAN:
        assert (result.trace[1].observed is not None) is executed
    if answer.decision == "modify":
        assert seen[2].response is not None and seen[2].response.correction == "Only read."


async def test_a_human_who_never_answers_meets_the_deadline() -> None:
    async def silent(request: HumanRequest) -> HumanDecision:
        await anyio.sleep_forever()
        raise AssertionError

    agent, _ = replaying(
        step("check_status", {"command": "true"}),
        assessed("check_status", {"command": "true"}, commitment_met=False),
    )
    with anyio.fail_after(5):
        result = await run_scenario(
            SPEC.model_copy(update={"deadline_s": 0.5}),
            agent=agent,
            executor=NullExecutor(),
            review=Review(reviewer=ScriptedReviewer(PAUSE), human=CallbackHuman(silent)),
        )
    assert result.outcome is Outcome.DEADLINE_EXCEEDED


async def test_a_slow_reviewer_fails_closed() -> None:
    agent, _ = replaying(
        step("check_status", {"command": "true"}),
        assessed("check_status", {"command": "true"}, concerns=["odd"]),
    )
    result = await run_scenario(
        SPEC,
        agent=agent,
        executor=NullExecutor(),
        review=Review(
            reviewer=ScriptedReviewer(CONTINUE, delay=5),
            config=SupervisionConfig(timeout_seconds=0.2),
        ),
    )
    assert result.outcome is Outcome.PAUSED_NO_HUMAN
    assert result.reason == "fail-closed: no verdict within 0.2 s"


# -- the stock reviewer over HTTP (in-process ASGI app for exact edge cases) ----------------


REQUEST = ReviewRequest(goal="g", commitment="c", trace="t", assessment="a", flags=())


async def test_openai_reviewer_sends_the_seed_prompt_and_parses() -> None:
    app = ChatApp(lambda body: (200, completion("VERDICT: CONTINUE\nREASONING: on track")))
    config = SupervisionConfig(base_url="http://reviewer/v1", model="m")
    async with app.client() as client:
        verdict = await OpenAIReviewer(config, client=client).review(REQUEST)
    assert verdict.verdict is Verdict3.CONTINUE
    sent = app.bodies[0]
    prompt = sent["messages"][0]["content"]
    for section in (
        "ORIGINAL GOAL:",
        "AGENT COMMITMENT:",
        "EXECUTION TRACE:",
        "AGENT SELF-ASSESSMENT:",
        "RECONCILE FLAGS:",
        "VERDICT: CONTINUE | REORIENT",
    ):
        assert section in prompt
    assert sent["model"] == "m" and sent["temperature"] == 0


@pytest.mark.parametrize(
    ("status", "body", "why"),
    [
        (500, {"error": "boom"}, "HTTP 500"),
        (200, b"not json", "not a chat completion"),
        (200, completion("Sure! Looks good to me."), "no VERDICT"),
    ],
)
async def test_openai_reviewer_failures_are_reviewer_errors(
    status: int, body: object, why: str
) -> None:
    app = ChatApp(lambda request: (status, body))
    config = SupervisionConfig(base_url="http://reviewer/v1")
    async with app.client() as client:
        with pytest.raises(ReviewerError, match=why):
            await OpenAIReviewer(config, client=client).review(REQUEST)


# -- configuration ---------------------------------------------------------------------------


def test_supervision_config_from_toml(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[supervision]\nmodel = "smol"\nmax_reorient_attempts = 1\n')
    config = load_config(path)
    assert (config.model, config.max_reorient_attempts, config.timeout_seconds) == ("smol", 1, 30)
    assert config.always_supervise is False and config.fail_closed_verdict == "PAUSE"
    path.write_text("[supervision]\ntimeout_seconds = -1\n")
    with pytest.raises(ConfigError, match="supervision.timeout_seconds"):
        load_config(path)
    path.write_text("[supervison]\n")
    with pytest.raises(ConfigError, match="unknown table"):
        load_config(path)
