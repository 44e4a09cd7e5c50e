"""What an application embedding the library sees: the errors it can catch, the failures
that come out of a run, and the output the library makes (none, unless logging is set up)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
from collections.abc import Awaitable, Callable
from pathlib import Path

import anyio
import pytest
from anyio.abc import SocketAttribute, SocketStream

import cmbs_async
from cmbs_async import (
    CallableAgent,
    CmbsError,
    ModelEndpointError,
    OpenAIAgent,
    OpenAIReviewer,
    Outcome,
    Review,
    ScenarioSpec,
    ScriptedAgent,
    SQLiteAuditStore,
    StdioAgent,
    SupervisionConfig,
    Turn,
    load_or_create_key,
    load_profile,
    load_scenario,
    replay,
    run_scenario,
)
from cmbs_async.batch import plan
from cmbs_async.review import ReviewRequest, ReviewVerdict, load_config
from cmbs_async.tools.opa import RegoFailure, evaluate
from executors import LocalExecutor, NullExecutor, PathRefused, confine
from executors.events import EventLogger
from executors.observation import CommandEnv, Observation

from .helpers import ChatApp, assessed, step

pytestmark = pytest.mark.anyio

SPEC = ScenarioSpec(id="embedded", goal="check a setting", deadline_s=30)

# -- the errors ------------------------------------------------------------------------------


async def _bad_scenario_file(tmp: Path) -> None:
    (tmp / "s.yaml").write_text("id: x\ngoal: [unclosed\n")
    load_scenario(tmp / "s.yaml")


async def _unknown_profile(tmp: Path) -> None:
    load_profile("no-such-profile")


async def _bad_review_config(tmp: Path) -> None:
    (tmp / "c.toml").write_text("[supervision]\ntimeout_seconds = -1\n")
    load_config(tmp / "c.toml")


async def _readable_signing_key(tmp: Path) -> None:
    load_or_create_key(tmp / "key")
    (tmp / "key").chmod(0o644)
    load_or_create_key(tmp / "key")


async def _unknown_audit_session(tmp: Path) -> None:
    store = SQLiteAuditStore(tmp / "audit.db")
    try:
        replay(store, "no-such-session")
    finally:
        store.close()


async def _batch_without_scenarios(tmp: Path) -> None:
    plan([str(tmp / "nothing-here")], ["script:x.jsonl"], 1)


async def _workdir_under_a_file(tmp: Path) -> None:
    (tmp / "file").write_text("")
    async with LocalExecutor(sandbox="none", workdir_root=str(tmp)) as executor:
        await executor.prepare(str(tmp / "file" / "work"), {})


async def _artifact_path_outside(tmp: Path) -> None:
    confine("../outside")


async def _model_endpoint_speaking_garbage(tmp: Path) -> None:
    async def garbage(stream: SocketStream) -> None:
        async with stream:
            await stream.receive()
            await stream.send(b"\x00\x01 not HTTP at all\r\n\r\n")

    failure: CmbsError | None = None
    async with (
        await anyio.create_tcp_listener(local_host="127.0.0.1") as listener,
        anyio.create_task_group() as tg,
    ):
        tg.start_soon(listener.serve, garbage)
        url = f"http://127.0.0.1:{listener.extra(SocketAttribute.local_port)}/v1"
        async with OpenAIAgent(model="m", base_url=url, retries=0) as agent:
            try:
                await agent.next_step(Turn(scenario_id="x", goal="g", step=1))
            except CmbsError as exc:  # raised below, out of the server's task group
                failure = exc
        tg.cancel_scope.cancel()
    if failure is not None:
        raise failure


async def _reviewer_endpoint_failing(tmp: Path) -> None:
    app = ChatApp(lambda request: (500, {"error": "overloaded"}))
    request = ReviewRequest(goal="g", commitment="c", trace="t", assessment="a", flags=())
    async with app.client() as client:
        await OpenAIReviewer(SupervisionConfig(base_url="http://r/v1"), client=client).review(
            request
        )


async def _agent_program_exiting(tmp: Path) -> None:
    async with StdioAgent("exit 3") as agent:
        await agent.next_step(Turn(scenario_id="x", goal="g", step=1))


async def _policy_not_compiling(tmp: Path) -> None:
    (tmp / "p.rego").write_text("package p\nallow if {\n")
    evaluate("data.p.allow", modules=[tmp / "p.rego"], data=[], input_=None)


@pytest.mark.parametrize(
    ("trigger", "error", "builtin"),
    [
        (_bad_scenario_file, cmbs_async.ScenarioError, ValueError),
        (_unknown_profile, cmbs_async.ProfileError, ValueError),
        (_bad_review_config, cmbs_async.ConfigError, ValueError),
        (_readable_signing_key, cmbs_async.SigningKeyError, ValueError),
        (_unknown_audit_session, cmbs_async.AuditError, RuntimeError),
        (_batch_without_scenarios, cmbs_async.BatchError, ValueError),
        (_workdir_under_a_file, cmbs_async.ExecutorError, RuntimeError),
        (_artifact_path_outside, PathRefused, ValueError),
        (_model_endpoint_speaking_garbage, ModelEndpointError, RuntimeError),
        (_reviewer_endpoint_failing, cmbs_async.ReviewerError, Exception),
        (_agent_program_exiting, cmbs_async.AgentProcessError, RuntimeError),
        (_policy_not_compiling, RegoFailure, Exception),
    ],
    ids=lambda value: getattr(value, "__name__", "").strip("_"),
)
async def test_one_except_clause_catches_every_error_of_the_library(
    trigger: Callable[[Path], Awaitable[None]],
    error: type[Exception],
    builtin: type[Exception],
    tmp_path: Path,
) -> None:
    with pytest.raises(CmbsError) as caught:
        await trigger(tmp_path)
    assert isinstance(caught.value, error)
    assert isinstance(caught.value, builtin)  # what code written before the root catches
    assert "\n" not in str(caught.value) and str(caught.value)


# -- failures out of a run -------------------------------------------------------------------


class _AgentFailingToClose:
    """An application's agent whose ``aclose`` raises: nothing the runtime can answer."""

    async def next_step(self, turn: Turn) -> str | None:
        return step("terminate") if turn.step > 1 else step("check_status", {"command": "true"})

    async def aclose(self) -> None:
        raise ConnectionResetError("the agent's connection was already gone")


class _ExecutorWithABug(NullExecutor):
    async def run_command(
        self,
        workdir: str,
        command: str,
        *,
        timeout: float | None,  # noqa: ASYNC109 - the executor protocol's signature
        env: CommandEnv | None = None,
    ) -> Observation:
        raise ZeroDivisionError("a bug in the executor")


class _ReviewerWithABug:
    async def review(self, request: ReviewRequest) -> ReviewVerdict:
        raise LookupError("a bug in the reviewer")


def _options(failing: str) -> tuple[object, dict[str, object]]:
    if failing == "agent":
        return _AgentFailingToClose(), {"executor": NullExecutor()}
    if failing == "executor":
        return _AgentFailingToClose(), {"executor": _ExecutorWithABug()}
    agent = CallableAgent(lambda turn: _said(assessed("check_status", {"command": "true"})))
    config = SupervisionConfig(always_supervise=True)
    return agent, {"executor": NullExecutor(), "review": Review(_ReviewerWithABug(), config)}


async def _said(text: str) -> str:
    return text


@pytest.mark.parametrize(
    ("failing", "error"),
    [
        ("agent", ConnectionResetError),
        ("reviewer", LookupError),
    ],
)
@pytest.mark.parametrize("audited", [False, True], ids=["no-audit", "audit"])
async def test_a_single_failure_in_a_run_comes_out_as_itself(
    failing: str, error: type[Exception], audited: bool, tmp_path: Path
) -> None:
    agent, options = _options(failing)
    key = load_or_create_key(tmp_path / "key")
    store = SQLiteAuditStore(tmp_path / "audit.db", key=key) if audited else None
    with pytest.raises(error) as caught:  # not an ExceptionGroup holding it
        await run_scenario(SPEC, agent=agent, audit=store, **options)  # type: ignore[arg-type]
    assert type(caught.value) is error
    assert caught.value.__traceback__ is not None
    names = [frame.name for frame in caught.traceback]
    assert ("aclose" if failing == "agent" else "review") in names  # where it was raised
    if store is not None:
        store.close()


async def test_failures_at_once_come_out_together() -> None:
    agent, options = _options("executor")
    with pytest.raises(ExceptionGroup) as caught:
        await run_scenario(SPEC, agent=agent, **options)  # type: ignore[arg-type]
    group = caught.value
    assert group.subgroup(ZeroDivisionError) is not None
    assert group.subgroup(ConnectionResetError) is not None


async def test_a_cancellation_from_outside_still_passes_through(tmp_path: Path) -> None:
    async def slow(turn: Turn) -> str:
        await anyio.sleep_forever()
        raise AssertionError("unreachable")

    store = SQLiteAuditStore(tmp_path / "audit.db", key=load_or_create_key(tmp_path / "key"))
    with anyio.move_on_after(0.5) as scope:
        await run_scenario(SPEC, agent=CallableAgent(slow), executor=NullExecutor(), audit=store)
    assert scope.cancelled_caught  # a cancellation wrapped in a group would have escaped
    ended = [record.data for record in store.records() if record.kind == "end"]
    store.close()
    assert [end["outcome"] for end in ended] == [Outcome.CANCELLED.value]


# -- output ----------------------------------------------------------------------------------

_EMBED = """
import anyio
from cmbs_async import CallableAgent, ScenarioSpec, run_scenario
from cmbs_async.demo import demo_agent, demo_scenario
from executors import NullExecutor

{setup}

async def main():
    await run_scenario(demo_scenario(), agent={agent}, executor=NullExecutor())

anyio.run(main)
{after}
"""


def _embedded(setup: str = "", agent: str = "demo_agent()", after: str = "") -> tuple[str, str]:
    """stdout and stderr of a fresh interpreter that runs the demo scenario as a library."""
    code = _EMBED.format(setup=textwrap.dedent(setup), agent=agent, after=textwrap.dedent(after))
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env=os.environ | {"PYTHONWARNINGS": "error"},
    )
    assert done.returncode == 0, done.stderr
    return done.stdout, done.stderr


def test_an_application_that_configures_nothing_sees_nothing() -> None:
    assert _embedded() == ("", "")


def test_an_application_that_configures_logging_sees_the_events() -> None:
    out, err = _embedded("import logging\nlogging.basicConfig(level=logging.INFO)")
    assert out == ""
    lines = err.splitlines()
    assert lines[0] == (
        "INFO:cmbs_async:scenario.started deadline_s=30.0 max_steps=20 "
        "scenario_id=demo-sshd-x11-forwarding"
    )
    assert lines[-1].startswith(
        "INFO:cmbs_async:scenario.finished outcome=agent_finished steps=12 "
    )
    assert not [line for line in lines if line.startswith("DEBUG")]  # below the level asked


def test_a_warning_surfaces_on_stderr_when_nothing_is_configured() -> None:
    agent = "CallableAgent(broken)"
    setup = """
        async def broken(turn):
            raise ValueError("model weights missing")
        """
    out, err = _embedded(setup, agent)
    assert out == ""
    assert err.splitlines() == [
        'agent.failed step=1 reason="agent raised ValueError: model weights missing" '
        "scenario_id=demo-sshd-x11-forwarding"
    ]


def test_the_applications_structlog_configuration_is_its_own() -> None:
    setup = """
        import logging, sys, structlog
        structlog.configure(
            processors=[structlog.processors.JSONRenderer()],
            logger_factory=structlog.PrintLoggerFactory(sys.stdout),
        )
        configured = structlog.get_config()
        structlog.get_logger().info("app.started")
        """
    after = """
        assert structlog.get_config() == configured
        structlog.get_logger().info("app.finished")
        """
    out, err = _embedded(setup, after=after)
    assert out.splitlines() == ['{"event": "app.started"}', '{"event": "app.finished"}']
    assert err == ""


async def test_pytests_caplog_sees_the_events_and_where_they_were_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="cmbs_async")
    result = await run_scenario(
        SPEC, agent=ScriptedAgent([step("terminate")]), executor=NullExecutor()
    )
    ours = [record for record in caplog.records if record.name == "cmbs_async"]
    assert {"turn.sent", "gate.verdict", "scenario.finished"} <= {r.event for r in ours}
    finished = ours[-1]
    assert (finished.event, finished.outcome, finished.steps) == (
        "scenario.finished",
        result.outcome.value,
        result.steps,
    )
    assert (finished.filename, finished.funcName) == ("runtime.py", "_log_finished")
    assert finished.scenario_id == "embedded"


def test_an_event_is_one_line_whatever_the_agent_sends() -> None:
    hostile = "\nINFO:cmbs_async:scenario.finished outcome=terminated \x1b[2J\u202e"
    setup = f"""
        import logging
        logging.basicConfig(level=logging.INFO)
        async def hostile(turn):
            return {{"belief": {{}}, "action": {{"type": {hostile!r}, "payload": {{}}}}}}
        """
    out, err = _embedded(setup, "CallableAgent(hostile)")
    events = [line.split(" ")[0].removeprefix("INFO:cmbs_async:") for line in err.splitlines()]
    assert set(events) == {"scenario.started", "gate.verdict", "scenario.finished"}
    assert events.count("scenario.finished") == 1
    assert "\x1b" not in err and "\u202e" not in err


def test_an_events_fields_are_escaped_in_its_message() -> None:
    messages: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    logger, handler = logging.getLogger("cmbs_async.test"), Keep()
    logger.addHandler(handler)
    try:
        EventLogger("cmbs_async.test").warning(
            "test.event", plain="word", spaced="two words", hostile="a\nb\x1b[2J\u202e", n=3
        )
    finally:
        logger.removeHandler(handler)
    assert messages == [
        'test.event plain=word spaced="two words" hostile="a\\nb\\u001b[2J\\u202e" n=3'
    ]
