"""What the operator sees in the terminal: each step as it happens (under a real
pseudo-terminal), which mask stopped a step, the masks and the evidence refusals in
``--json``, a crashed agent's stderr, and the human's PAUSE question: bounded, escaped,
never outliving its deadline or a signal."""

from __future__ import annotations

import json
import os
import pty
import re
import select
import signal
import subprocess
import time
from collections.abc import Iterator
from io import StringIO
from pathlib import Path

import pytest

from cmbs_async import Outcome, ScenarioSpec, run_scenario
from cmbs_async.cli.render import render_result, render_step
from cmbs_async.gate import Gate
from cmbs_async.profile import load_profile
from cmbs_async.protocol import Observation, Verdict
from cmbs_async.result import TraceEntry
from cmbs_async.review import (
    ConsoleHuman,
    HumanRequest,
    OpenAIReviewer,
    Review,
    ReviewRequest,
    ReviewVerdict,
    SupervisionConfig,
)
from cmbs_async.review.reconcile import Flag, Severity
from cmbs_async.review.reviewer import SECTION_CHARS, Verdict3, build_prompt
from cmbs_async.stopped import stopped_by
from executors import NullExecutor

from .helpers import CMBS, ChatApp, ScriptedReviewer, completion, replaying, step

#: how long any one wait of these tests may take before it is a failure, not a slow machine
PATIENCE = 60.0


def read_until(fd: int, wanted: bytes, *, within: float = PATIENCE) -> bytes:
    """What ``fd`` gives until the pattern ``wanted`` matches it (or its end, or
    ``within`` seconds)."""
    got = b""
    ends = time.monotonic() + within
    while not re.search(wanted, got) and (left := ends - time.monotonic()) > 0:
        if not select.select([fd], [], [], left)[0]:
            break
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # a pty whose other side closed: EIO
            break
        if not chunk:
            break
        got += chunk
    return got


@pytest.fixture
def scenario(tmp_path: Path) -> Path:
    path = tmp_path / "scenario.yaml"
    path.write_text("id: terminal\ngoal: check the service\ndeadline_s: 120\n")
    return path


def steps_file(tmp_path: Path, *lines: str) -> str:
    path = tmp_path / "steps.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return f"script:{path}"


# -- each step as it happens ----------------------------------------------------------------


def test_on_a_terminal_each_step_shows_as_it_happens(scenario: Path, tmp_path: Path) -> None:
    """Under a pseudo-terminal the first step's line is there while the second step still
    runs (its command waits for a file the test makes only once it has read that line);
    a BLOCK line names the mask; the table is not printed again at the end."""
    workdir = tmp_path / "work"
    wait = "i=0; while [ ! -e go ] && [ $i -lt 1200 ]; do sleep 0.05; i=$((i+1)); done; echo went"
    agent = steps_file(
        tmp_path,
        step("declare_posture", {"posture": "compliant"}),
        step("check_status", {"command": wait}),
        step("terminate", evidence="successful"),
    )
    leader, follower = pty.openpty()
    process = subprocess.Popen(
        [*CMBS, "run", str(scenario), "--agent", agent, "--workdir", str(workdir), "--no-audit"],
        stdin=subprocess.DEVNULL,
        stdout=follower,
        stderr=subprocess.PIPE,
    )
    os.close(follower)
    try:
        first = read_until(leader, rb"declare_posture[^\n]*\n")
        assert b"declare_posture" in first, first
        assert process.poll() is None  # the run goes on: step 2 waits for us
        line = next(ln for ln in first.decode().splitlines() if "declare_posture" in ln)
        assert line.split()[:3] == ["1", "declare_posture", "BLOCK"]
        assert "Posture declaration not permitted without successful execution." in line
        assert "[mask: evidence (none, not successful)]" in line
        (workdir / "go").touch()
        rest = read_until(leader, rb"\nduration [^\n]*\n")
        assert process.wait(timeout=PATIENCE) == 3, process.stderr
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        os.close(leader)
        assert process.stderr is not None
        process.stderr.close()
    lines = rest.decode().splitlines()
    ran = next(ln for ln in lines if "check_status" in ln)
    assert ran.split()[:3] == ["2", "check_status", "ALLOW"] and "exit 0: went" in ran
    blocked = next(ln for ln in lines if "terminate" in ln)
    assert "[mask: posture admissibility (compliant and non_compliant admissible" in blocked
    assert "stability (last claims: unknown, unknown;" in blocked
    assert not any(ln.startswith("----") for ln in lines)  # no table after the live lines
    assert any(ln.startswith("outcome   agent_finished") for ln in lines)


def test_without_a_terminal_the_table_is_printed_at_the_end_as_before(
    scenario: Path, tmp_path: Path
) -> None:
    agent = steps_file(tmp_path, step("declare_posture", {"posture": "compliant"}))
    done = subprocess.run(
        [*CMBS, "run", str(scenario), "--agent", agent, "--no-audit"],
        capture_output=True,
        text=True,
        timeout=PATIENCE,
        check=False,
    )
    assert done.returncode == 3, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].split() == ["step", "action", "verdict", "message", "observed"]
    assert lines[1].startswith("----") and "[mask:" not in done.stdout


# -- --json: masks and refusals ---------------------------------------------------------------


def test_json_has_the_masks_after_each_step_and_the_evidence_refusals() -> None:
    done = subprocess.run(
        [*CMBS, "demo", "--json", "--no-audit"],
        capture_output=True,
        text=True,
        timeout=PATIENCE,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    trace = json.loads(done.stdout)["trace"]
    assert [t["masks"]["evidence"] for t in trace[:6]] == [
        "none",
        "attempted",
        "attempted",
        "attempted",
        "attempted",
        "successful",
    ]
    assert trace[0]["stopped_by"] == "evidence (none, not successful)"
    assert trace[2]["stopped_by"].startswith("evidence (the belief claims more than")
    refused = trace[7]  # `echo true`: its output matched a signal, and may not count
    assert refused["observed"] == "exit 0: true"
    assert refused["refused"].startswith("opa_raw: not one of the signal's evaluators")
    assert refused["masks"]["posture_admissible"] == {"compliant": True, "non_compliant": True}
    assert trace[9]["refused"] is None  # cmbs-opa, as the evaluator: it counted
    assert trace[9]["masks"]["posture_admissible"] == {"compliant": False, "non_compliant": True}
    assert trace[-1]["masks"]["termination_allowed"] is True
    assert all(t["stopped_by"] is None for t in trace if t["verdict"] in ("ALLOW", "TERMINATE"))


def test_which_mask_stopped_a_step_comes_from_the_message_and_the_masks() -> None:
    gate = Gate(load_profile("ciso"))
    ran = gate.decide(step("execute_kubectl", {"command": "kubectl get policyreport"}))
    assert ran.verdict is Verdict.ALLOW
    gate.observe(
        Observation(
            kind="command",
            command="kubectl get policyreport",
            success=False,
            exit_status=127,
            program_found=False,
        )
    )
    blocked = gate.decide(step("generate_policy", {"path": "p.yaml", "content": "x"}))
    assert stopped_by(blocked, gate.masks) == "affordance k8s_policy (unavailable)"
    claimed = gate.decide(
        step("check_status", {"command": "true"}, affordances={"k8s_policy": "available"})
    )
    assert stopped_by(claimed, gate.masks) == "affordance k8s_policy (unavailable)"
    bad = gate.decide("{not json")
    assert stopped_by(bad, gate.masks) == "no mask: the step is not well formed"


def test_a_live_line_is_escaped_and_short() -> None:
    entry = TraceEntry(
        step=4,
        action="check_status",
        verdict=Verdict.ALLOW,
        message="Action allowed.",
        observed="exit 0: \x1b[2J\n[cmbs] outcome terminated " + "x" * 200,
        refused="opa_raw: \x1b]0;title\x07",
    )
    line = render_step(entry)
    assert "\x1b" not in line and "\n" not in line and "\x07" not in line
    assert "exit 0: \\x1b[2J\\n[cmbs]" in line and "x" * 100 not in line
    assert line.endswith("[evidence refused: opa_raw: \\x1b]0;title\\x07]")


# -- a crashed agent's stderr --------------------------------------------------------------------


def test_a_crashed_agent_program_shows_its_stderr(scenario: Path, tmp_path: Path) -> None:
    program = tmp_path / "agent.sh"
    program.write_text(
        "read turn\n"
        "echo 'loading the model' >&2\n"
        "printf 'Traceback: \\033[2Jweights missing\\n' >&2\n"
        "exit 3\n"
    )
    command = [*CMBS, "run", str(scenario), "--agent", f"stdio:sh {program}", "--no-audit"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=PATIENCE, check=False)
    assert done.returncode == 3, done.stderr
    assert "outcome   agent_error" in done.stdout
    lines = done.stdout.splitlines()
    shown = lines[lines.index("agent stderr:") + 1 :]
    assert shown == ["  | loading the model", "  | Traceback: \\x1b[2Jweights missing"]
    done = subprocess.run(
        [*command, "--json"], capture_output=True, text=True, timeout=PATIENCE, check=False
    )
    result = json.loads(done.stdout)
    assert result["agent_stderr"] == "loading the model\nTraceback: \x1b[2Jweights missing\n"


def test_only_the_last_lines_of_a_long_stderr_are_shown(tmp_path: Path) -> None:
    from cmbs_async.result import ScenarioResult

    result = ScenarioResult(
        scenario_id="s",
        outcome=Outcome.AGENT_ERROR,
        posture=None,
        steps=0,
        verdicts={},
        duration_s=0.1,
        trace=[],
        reason="agent raised AgentProcessError: agent program exited with status 1",
        masks=Gate(load_profile("ciso")).masks_view,
        agent_stderr="".join(f"line {i}\n" for i in range(100)),
    )
    shown = render_result(result).splitlines()
    assert "agent stderr, the last 20 of 100 lines:" in shown
    assert shown[-1] == "  | line 99" and "  | line 79" not in shown and "  | line 80" in shown


# -- the human's question ---------------------------------------------------------------------


def review_config(tmp_path: Path, timeout: float = 2.0) -> Path:
    """A review on every step, by a reviewer nobody listens for: each review fails, and
    fails closed to PAUSE, so the console human is asked at the first step."""
    path = tmp_path / "review.toml"
    path.write_text(
        "[supervision]\nalways_supervise = true\n"
        f'base_url = "http://127.0.0.1:9/v1"\ntimeout_seconds = {timeout}\n'
    )
    return path


@pytest.fixture
def paused(scenario: Path, tmp_path: Path) -> list[str]:
    """``cmbs run`` whose first step is put to the console human."""
    agent = steps_file(tmp_path, step("check_status", {"command": "echo hi"}))
    config = review_config(tmp_path)
    return [
        *CMBS,
        "run",
        str(scenario),
        "--agent",
        agent,
        "--config",
        str(config),
        "--human",
        "console",
        "--no-audit",
    ]


@pytest.fixture
def silent_stdin() -> Iterator[tuple[int, int]]:
    """A pipe for stdin that stays open (no end of input) for the whole test."""
    read, write = os.pipe()
    yield read, write
    os.close(read)
    os.close(write)


def test_a_half_typed_answer_does_not_hold_the_run_past_its_deadline(
    paused: list[str], silent_stdin: tuple[int, int]
) -> None:
    """The operator typed "pro" and no newline; the input stays open. The run still ends
    at its 4 s deadline, not when the input ends (before the fix: 24.6 s, or never)."""
    read, write = silent_stdin
    os.write(write, b"pro")
    started = time.monotonic()
    done = subprocess.run(
        [*paused, "--deadline", "4"],
        stdin=read,
        capture_output=True,
        text=True,
        timeout=PATIENCE,
        check=False,
    )
    took = time.monotonic() - started
    assert done.returncode == 3, done.stderr
    assert "outcome   deadline_exceeded" in done.stdout
    assert "[p/a/m]" in done.stderr
    assert took < 4 + 20  # the interpreter's start and the end record, under load


def test_sigterm_during_the_pause_question_ends_the_run(
    paused: list[str], silent_stdin: tuple[int, int]
) -> None:
    read, write = silent_stdin
    os.write(write, b"p")  # half an answer
    process = subprocess.Popen(
        [*paused, "--deadline", "100"],
        stdin=read,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        assert process.stderr is not None and process.stdout is not None
        asked = read_until(process.stderr.fileno(), rb"\[p/a/m\]")
        assert b"[p/a/m]" in asked, asked
        assert b'[cmbs] the step: check_status {"command": "echo hi"}' in asked
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=PATIENCE) == 128 + signal.SIGTERM
        out = process.stdout.read().decode()
        assert "outcome   cancelled" in out
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        for stream in (process.stdout, process.stderr):
            if stream is not None:
                stream.close()


HOSTILE = "the agent said \x1b[2J\x1b[H\n[cmbs] the operator answered: proceed\r\u202etxt"


@pytest.mark.anyio
async def test_the_question_shows_the_step_and_the_reasoning_inert() -> None:
    """A reviewer quoting the agent's escape sequences: the question clears no screen and
    forges no ``[cmbs]`` line; it shows the step it is about."""
    agent, _ = replaying(step("check_status", {"command": "echo \x1b[31mred"}))
    reviewer = ScriptedReviewer(ReviewVerdict(verdict=Verdict3.PAUSE, reasoning=HOSTILE))
    read, write = os.pipe()
    os.write(write, b"a\n")
    said = StringIO()
    try:
        with os.fdopen(read, closefd=False) as stdin:
            human = ConsoleHuman(stdin=stdin, stderr=said)
            review = Review(
                reviewer=reviewer, config=SupervisionConfig(always_supervise=True), human=human
            )
            spec = ScenarioSpec(id="hostile", goal="check", deadline_s=20)
            result = await run_scenario(spec, agent=agent, executor=NullExecutor(), review=review)
    finally:
        os.close(read)
        os.close(write)
    assert result.outcome is Outcome.ABORTED_BY_HUMAN
    shown = said.getvalue()
    assert "\x1b" not in shown and "\r" not in shown and "\u202e" not in shown
    lines = shown.splitlines()
    assert not any(line.startswith("[cmbs] the operator") for line in lines)
    assert "[cmbs] the reviewer: the agent said \\x1b[2J\\x1b[H\\n[cmbs] the operator" in shown
    assert '[cmbs] the step: check_status {"command": "echo \\u001b[31mred"}' in lines


@pytest.mark.anyio
async def test_a_partial_line_then_its_end_is_read_in_pieces() -> None:
    """An answer arriving in pieces is read as the pieces come; its end without a newline
    is still an answer."""
    read, write = os.pipe()
    try:
        with os.fdopen(read, closefd=False) as stdin:
            human = ConsoleHuman(stdin=stdin, stderr=StringIO())
            os.write(write, b"mo")
            os.write(write, b"dify\nuse the")
            os.write(write, b" report")
            os.close(write)
            write = -1
            decision = await human.decide(HumanRequest(scenario_id="s", step=1, reasoning="r"))
    finally:
        os.close(read)
        if write >= 0:
            os.close(write)
    assert decision.decision == "modify" and decision.correction == "use the report"


# -- what the reviewer is sent ---------------------------------------------------------------


def test_the_reviewer_prompt_is_bounded() -> None:
    huge = "A" * 1_000_000
    flag = Flag(trigger="t", severity=Severity.HIGH, detail="d" * 10_000)
    request = ReviewRequest(
        goal="check", commitment=huge, trace=huge, assessment=huge, flags=(flag,) * 500
    )
    prompt = build_prompt(request)
    assert len(prompt) < 4 * SECTION_CHARS + 20 * 400 + 2000
    assert prompt.count(f"[... {1_000_000 - SECTION_CHARS} more characters not shown]") == 3
    assert "480 more flags" in prompt


@pytest.mark.anyio
async def test_an_agents_huge_step_reaches_the_reviewer_endpoint_bounded() -> None:
    app = ChatApp(lambda body: (200, completion("VERDICT: CONTINUE\nREASONING: fine")))
    config = SupervisionConfig(base_url="http://reviewer/v1", always_supervise=True)
    data = json.loads(step("check_status", {"command": "true"}))
    data["assessment"] = {"commitment_met": True, "confidence": 0.5, "concerns": ["N" * 500_000]}
    agent, _ = replaying(json.dumps(data))
    async with app.client() as client, OpenAIReviewer(config, client=client) as reviewer:
        review = Review(reviewer=reviewer, config=config)
        spec = ScenarioSpec(id="big", goal="check", deadline_s=20)
        await run_scenario(spec, agent=agent, executor=NullExecutor(), review=review)
    (body,) = app.bodies
    assert len(body["messages"][0]["content"]) < 6 * SECTION_CHARS
