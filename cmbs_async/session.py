"""A supervised session, for agents that drive their own loop (tool-calling agents).

The session is :func:`run_scenario` turned inside out: the run's agent is a channel fed
by :meth:`Session.step`, so the same runtime owns the workdir, the executor, the gate,
the review layer, the audit record and the deadline, and a session is recorded, traced
and cancelled exactly like any run.

Belief policy, for agents that send none (``belief=None``): the session claims no
affordance and no evidence (``unknown`` and ``none`` are always consistent), and as its
posture the one its last *accepted* posture declaration named (``unknown`` before one).
A posture declaration claims the posture it declares. So an honest agent that observes,
declares once the evidence is there and then terminates earns its termination, while a
declaration made too early is refused (no successful observation yet) and claims
nothing afterwards. An agent that does track a belief passes it and is judged on it.
"""

from __future__ import annotations

from contextlib import AsyncExitStack
from dataclasses import dataclass
from functools import partial
from types import TracebackType
from typing import Any

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from executors import Executor

from ._errors import CmbsError
from .config import RunConfig
from .handle import RunHandle
from .protocol import ActionKind, Belief, MasksView, Observation, Turn, Verdict
from .result import Outcome, ScenarioResult
from .runtime import run_scenario
from .scenario import ScenarioSpec

__all__ = ["Session", "SessionEnded", "StepReply"]


class SessionEnded(CmbsError, RuntimeError):
    """The session's run is over (terminated, deadline, budget, cancelled): no more steps."""

    def __init__(self, result: ScenarioResult) -> None:
        super().__init__(f"the session has ended: {result.outcome.value}")
        self.result = result


@dataclass(frozen=True)
class StepReply:
    """The supervisor's answer to one step: ``verdict`` and its neutral ``message``,
    ``observation`` when the step ran something, and, once the step ended the session
    (``TERMINATE``, the deadline, the step budget), the run's ``result``."""

    verdict: Verdict
    message: str
    detail: str | None = None
    observation: Observation | None = None
    masks: MasksView | None = None
    correction: str | None = None
    result: ScenarioResult | None = None

    @property
    def ended(self) -> bool:
        return self.result is not None


class _Channel:
    """The agent of the session's run: each turn goes out to :meth:`Session.step`, and
    the step it sends back comes in; a closed session ends the run (agent finished)."""

    label = "session"

    def __init__(
        self,
        turns: MemoryObjectSendStream[Turn],
        steps: MemoryObjectReceiveStream[dict[str, Any]],
    ) -> None:
        self._turns = turns
        self._steps = steps

    async def next_step(self, turn: Turn) -> dict[str, Any] | None:
        await self._turns.send(turn)
        try:
            return await self._steps.receive()
        except anyio.EndOfStream:
            return None

    async def aclose(self) -> None:
        self._turns.close()
        self._steps.close()


class Session:
    """One supervised scenario, stepped by its caller; use it with ``async with``.

    ``config`` (:class:`RunConfig`) says how the run is supervised, as for
    :func:`run_scenario`. The deadline runs from entering the session.
    Leaving it ends the run (``agent_finished``, unless it ended before); leaving it on an
    exception cancels the run. :attr:`result` is the run's result once it has ended.
    """

    def __init__(
        self,
        spec: ScenarioSpec,
        *,
        executor: Executor | None = None,
        config: RunConfig | None = None,
        session_id: str | None = None,
    ) -> None:
        config = config or RunConfig()
        self.profile = config.profile_for(spec)
        self.goal = spec.rendered_goal()
        self._run = partial(
            run_scenario,
            spec,
            executor=executor,
            config=config.replace(profile=self.profile),
            session_id=session_id,
        )
        self._handle = RunHandle()
        self._turns_send, self._turns = anyio.create_memory_object_stream[Turn](1)
        self._steps, self._steps_recv = anyio.create_memory_object_stream[dict[str, Any]](1)
        self._stack = AsyncExitStack()
        self._declared = "unknown"
        self._one_at_a_time: anyio.Lock | None = None

    @property
    def result(self) -> ScenarioResult | None:
        return self._handle.result

    async def wait(self) -> ScenarioResult:
        """Wait until the session's run has ended (terminated, deadline, step budget)."""
        return await self._handle.wait()

    async def __aenter__(self) -> Session:
        group = await self._stack.enter_async_context(anyio.create_task_group())
        agent = _Channel(self._turns_send, self._steps_recv)
        group.start_soon(partial(self._run, agent=agent, handle=self._handle))
        try:
            await self._turns.receive()  # the first turn: the run is under way
        except anyio.EndOfStream:
            pass  # it ended before its first step (the executor cannot work): step() says
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        if exc_type is not None:  # the caller's loop failed: the run is cancelled, the
            self._handle.cancel()  # failure goes on as itself (not in an exception group)
        self._steps.close()  # no more steps: the run ends (agent finished)
        try:
            await self._stack.aclose()
        finally:
            self._turns.close()
        return None

    async def step(
        self,
        action: str,
        payload: dict[str, Any] | None = None,
        *,
        belief: Belief | dict[str, Any] | None = None,
    ) -> StepReply:
        """Propose ``action`` with ``payload``; return once it was judged and, if allowed,
        executed. Raises :class:`SessionEnded` once the run is over. Steps called at once
        (a model's parallel tool calls) are taken one at a time, in turn; a step cancelled
        half-way (the caller's timeout) cancels the session's run."""
        if self._handle.result is not None or self._handle.cancel_called:
            raise SessionEnded(await self._handle.wait())
        if self._one_at_a_time is None:
            self._one_at_a_time = anyio.Lock()
        async with self._one_at_a_time:  # tool calls made in parallel are taken in turn
            if self._handle.result is not None or self._handle.cancel_called:
                raise SessionEnded(await self._handle.wait())
            return await self._step(action, payload or {}, belief)

    async def _step(
        self, action: str, payload: dict[str, Any], belief: Belief | dict[str, Any] | None
    ) -> StepReply:
        claimed = self._belief(action, payload) if belief is None else belief
        if isinstance(claimed, Belief):
            claimed = claimed.model_dump(mode="json")
        try:
            await self._steps.send(
                {"belief": claimed, "action": {"type": action, "payload": payload}}
            )
            turn = await self._turns.receive()
        except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError):
            return self._final(await self._handle.wait())
        except anyio.get_cancelled_exc_class():  # its reply would answer the next step:
            self._handle.cancel()  # a step cancelled half-way ends the session
            raise
        response = turn.response
        assert response is not None  # every turn after the first answers a step
        kind = self._kind(action)
        if kind is ActionKind.DECLARE_POSTURE and response.verdict is Verdict.ALLOW:
            self._declared = str(payload.get("posture", "unknown"))
        ran = response.verdict is Verdict.ALLOW and kind in (
            ActionKind.RUN_COMMAND,
            ActionKind.RUN_EVALUATION,
            ActionKind.WRITE_ARTIFACT,
        )
        return StepReply(
            verdict=response.verdict,
            message=response.message,
            detail=response.detail,
            observation=response.last_observation if ran else None,
            masks=response.masks,
            correction=response.correction,
        )

    def _belief(self, action: str, payload: dict[str, Any]) -> dict[str, Any]:
        posture = self._declared
        if self._kind(action) is ActionKind.DECLARE_POSTURE:
            posture = str(payload.get("posture", posture))
        return {"affordances": {}, "evidence": "none", "posture": posture}

    def _kind(self, action: str) -> ActionKind | None:
        spec = self.profile.actions.get(action)
        return spec.kind if spec is not None else None

    @staticmethod
    def _final(result: ScenarioResult) -> StepReply:
        last = result.trace[-1] if result.trace else None
        if result.outcome is Outcome.TERMINATED and last is not None:
            return StepReply(verdict=last.verdict, message=last.message, result=result)
        return StepReply(
            verdict=last.verdict if last is not None else Verdict.CONTINUE,
            message=result.reason or result.outcome.value,
            result=result,
        )
