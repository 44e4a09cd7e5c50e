"""A handle on a run: cancel it from elsewhere, and read how it ended, even when it was
cancelled."""

from __future__ import annotations

import anyio

from .result import ScenarioResult

__all__ = ["RunHandle"]


class RunHandle:
    """Passed to :func:`run_scenario` as ``handle=``; one run per handle.

    :meth:`cancel` stops the run as a signal would: what runs is killed, the step in
    flight is traced as killed, the end is recorded (``cancelled``) and
    ``scenario.finished`` is logged, and ``run_scenario`` then *returns* that result.
    A cancellation from an enclosing scope still propagates out of ``run_scenario``, as
    anyio's cancellation always does; the handle holds the result all the same.

    ::

        handle = RunHandle()
        async with anyio.create_task_group() as tg:
            tg.start_soon(partial(run_scenario, spec, agent=agent, handle=handle))
            ...
            handle.cancel()
        print(handle.result.outcome)  # Outcome.CANCELLED, with its partial trace
    """

    def __init__(self) -> None:
        self._scope: anyio.CancelScope | None = None
        self._cancelled = False
        self._result: ScenarioResult | None = None
        self._done: anyio.Event | None = None

    @property
    def result(self) -> ScenarioResult | None:
        """How the run ended; ``None`` until it has."""
        return self._result

    @property
    def cancel_called(self) -> bool:
        return self._cancelled

    def cancel(self) -> None:
        """Stop the run (now, or as soon as it starts); the run still records its end."""
        self._cancelled = True
        if self._scope is not None:
            self._scope.cancel()

    async def wait(self) -> ScenarioResult:
        """Wait until the run has ended, however it ended, and return its result."""
        if self._result is None:
            if self._done is None:
                self._done = anyio.Event()
            await self._done.wait()
        assert self._result is not None
        return self._result

    def attach(self, scope: anyio.CancelScope) -> None:
        """Called by the run it is given to, with the scope :meth:`cancel` cancels."""
        if self._scope is not None:
            raise RuntimeError("a RunHandle serves one run")
        self._scope = scope
        if self._cancelled:
            scope.cancel()

    def finished(self, result: ScenarioResult) -> None:
        """Called by the run when it has ended, before any cancellation propagates."""
        self._result = result
        if self._done is not None:
            self._done.set()
