"""``run_scenario``: agent, supervisor and executor as three actors under one deadline.

The actors are anyio tasks in one task group, joined only by memory object streams::

    agent --steps--> supervisor --requests--> executor
    agent <--turns-- supervisor <--observations-- executor
                         |
                         +--records--> audit sink (optional)

The task group sits in one cancel scope whose deadline is the scenario's budget. When
it fires every actor is cancelled; executors kill what they started in shielded cleanup,
and the run's end is recorded after the scope, shielded and bounded.
"""

from __future__ import annotations

import base64
import json
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from structlog.contextvars import bind_contextvars, bound_contextvars

from executors import Executor, ExecutorError, LocalExecutor

from ._errors import single_failure
from ._streams import receive, send
from .agents.base import Agent, AgentMessage
from .audit.sqlite import AuditError
from .audit.store import AuditStore
from .audit.writer import AuditWriter, open_audit_writer
from .events import Events, logger
from .gate import Decision, Gate, Rules
from .profile import Profile, load_profile
from .protocol import (
    AgentStep,
    ArtifactPayload,
    CommandPayload,
    Observation,
    Response,
    Turn,
    Verdict,
)
from .result import Outcome, ScenarioResult, TraceEntry
from .review.layer import REORIENTED, Review, ReviewAction, ReviewLayer
from .scenario import ScenarioSpec

__all__ = ["run_scenario"]

_BUFFER = 1
_CLEANUP_TIMEOUT = 5.0
_END_GRACE = 1.0  # how long past the deadline (or a cancellation) the end record may take


@dataclass(frozen=True, slots=True)
class _Said:
    message: AgentMessage


@dataclass(frozen=True, slots=True)
class _Failed:
    reason: str


@dataclass
class _Run:
    """The supervisor's record of the run; read by ``run_scenario`` once the actors end."""

    spec: ScenarioSpec
    gate: Gate
    max_steps: int
    review: ReviewLayer | None
    audit: AuditWriter | None
    log: Any  # the events logger, bound once per run: a proxy lookup per event adds up
    trace: list[TraceEntry] = field(default_factory=list)
    outcome: Outcome | None = None
    reason: str | None = None
    containment: str | None = None  # what contained the commands, once the workdir exists

    def __post_init__(self) -> None:
        self._goal = self.spec.rendered_goal()
        self._actions = tuple(self.gate.profile.actions)

    def finish(self, outcome: Outcome, reason: str | None = None) -> None:
        if self.outcome is None:
            self.outcome, self.reason = outcome, reason

    def turn(self, response: Response | None) -> Turn:
        return Turn(
            scenario_id=self.spec.id,
            goal=self._goal,
            vars=self.spec.vars,
            actions=self._actions,
            step=self.gate.step_count + 1,
            response=response,
        )


@single_failure
async def run_scenario(
    spec: ScenarioSpec,
    *,
    agent: Agent,
    executor: Executor | None = None,
    profile: Profile | None = None,
    deadline: float | None = None,
    max_steps: int | None = None,
    keep_workdir: bool = False,
    review: Review | None = None,
    audit: AuditStore | None = None,
    session_id: str | None = None,
    rules: Rules | None = None,
) -> ScenarioResult:
    """Run one scenario to its end and report how it ended.

    ``executor`` defaults to a :class:`executors.LocalExecutor`; ``deadline`` (seconds)
    and ``max_steps`` override the spec's. A temporary workdir (the spec names none) is
    removed afterwards unless ``keep_workdir``. ``review`` turns the review layer on;
    ``audit`` records every step, review, decision and observation, each durable before
    it takes effect, under ``session_id`` (a new one by default). ``rules`` replaces the
    gate's rules (:class:`cmbs_async.gate.Rules`), for baselines and experiments.

    No audit wait outlasts the deadline: a record not durable by then ends the run
    ``audit_error``, and the end record gets at most a second more. Cancelled from outside
    (a signal, the caller's scope), the run still kills what runs and records its end
    (``cancelled``), then lets the cancellation through. ``duration_s`` is the call's wall
    time. A failure it does not expect (a bug in an executor, an agent whose ``aclose``
    raises) comes out as itself, not in an ``ExceptionGroup``.
    """
    started = anyio.current_time()
    if executor is None:
        executor = LocalExecutor()
    if not isinstance(executor, Executor):
        raise TypeError(f"{type(executor).__name__} does not implement the executor protocol")
    profile = profile or load_profile(spec.profile)
    session_id = session_id or uuid.uuid4().hex
    budget = deadline if deadline is not None else spec.deadline_s
    ends_at = started + budget
    workdir: str | None = None

    with bound_contextvars(scenario_id=spec.id):
        logger.info(
            Events.SCENARIO_STARTED, deadline_s=budget, max_steps=max_steps or spec.max_steps
        )
        async with _auditing(audit, session_id, spec, profile, review) as writer:
            run = _Run(
                spec=spec,
                gate=Gate(profile, rules=rules),
                max_steps=max_steps or spec.max_steps,
                review=ReviewLayer(review, goal=spec.rendered_goal(), scenario_id=spec.id)
                if review
                else None,
                audit=writer,
                log=logger.bind(),
            )
            stopped: BaseException | None = None
            try:
                with anyio.CancelScope(deadline=ends_at) as scope:
                    try:
                        workdir = await executor.prepare(spec.workdir, spec.rendered_files())
                    except ExecutorError as exc:
                        run.finish(Outcome.EXECUTOR_ERROR, str(exc))
                    else:
                        await _actors(run, agent, executor, workdir)
            except anyio.get_cancelled_exc_class() as exc:
                stopped = exc  # by a signal or the caller: end the run, then pass it on
                run.finish(Outcome.CANCELLED, "cancelled from outside the run")
            if scope.cancelled_caught:
                if writer is not None and writer.stalled:
                    run.finish(
                        Outcome.AUDIT_ERROR,
                        f"an audit record was not durable within the deadline of {budget:g} s",
                    )
                run.finish(Outcome.DEADLINE_EXCEEDED, f"deadline of {budget:g} s exceeded")
            run.finish(Outcome.AGENT_FINISHED)
            with anyio.CancelScope(shield=stopped is not None):
                if workdir is not None:
                    remove = spec.workdir is None and not keep_workdir
                    with anyio.move_on_after(_CLEANUP_TIMEOUT, shield=True):
                        await executor.cleanup(workdir, remove=remove)
                    workdir = None if remove else workdir
                result = _result(run, anyio.current_time() - started, workdir, session_id)
                if writer is not None:
                    grace = anyio.current_time() + _END_GRACE
                    until = grace if stopped is not None else max(grace, ends_at)
                    await _record_end(writer, result, until=until)
            if stopped is not None:
                raise stopped
        result = result.model_copy(update={"duration_s": anyio.current_time() - started})
        logger.info(
            Events.SCENARIO_FINISHED,
            outcome=result.outcome.value,
            steps=result.steps,
            posture=result.posture,
            duration_s=round(result.duration_s, 4),
            reason=result.reason,
        )
    return result


async def _record_end(writer: AuditWriter, result: ScenarioResult, *, until: float) -> None:
    """Make the end record durable by ``until`` (shielded), or warn that there is none."""
    reason = "not durable in time: the audit database is locked or slow"
    with anyio.move_on_at(until, shield=True):
        try:
            await writer.write(("end", None, result.summary() | {"trace": None}))
            return
        except AuditError as exc:
            reason = str(exc)
    logger.warning(Events.AUDIT_END_NOT_RECORDED, reason=reason)


@asynccontextmanager
async def _auditing(
    store: AuditStore | None,
    session_id: str,
    spec: ScenarioSpec,
    profile: Profile,
    review: Review | None,
) -> AsyncIterator[AuditWriter | None]:
    if store is None:
        yield None
        return
    data = {
        "scenario": spec.model_dump(mode="json"),
        "profile": profile.model_dump(mode="json"),
        "review": review.config.model_dump(mode="json") if review else None,
    }
    async with open_audit_writer(store, session_id, data) as writer:
        yield writer


async def _actors(run: _Run, agent: Agent, executor: Executor, workdir: str) -> None:
    run.containment = executor.containment
    turns_send, turns_recv = anyio.create_memory_object_stream[Turn](_BUFFER)
    steps_send, steps_recv = anyio.create_memory_object_stream[_Said | _Failed](_BUFFER)
    requests_send, requests_recv = anyio.create_memory_object_stream[Decision](_BUFFER)
    replies_send, replies_recv = anyio.create_memory_object_stream[Observation | _Failed](_BUFFER)
    async with anyio.create_task_group() as tg:
        tg.start_soon(_agent_actor, agent, turns_recv, steps_send)
        tg.start_soon(_executor_actor, executor, workdir, run.spec, requests_recv, replies_send)
        tg.start_soon(_supervisor_actor, run, steps_recv, turns_send, requests_send, replies_recv)


async def _agent_actor(
    agent: Agent,
    turns: MemoryObjectReceiveStream[Turn],
    steps: MemoryObjectSendStream[_Said | _Failed],
) -> None:
    async with turns, steps:
        try:
            await _converse(agent, turns, steps)
        finally:
            close = getattr(agent, "aclose", None)
            if close is not None:  # an agent with a process or a connection: the run used it up
                with anyio.CancelScope(shield=True):
                    await close()


async def _converse(
    agent: Agent,
    turns: MemoryObjectReceiveStream[Turn],
    steps: MemoryObjectSendStream[_Said | _Failed],
) -> None:
    while True:
        try:
            turn = await receive(turns)
        except anyio.EndOfStream:
            return
        try:
            message = await agent.next_step(turn)
        except Exception as exc:
            reason = f"agent raised {type(exc).__name__}: {exc}"
            logger.warning(Events.AGENT_FAILED, step=turn.step, reason=reason)
            await send(steps, _Failed(reason))
            return
        if message is None:
            logger.info(Events.AGENT_DONE, step=turn.step)
            return
        await send(steps, _Said(message))


async def _executor_actor(
    executor: Executor,
    workdir: str,
    spec: ScenarioSpec,
    requests: MemoryObjectReceiveStream[Decision],
    replies: MemoryObjectSendStream[Observation | _Failed],
) -> None:
    env = spec.command_env()
    async with requests, replies:
        while True:
            try:
                decision = await receive(requests)
            except anyio.EndOfStream:
                return
            payload = decision.payload
            try:
                if isinstance(payload, ArtifactPayload):
                    observation = await executor.write_artifact(
                        workdir, payload.path, payload.content
                    )
                elif isinstance(payload, CommandPayload):
                    observation = await executor.run_command(
                        workdir, payload.command, timeout=spec.command_timeout_s, env=env
                    )
                else:  # pragma: no cover - the gate only asks to execute these two
                    raise ExecutorError(f"nothing to execute for {decision.action_type}")
            except ExecutorError as exc:
                logger.warning(Events.EXECUTOR_FAILED, step=decision.step_number, reason=str(exc))
                await send(replies, _Failed(str(exc)))
                return
            await send(replies, observation.model_copy(update={"action": decision.action_type}))


async def _supervisor_actor(
    run: _Run,
    steps: MemoryObjectReceiveStream[_Said | _Failed],
    turns: MemoryObjectSendStream[Turn],
    requests: MemoryObjectSendStream[Decision],
    replies: MemoryObjectReceiveStream[Observation | _Failed],
) -> None:
    async with steps, turns, requests, replies:
        run.log.debug(Events.TURN_SENT, step=1)
        await send(turns, run.turn(None))
        while True:
            try:
                said = await receive(steps)
            except anyio.EndOfStream:
                return
            if isinstance(said, _Failed):
                run.finish(Outcome.AGENT_ERROR, said.reason)
                return
            bind_contextvars(step=run.gate.step_count + 1)  # this task's context only
            try:
                response = await _supervise(run, said.message, requests, replies)
            except AuditError as exc:
                run.finish(Outcome.AUDIT_ERROR, str(exc))
                return
            if response is None:
                return
            run.log.debug(Events.TURN_SENT, step=run.gate.step_count + 1)
            await send(turns, run.turn(response))


async def _supervise(
    run: _Run,
    message: AgentMessage,
    requests: MemoryObjectSendStream[Decision],
    replies: MemoryObjectReceiveStream[Observation | _Failed],
) -> Response | None:
    """One step: record it, review it, let the gate decide, execute, observe.

    Returns the response for the agent, or ``None`` once the run has ended.
    """
    gate, review, audit = run.gate, run.review, run.audit
    number = gate.step_count + 1
    run.log.debug(Events.STEP_RECEIVED)
    parsed = gate.parse(message) if review is not None else None
    flags = review.state.flags(parsed) if review is not None and parsed is not None else ()
    if audit is not None:
        step_data = _raw_record(message)
        if flags:
            step_data["flags"] = [flag.model_dump(mode="json") for flag in flags]
        await audit.write(("step", number, step_data))

    correction: str | None = None
    decision: Decision | None = None
    if review is not None and parsed is not None:
        supervision = await review.assess(number, parsed, flags)
        if supervision is not None:
            if audit is not None:
                await audit.write(("supervision", number, supervision.model_dump(mode="json")))
            run.log.info(
                Events.REVIEW_VERDICT,
                verdict=supervision.verdict.value,
                action=supervision.action.value,
                fail_closed=supervision.fail_closed,
                flags=[flag.trigger for flag in flags],
            )
            if supervision.action is ReviewAction.ABORT:
                run.finish(Outcome.ABORTED_BY_HUMAN, supervision.reasoning)
                return None
            if supervision.action is ReviewAction.PAUSED_NO_HUMAN:
                run.finish(Outcome.PAUSED_NO_HUMAN, supervision.reasoning)
                return None
            if supervision.action is ReviewAction.REORIENT:
                decision = gate.withhold(REORIENTED)
                correction = supervision.correction
    if decision is None:
        decision = gate.decide(parsed if parsed is not None else message)

    if audit is not None:
        await audit.write(
            (
                "decision",
                number,
                {
                    "action": decision.action_type,
                    "verdict": decision.verdict.value,
                    "message": decision.message,
                    "detail": decision.detail,
                },
            )
        )
    run.log.info(
        Events.GATE_VERDICT,
        action=decision.action_type,
        verdict=decision.verdict.value,
        reason=decision.message,  # not "message": a log record has a message of its own
        detail=decision.detail,
    )
    observed = None
    if decision.needs_execution:
        observed = await _execute(run, decision, requests, replies)
        if observed is None:
            return None
        if review is not None and decision.step is not None:
            review.state.note_executed(number, decision.step, observed)
    run.trace.append(
        TraceEntry(
            step=number,
            action=decision.action_type,
            verdict=decision.verdict,
            message=decision.message,
            observed=observed.summary() if observed else decision.detail,
        )
    )
    if decision.verdict is Verdict.TERMINATE:
        run.finish(Outcome.TERMINATED)
        return None
    if gate.step_count >= run.max_steps:
        run.finish(Outcome.STEP_BUDGET_EXHAUSTED, f"step budget of {run.max_steps} used up")
        return None
    response = gate.response(decision)
    if correction is not None:
        response = response.model_copy(update={"correction": correction})
    return response


async def _execute(
    run: _Run,
    decision: Decision,
    requests: MemoryObjectSendStream[Decision],
    replies: MemoryObjectReceiveStream[Observation | _Failed],
) -> Observation | None:
    run.log.debug(Events.EXEC_REQUESTED, action=decision.action_type)
    await send(requests, decision)
    try:
        reply = await receive(replies)
    except anyio.EndOfStream:
        reply = _Failed("the executor stopped")
    if isinstance(reply, _Failed):
        run.finish(Outcome.EXECUTOR_ERROR, reply.reason)
        return None
    run.log.info(
        Events.EXEC_OBSERVED,
        success=reply.success,
        exit_status=reply.exit_status,
        program_found=reply.program_found,
        error=reply.error,
        duration_s=round(reply.duration_s, 4),
    )
    if run.audit is not None:
        await run.audit.write(("observation", decision.step_number, reply.model_dump(mode="json")))
    run.gate.observe(reply)
    return reply


def _raw_record(message: AgentMessage) -> dict[str, Any]:
    """The agent's message as it arrived, in a form replay can feed to the gate again."""
    if isinstance(message, str):
        return {"raw": message}
    if isinstance(message, bytes | bytearray):
        try:
            return {"raw": bytes(message).decode("utf-8")}
        except UnicodeDecodeError:
            return {"raw_b64": base64.b64encode(bytes(message)).decode()}
    if isinstance(message, AgentStep):
        return {"raw": message.model_dump_json()}
    if isinstance(message, Mapping):
        try:
            return {"raw": json.dumps(dict(message), sort_keys=True)}
        except (TypeError, ValueError):
            return {"raw": repr(message), "unserialisable": True}
    return {"raw": repr(message), "unserialisable": True}


def _result(run: _Run, duration: float, workdir: str | None, session_id: str) -> ScenarioResult:
    counts = Counter(entry.verdict for entry in run.trace)
    assert run.outcome is not None
    return ScenarioResult(
        scenario_id=run.spec.id,
        outcome=run.outcome,
        posture=run.gate.final_posture if run.outcome is Outcome.TERMINATED else None,
        steps=run.gate.step_count,
        verdicts={verdict.value.lower(): counts.get(verdict, 0) for verdict in Verdict},
        duration_s=duration,
        trace=run.trace,
        reason=run.reason,
        masks=run.gate.masks_view,
        workdir=workdir,
        session_id=session_id,
        sandbox=run.containment,
    )
