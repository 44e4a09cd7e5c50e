"""``run_scenario``: agent, supervisor and executor as three actors under one deadline.

The actors are anyio tasks in one task group, joined only by memory object streams::

    agent --steps--> supervisor --requests--> executor
    agent <--turns-- supervisor <--observations-- executor
                         |
                         +--records--> audit trail (optional)

The supervisor takes each step in five phases: **record** what the agent said, let the
review layer **review** it, let the gate **decide**, **execute** what the gate allowed,
and **conclude** (trace it; end the run, or answer the agent). A run without a review or
an audit store has null ones that pass steps through and record nothing.

The task group sits in one cancel scope whose deadline is the scenario's budget. When
it fires every actor is cancelled; executors kill what they started in shielded cleanup,
and the run's end is recorded after the scope, shielded and bounded.
"""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from structlog.contextvars import bind_contextvars, bound_contextvars

from executors import Executor, ExecutorError, LocalExecutor

from ._errors import single_failure
from ._reviewing import Reviewing, reviewing
from ._streams import receive, send
from ._trail import Trail, open_trail
from .agents.base import Agent, AgentMessage, agent_label
from .audit.store import AuditError, AuditStore
from .config import RunConfig
from .evaluating import Programs, run_evaluation
from .events import Events, logger
from .gate import Decision, Gate, Rules
from .handle import RunHandle
from .profile import Profile
from .protocol import (
    AgentStep,
    ArtifactPayload,
    CommandPayload,
    Containment,
    Observation,
    Response,
    Turn,
    Verdict,
)
from .records import recordable
from .result import Outcome, ScenarioResult, TraceEntry
from .review.layer import REORIENTED, Review, ReviewAction, SupervisionRecord
from .review.reconcile import Flag
from .scenario import ScenarioSpec
from .stopped import stopped_by
from .telemetry import traced

if TYPE_CHECKING:
    from .telemetry import Telemetry

__all__ = ["run_scenario"]

_BUFFER = 1
_CLEANUP_TIMEOUT = 5.0
_END_GRACE = 1.0  # how long past the deadline (or a cancellation) the end record may take
#: review rulings that end the run, and how
_STOPS = {
    ReviewAction.ABORT: Outcome.ABORTED_BY_HUMAN,
    ReviewAction.PAUSED_NO_HUMAN: Outcome.PAUSED_NO_HUMAN,
}


@dataclass(frozen=True, slots=True)
class _Said:
    message: AgentMessage


@dataclass(frozen=True, slots=True)
class _Failed:
    reason: str
    stderr: str | None = None  # what an agent program that failed wrote on its stderr


@dataclass(frozen=True, slots=True)
class _Options:
    """What one run is: its scenario, executor and session, and its configuration with
    the scenario's profile, deadline and step budget filled in."""

    spec: ScenarioSpec
    executor: Executor
    session_id: str
    config: RunConfig

    @property
    def profile(self) -> Profile:
        assert self.config.profile is not None
        return self.config.profile

    @property
    def budget(self) -> float:
        assert self.config.deadline is not None
        return self.config.deadline

    @property
    def max_steps(self) -> int:
        assert self.config.max_steps is not None
        return self.config.max_steps


@dataclass
class _Run:
    """The supervisor's record of the run; read by ``run_scenario`` once the actors end."""

    spec: ScenarioSpec
    gate: Gate
    max_steps: int
    review: Reviewing
    trail: Trail
    log: Any  # the events logger, bound once per run: a proxy lookup per event adds up
    on_step: Callable[[TraceEntry], None] | None = None  # told each line of the trace
    trace: list[TraceEntry] = field(default_factory=list)
    outcome: Outcome | None = None
    reason: str | None = None
    containment: Containment | None = None  # what contains the commands, once known
    workdir: str | None = None  # where the workdir is kept, once the run is over
    cleanup_error: str | None = None  # why some of the workdir is left behind
    agent_stderr: str | None = None  # what a failed agent program wrote on its stderr

    def __post_init__(self) -> None:
        self._goal = self.spec.rendered_goal()
        self._actions = tuple(self.gate.profile.actions)

    @property
    def ended(self) -> bool:
        return self.outcome is not None

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


class _Workdir:
    """The run's workdir: prepared on entry, with its sandbox proven (``None`` if the
    executor cannot make one, and :attr:`refused` says why); on exit cleaned up (shielded,
    bounded) and removed if the run made it (the spec names none) and was not told to keep
    it. :attr:`containment` says how its commands are contained (what the canary found,
    for a sandbox that leaked); :attr:`left` why some of it could not be removed."""

    def __init__(self, executor: Executor, spec: ScenarioSpec, *, keep: bool) -> None:
        self._executor = executor
        self._spec = spec
        self._remove = spec.workdir is None and not keep
        #: where the workdir is: ``None`` unless prepared, and once removed
        self.path: str | None = None
        self.refused: str | None = None
        self.containment: Containment | None = None
        self.left: str | None = None

    async def __aenter__(self) -> str | None:
        spec = self._spec
        try:
            self.path = await self._executor.prepare(
                spec.workdir, spec.rendered_files(), env=spec.command_env()
            )
        except ExecutorError as exc:
            self.refused = str(exc)
            found = getattr(exc, "containment", None)
            self.containment = found if isinstance(found, Containment) else None
            return None
        self.containment = self._executor.containment_of(self.path)
        return self.path

    async def __aexit__(self, *exc_info: object) -> None:
        if self.path is None:
            return
        with anyio.move_on_after(_CLEANUP_TIMEOUT, shield=True):
            try:
                await self._executor.cleanup(self.path, remove=self._remove)
            except ExecutorError as exc:
                self.left = str(exc)
                return
        if self._remove:
            self.path = None


@single_failure
async def run_scenario(
    spec: ScenarioSpec,
    *,
    agent: Agent,
    executor: Executor | None = None,
    config: RunConfig | None = None,
    session_id: str | None = None,
    handle: RunHandle | None = None,
    profile: Profile | None = None,
    deadline: float | None = None,
    max_steps: int | None = None,
    keep_workdir: bool | None = None,
    review: Review | None = None,
    audit: AuditStore | None = None,
    rules: Rules | None = None,
    telemetry: Telemetry | None = None,
    on_step: Callable[[TraceEntry], None] | None = None,
) -> ScenarioResult:
    """Run one scenario to its end and report how it ended.

    ``executor`` defaults to a :class:`executors.LocalExecutor` made (and closed) for this
    run alone, whose workdir root is a fresh temporary directory. ``config``
    (:class:`RunConfig`) says how the run is supervised; the options after ``handle`` are
    its fields, each replacing the config's when given (``deadline=30``). The run is
    recorded under ``session_id`` (a new one by default).

    No audit wait outlasts the deadline: a record not durable by then ends the run
    ``audit_error``, and the end record gets at most a second more. Cancelled from outside
    (a signal, the caller's scope), the run still kills what runs, traces the step in
    flight as killed, records its end (``cancelled``) and logs ``scenario.finished``, then
    lets the cancellation through; a ``handle`` (:class:`RunHandle`) holds that result,
    and a run cancelled through its handle returns it. ``duration_s`` is the call's wall
    time. A failure it does not expect (a bug in an executor, an agent whose ``aclose``
    raises) comes out as itself, not in an ``ExceptionGroup``.
    """
    given = {
        "profile": profile,
        "deadline": deadline,
        "max_steps": max_steps,
        "keep_workdir": keep_workdir,
        "review": review,
        "audit": audit,
        "rules": rules,
        "telemetry": telemetry,
        "on_step": on_step,
    }
    config = (config or RunConfig()).replace(
        **{name: value for name, value in given.items() if value is not None}
    )
    config = config.replace(
        profile=config.profile_for(spec),
        deadline=config.deadline_for(spec),
        max_steps=config.max_steps_for(spec),
    )
    started = anyio.current_time()
    async with AsyncExitStack() as made:
        if executor is None:  # made here, closed here
            executor = await made.enter_async_context(LocalExecutor())
        if not isinstance(executor, Executor):
            raise TypeError(f"{type(executor).__name__} does not implement the executor protocol")
        options = _Options(spec, executor, session_id or uuid.uuid4().hex, config)
        handle = handle or RunHandle()
        with bound_contextvars(scenario_id=spec.id), anyio.CancelScope() as own:
            handle.attach(own)
            return await _run(options, agent, started, handle)
        if handle.result is None:  # cancelled through the handle before the run got going
            handle.finished(_unstarted(options, anyio.current_time() - started))
        assert handle.result is not None
        return handle.result


def _unstarted(options: _Options, duration: float) -> ScenarioResult:
    """The result of a run cancelled while its audit trail was still opening."""
    return ScenarioResult(
        scenario_id=options.spec.id,
        outcome=Outcome.CANCELLED,
        posture=None,
        steps=0,
        verdicts={verdict.value.lower(): 0 for verdict in Verdict},
        duration_s=duration,
        trace=[],
        reason="cancelled before its first step",
        masks=Gate(options.profile).masks_view,
        session_id=options.session_id,
    )


async def _run(
    options: _Options, agent: Agent, started: float, handle: RunHandle
) -> ScenarioResult:
    """The run from its start event to its end record: the actors under the deadline."""
    spec, ends_at = options.spec, started + options.budget
    logger.info(Events.SCENARIO_STARTED, deadline_s=options.budget, max_steps=options.max_steps)
    config = options.config
    gate = Gate(options.profile, rules=config.rules)
    review = config.review
    label = agent_label(agent)  # the same name in the record and the trace
    async with open_trail(
        config.audit,
        options.session_id,
        spec=spec,
        profile=options.profile,
        review=review.config if review is not None else None,
        agent=label,
        heads=config.telemetry is not None,
    ) as trail:
        trail, on_step = traced(  # with telemetry: a trace of the run, a span per step
            trail,
            config.telemetry,
            spec=spec,
            session_id=options.session_id,
            agent=label,
            on_step=config.on_step,
        )
        run = _Run(
            spec=spec,
            gate=gate,
            max_steps=options.max_steps,
            review=reviewing(review, gate, goal=spec.rendered_goal(), scenario_id=spec.id),
            trail=trail,
            log=logger.bind(),
            on_step=on_step,
        )
        stopped = await _act(run, agent, options, ends_at)
        with anyio.CancelScope(shield=stopped is not None):
            result = _result(run, anyio.current_time() - started, options.session_id)
            grace = anyio.current_time() + _END_GRACE
            await trail.end(result, until=grace if stopped is not None else max(grace, ends_at))
            result = result.model_copy(update={"duration_s": anyio.current_time() - started})
            _log_finished(result)
            handle.finished(result)
    if stopped is not None:
        raise stopped
    return result


async def _act(run: _Run, agent: Agent, options: _Options, ends_at: float) -> BaseException | None:
    """Run the actors in the workdir until ``ends_at`` and settle the outcome. Returns the
    cancellation from outside (a signal, the caller's scope) that stopped the run, if one
    did: the run's end is recorded before it is let through."""
    workdir = _Workdir(options.executor, options.spec, keep=options.config.keep_workdir)
    budget = options.budget
    try:
        with anyio.CancelScope(deadline=ends_at) as scope:
            async with workdir as path:
                run.containment = workdir.containment
                await run.trail.begin(workdir.containment)
                if path is None:  # the executor cannot work, or its sandbox leaks
                    run.finish(Outcome.EXECUTOR_ERROR, workdir.refused)
                else:
                    await _actors(run, agent, options.executor, path)
    except anyio.get_cancelled_exc_class() as exc:
        run.finish(Outcome.CANCELLED, "cancelled from outside the run")
        return exc
    except AuditError as exc:
        run.finish(Outcome.AUDIT_ERROR, str(exc))
    finally:
        run.workdir = workdir.path
        run.cleanup_error = workdir.left
    if scope.cancelled_caught:
        if run.trail.stalled:
            run.finish(
                Outcome.AUDIT_ERROR,
                f"an audit record was not durable within the deadline of {budget:g} s",
            )
        run.finish(Outcome.DEADLINE_EXCEEDED, f"deadline of {budget:g} s exceeded")
    run.finish(Outcome.AGENT_FINISHED)
    return None


def _log_finished(result: ScenarioResult) -> None:
    logger.info(
        Events.SCENARIO_FINISHED,
        outcome=result.outcome.value,
        steps=result.steps,
        posture=result.posture,
        duration_s=round(result.duration_s, 4),
        reason=result.reason,
    )


async def _actors(run: _Run, agent: Agent, executor: Executor, workdir: str) -> None:
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
            stderr = getattr(exc, "stderr", None)  # an agent program's, as it failed
            await send(steps, _Failed(reason, stderr if isinstance(stderr, str) else None))
            return
        if message is None:
            logger.info(Events.AGENT_DONE, step=turn.step)
            return
        await send(steps, _Said(recordable(message)))


async def _executor_actor(
    executor: Executor,
    workdir: str,
    spec: ScenarioSpec,
    requests: MemoryObjectReceiveStream[Decision],
    replies: MemoryObjectSendStream[Observation | _Failed],
) -> None:
    env = spec.command_env()
    programs = Programs(executor, workdir, env)
    async with requests, replies:
        while True:
            try:
                decision = await receive(requests)
            except anyio.EndOfStream:
                return
            payload = decision.payload
            timeout = spec.command_timeout_s
            try:
                if isinstance(payload, ArtifactPayload):
                    observation = await executor.write_artifact(
                        workdir, payload.path, payload.content
                    )
                elif decision.evaluation is not None:
                    observation = await run_evaluation(
                        executor, workdir, decision.evaluation, programs, timeout=timeout, env=env
                    )
                elif isinstance(payload, CommandPayload):
                    observation = await executor.run_command(
                        workdir, payload.command, timeout=timeout, env=env
                    )
                else:  # pragma: no cover - the gate only asks to execute these
                    raise ExecutorError(f"nothing to execute for {decision.action_type}")
            except ExecutorError as exc:
                logger.warning(Events.EXECUTOR_FAILED, step=decision.step_number, reason=str(exc))
                await send(replies, _Failed(str(exc)))
                return
            await send(replies, observation.model_copy(update={"action": decision.action_type}))


@dataclass(frozen=True, slots=True)
class _ExecutorLink:
    """The supervisor's end of the executor actor's streams."""

    requests: MemoryObjectSendStream[Decision]
    replies: MemoryObjectReceiveStream[Observation | _Failed]

    async def run(self, decision: Decision) -> Observation | _Failed:
        await send(self.requests, decision)
        try:
            return await receive(self.replies)
        except anyio.EndOfStream:
            return _Failed("the executor stopped")


async def _supervisor_actor(
    run: _Run,
    steps: MemoryObjectReceiveStream[_Said | _Failed],
    turns: MemoryObjectSendStream[Turn],
    requests: MemoryObjectSendStream[Decision],
    replies: MemoryObjectReceiveStream[Observation | _Failed],
) -> None:
    async with steps, turns, requests, replies:
        executor = _ExecutorLink(requests, replies)
        response: Response | None = None
        while True:
            run.log.debug(Events.TURN_SENT, step=run.gate.step_count + 1)
            await send(turns, run.turn(response))
            try:
                said = await receive(steps)
            except anyio.EndOfStream:
                return
            if isinstance(said, _Failed):
                run.finish(Outcome.AGENT_ERROR, said.reason)
                run.agent_stderr = said.stderr
                return
            bind_contextvars(step=run.gate.step_count + 1)  # this task's context only
            try:
                response = await _step(run, said.message, executor)
            except AuditError as exc:
                run.finish(Outcome.AUDIT_ERROR, str(exc))
                return
            if response is None:
                return


async def _step(run: _Run, message: AgentMessage, executor: _ExecutorLink) -> Response | None:
    """One step: record, review, decide, execute, conclude.

    Returns the response for the agent, or ``None`` once the run has ended.
    """
    number = run.gate.step_count + 1
    run.log.debug(Events.STEP_RECEIVED)
    parsed, flags = run.review.screen(message)
    await run.trail.step(number, message, flags)
    supervision = await _review(run, number, parsed, flags)
    if run.ended:
        return None
    decision = await _decide(run, parsed if parsed is not None else message, supervision)
    observed = await _execute(run, decision, executor)
    if run.ended:
        return None
    return _conclude(run, decision, observed, supervision)


async def _review(
    run: _Run, number: int, parsed: AgentStep | None, flags: tuple[Flag, ...]
) -> SupervisionRecord | None:
    """The review layer's ruling on the step, recorded, if it made one. An abort, or a
    pause with no human to ask, ends the run."""
    supervision = await run.review.assess(number, parsed, flags)
    if supervision is None:
        return None
    await run.trail.supervision(number, supervision)
    run.log.info(
        Events.REVIEW_VERDICT,
        verdict=supervision.verdict.value,
        action=supervision.action.value,
        fail_closed=supervision.fail_closed,
        flags=[flag.trigger for flag in flags],
    )
    stop = _STOPS.get(supervision.action)
    if stop is not None:
        run.finish(stop, supervision.reasoning)
    return supervision


async def _decide(
    run: _Run, message: AgentMessage, supervision: SupervisionRecord | None
) -> Decision:
    """The gate's verdict on the step (withheld, if the review sent it back), recorded."""
    if supervision is not None and supervision.action is ReviewAction.REORIENT:
        decision = run.gate.withhold(REORIENTED)
    else:
        decision = run.gate.decide(message)
    await run.trail.decision(decision)
    run.log.info(
        Events.GATE_VERDICT,
        action=decision.action_type,
        verdict=decision.verdict.value,
        reason=decision.message,  # not "message": a log record has a message of its own
        detail=decision.detail,
    )
    return decision


async def _execute(run: _Run, decision: Decision, executor: _ExecutorLink) -> Observation | None:
    """What running an allowed action observed, recorded and applied to the masks; ``None``
    if nothing ran. An executor that cannot work ends the run."""
    if not decision.needs_execution:
        return None
    run.log.debug(Events.EXEC_REQUESTED, action=decision.action_type)
    try:
        reply = await executor.run(decision)
    except anyio.get_cancelled_exc_class():  # the deadline or a cancellation: it was killed
        _trace(run, decision, "killed: the run ended while it ran")
        raise
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
    await run.trail.observation(decision.step_number, reply)
    run.gate.observe(reply)
    masks = run.gate.masks
    if masks.chain is not None:
        await run.trail.evidence(decision.step_number, masks.chain)
    if masks.refused is not None:
        run.log.info(Events.EVIDENCE_REFUSED, reason=masks.refused)
    run.review.executed(decision, reply)
    return reply


def _trace(
    run: _Run, decision: Decision, said: str | None, observed: Observation | None = None
) -> None:
    """Add the step's line to the trace, and tell ``on_step``: the masks after the step,
    why the evidence rule refused its output (if it did), which mask stopped it (for a
    ``BLOCK`` or ``CONTINUE``), and a command's captured output."""
    masks = run.gate.masks
    ran = observed is not None and observed.kind == "command"
    stopped = decision.verdict in (Verdict.BLOCK, Verdict.CONTINUE)
    entry = TraceEntry(
        step=decision.step_number,
        action=decision.action_type,
        verdict=decision.verdict,
        message=decision.message,
        observed=said,
        stdout=observed.stdout.text if ran and observed else None,
        stderr=observed.stderr.text if ran and observed else None,
        masks=masks.view(),
        refused=masks.refused if observed is not None else None,
        stopped_by=stopped_by(decision, masks) if stopped else None,
    )
    run.trace.append(entry)
    if run.on_step is not None:
        run.on_step(entry)


def _conclude(
    run: _Run,
    decision: Decision,
    observed: Observation | None,
    supervision: SupervisionRecord | None,
) -> Response | None:
    """Trace the step, then end the run (terminated, or its step budget used up) or
    answer the agent, with the review's correction if it sent the step back."""
    _trace(run, decision, observed.summary() if observed else decision.detail, observed)
    if decision.verdict is Verdict.TERMINATE:
        run.finish(Outcome.TERMINATED)
        return None
    if run.gate.step_count >= run.max_steps:
        run.finish(Outcome.STEP_BUDGET_EXHAUSTED, f"step budget of {run.max_steps} used up")
        return None
    response = run.gate.response(decision)
    if supervision is not None and supervision.action is ReviewAction.REORIENT:
        response = response.model_copy(update={"correction": supervision.correction})
    return response


def _result(run: _Run, duration: float, session_id: str) -> ScenarioResult:
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
        workdir=run.workdir,
        session_id=session_id,
        sandbox=run.containment.sandbox if run.containment is not None else None,
        containment=run.containment,
        cleanup_error=run.cleanup_error,
        agent_stderr=run.agent_stderr,
    )
