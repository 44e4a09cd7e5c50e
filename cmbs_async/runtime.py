"""``run_scenario``: agent, supervisor and executor as three actors under one deadline.

The actors are anyio tasks in one task group, joined only by memory object streams::

    agent --steps--> supervisor --requests--> executor
    agent <--turns-- supervisor <--observations-- executor

The task group sits in one cancel scope whose deadline is the scenario's budget. When
it fires every actor is cancelled; executors kill what they started in shielded cleanup.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from structlog.contextvars import bound_contextvars

from ._streams import receive, send
from .agents.base import Agent, AgentMessage
from .events import Events, logger
from .gate import Decision, Gate
from .profile import Profile, load_profile
from .protocol import ArtifactPayload, CommandPayload, Observation, Response, Turn, Verdict
from .result import Outcome, ScenarioResult, TraceEntry
from .scenario import ScenarioSpec

if TYPE_CHECKING:
    from executors.base import Executor

__all__ = ["run_scenario"]

_BUFFER = 1
_CLEANUP_TIMEOUT = 5.0


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
    trace: list[TraceEntry] = field(default_factory=list)
    outcome: Outcome | None = None
    reason: str | None = None

    def finish(self, outcome: Outcome, reason: str | None = None) -> None:
        if self.outcome is None:
            self.outcome, self.reason = outcome, reason

    def __post_init__(self) -> None:
        self._goal = self.spec.rendered_goal()
        self._actions = tuple(self.gate.profile.actions)

    def turn(self, response: Response | None) -> Turn:
        return Turn(
            scenario_id=self.spec.id,
            goal=self._goal,
            vars=self.spec.vars,
            actions=self._actions,
            step=self.gate.step_count + 1,
            response=response,
        )


async def run_scenario(
    spec: ScenarioSpec,
    *,
    agent: Agent,
    executor: Executor | None = None,
    profile: Profile | None = None,
    deadline: float | None = None,
    max_steps: int | None = None,
    keep_workdir: bool = False,
) -> ScenarioResult:
    """Run one scenario to its end and report how it ended.

    ``executor`` defaults to a :class:`executors.LocalExecutor`; ``deadline`` (seconds)
    and ``max_steps`` override the spec's. A temporary workdir (the spec names none) is
    removed afterwards unless ``keep_workdir``.
    """
    from executors.base import Executor, ExecutorError  # composition root

    if executor is None:
        from executors.local import LocalExecutor

        executor = LocalExecutor()
    if not isinstance(executor, Executor):
        raise TypeError(f"{type(executor).__name__} does not implement the executor protocol")
    run = _Run(
        spec=spec,
        gate=Gate(profile or load_profile(spec.profile)),
        max_steps=max_steps or spec.max_steps,
    )
    budget = deadline if deadline is not None else spec.deadline_s
    started = anyio.current_time()
    workdir: str | None = None

    with bound_contextvars(scenario_id=spec.id):
        logger.info(Events.SCENARIO_STARTED, deadline_s=budget, max_steps=run.max_steps)
        with anyio.CancelScope(deadline=started + budget) as scope:
            try:
                workdir = await executor.prepare(spec.workdir, spec.files)
            except ExecutorError as exc:
                run.finish(Outcome.EXECUTOR_ERROR, str(exc))
            else:
                await _actors(run, agent, executor, workdir)
        if scope.cancelled_caught:
            run.finish(Outcome.DEADLINE_EXCEEDED, f"deadline of {budget:g} s exceeded")
        run.finish(Outcome.AGENT_FINISHED)
        if workdir is not None and spec.workdir is None and not keep_workdir:
            with anyio.move_on_after(_CLEANUP_TIMEOUT, shield=True):
                await executor.cleanup(workdir)
            workdir = None
        result = _result(run, anyio.current_time() - started, workdir)
        logger.info(
            Events.SCENARIO_FINISHED,
            outcome=result.outcome.value,
            steps=result.steps,
            posture=result.posture,
            duration_s=round(result.duration_s, 4),
            reason=result.reason,
        )
    return result


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
    from executors.base import ExecutorError

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
                        workdir, payload.command, timeout=spec.command_timeout_s
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
    gate = run.gate
    async with steps, turns, requests, replies:
        logger.debug(Events.TURN_SENT, step=1)
        await send(turns, run.turn(None))
        while True:
            try:
                said = await receive(steps)
            except anyio.EndOfStream:
                return
            if isinstance(said, _Failed):
                run.finish(Outcome.AGENT_ERROR, said.reason)
                return
            decision = gate.decide(said.message)
            with bound_contextvars(step=decision.step_number):
                logger.debug(Events.STEP_RECEIVED)
                logger.info(
                    Events.GATE_VERDICT,
                    action=decision.action_type,
                    verdict=decision.verdict.value,
                    message=decision.message,
                    detail=decision.detail,
                )
                observed: Observation | None = None
                if decision.needs_execution:
                    logger.debug(Events.EXEC_REQUESTED, action=decision.action_type)
                    await send(requests, decision)
                    try:
                        reply = await receive(replies)
                    except anyio.EndOfStream:
                        reply = _Failed("the executor stopped")
                    if isinstance(reply, _Failed):
                        run.finish(Outcome.EXECUTOR_ERROR, reply.reason)
                        return
                    logger.info(
                        Events.EXEC_OBSERVED,
                        success=reply.success,
                        exit_status=reply.exit_status,
                        program_found=reply.program_found,
                        error=reply.error,
                        duration_s=round(reply.duration_s, 4),
                    )
                    gate.observe(reply)
                    observed = reply
                run.trace.append(
                    TraceEntry(
                        step=decision.step_number,
                        action=decision.action_type,
                        verdict=decision.verdict,
                        message=decision.message,
                        observed=observed.summary() if observed else decision.detail,
                    )
                )
                if decision.verdict is Verdict.TERMINATE:
                    run.finish(Outcome.TERMINATED)
                    return
                if gate.step_count >= run.max_steps:
                    run.finish(
                        Outcome.STEP_BUDGET_EXHAUSTED, f"step budget of {run.max_steps} used up"
                    )
                    return
                logger.debug(Events.TURN_SENT, step=gate.step_count + 1)
                await send(turns, run.turn(gate.response(decision)))


def _result(run: _Run, duration: float, workdir: str | None) -> ScenarioResult:
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
    )
