"""The profile's actions as async functions with real signatures, for frameworks that
describe a tool by inspecting its function."""

from __future__ import annotations

import inspect
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from ..protocol import PAYLOAD_MODELS, Verdict
from ..session import Session, SessionEnded, StepReply

__all__ = ["ActionTool", "action_tools", "answer"]


@dataclass(frozen=True)
class ActionTool:
    """One action as a tool: its name, its description and the function to call."""

    name: str
    description: str
    function: Callable[..., Awaitable[str]]


def action_tools(
    session: Session, render: Callable[[StepReply], str] | None = None
) -> list[ActionTool]:
    """Every action of ``session``'s profile as a tool; ``render`` turns the supervisor's
    reply into what the framework hands the model, or raises the framework's error for a
    refusal (by default :func:`answer`, which says everything as JSON)."""
    return [
        ActionTool(name, spec.description, _function(session, name, render or answer))
        for name, spec in sorted(session.profile.actions.items())
    ]


def _parameters(session: Session, name: str) -> list[inspect.Parameter]:
    """An action's payload fields as keyword-only parameters (an evaluation's: the values
    its evaluator takes, each a string)."""
    spec = session.profile.actions[name]
    if spec.evaluator is not None:
        schema = session.profile.evaluators[spec.evaluator].payload_schema()
        return [
            inspect.Parameter(
                key,
                inspect.Parameter.KEYWORD_ONLY,
                annotation=str if key in schema["required"] else str | None,
                default=inspect.Parameter.empty if key in schema["required"] else None,
            )
            for key in schema["properties"]
        ]
    return [
        inspect.Parameter(
            field,
            inspect.Parameter.KEYWORD_ONLY,
            annotation=info.annotation,
            default=inspect.Parameter.empty if info.is_required() else info.default,
        )
        for field, info in PAYLOAD_MODELS[spec.kind].model_fields.items()
    ]


def _function(
    session: Session, name: str, render: Callable[[StepReply], str]
) -> Callable[..., Awaitable[str]]:
    async def call(**payload: Any) -> str:
        payload = {key: value for key, value in payload.items() if value is not None}
        try:
            reply = await session.step(name, payload)
        except SessionEnded as exc:  # refused like any step: the model is told why
            reply = StepReply(verdict=Verdict.BLOCK, message=str(exc), result=exc.result)
        return render(reply)

    parameters = _parameters(session, name)
    call.__name__ = name
    call.__doc__ = session.profile.actions[name].description
    call.__annotations__ = {p.name: p.annotation for p in parameters} | {"return": str}
    call.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        parameters, return_annotation=str
    )
    return call


def answer(reply: StepReply) -> str:
    """The reply as the model sees it: the verdict, the neutral message, what running the
    action observed, and the outcome once the session has ended."""
    said: dict[str, Any] = {"verdict": reply.verdict.value, "message": reply.message}
    if reply.detail:
        said["detail"] = reply.detail
    if reply.observation is not None:
        said["observation"] = reply.observation.model_dump(
            mode="json", include={"success", "exit_status", "error", "stdout", "stderr", "path"}
        )
    if reply.result is not None:
        said["outcome"] = reply.result.outcome.value
    return json.dumps(said)
