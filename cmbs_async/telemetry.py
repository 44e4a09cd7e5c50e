"""OpenTelemetry traces of runs: one trace per run, one span per step.

A run given a :class:`Telemetry` opens a root span (GenAI ``invoke_agent``) and, for each
step, a child span that follows the GenAI semantic conventions for tool execution
(``execute_tool {action}``), with what the supervisor knows about the step as ``cmbs.*``
attributes: the gate's verdict and message, the masks after the step, the posture
declared, a command's exit code, and the hash of the audit record the step ended on.

Telemetry is off unless a run is given one. This module imports OpenTelemetry only when
a :class:`Telemetry` is made, so a run without it neither pays for it nor needs it
installed (the ``otel`` extra). A collector that is down or slow never changes a run's
outcome: a run waits at most :attr:`Telemetry.flush_timeout` for its spans to leave.

What the agent or its commands wrote (an action's name, a path, an error) is on a span
cut to :data:`TEXT_LIMIT` characters, saying so: an agent cannot make spans big enough
to cost the supervisor time, or a collector the batch that holds its run's root span.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Any
from urllib.parse import SplitResult, urlsplit, urlunsplit

import anyio

from . import __version__
from ._errors import CmbsError
from ._trail import Trail
from .agents.base import AgentMessage
from .gate import Decision
from .protocol import Containment, Observation, PosturePayload
from .result import Outcome, ScenarioResult, TraceEntry
from .review.layer import SupervisionRecord
from .review.reconcile import Flag
from .scenario import ScenarioSpec

if TYPE_CHECKING:
    import requests
    from opentelemetry.sdk.trace import SpanLimits, TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import Span, Tracer

__all__ = [
    "CLOSE_TIMEOUT",
    "DEFAULT_ENDPOINT",
    "FLUSH_TIMEOUT",
    "MASKS_LIMIT",
    "TEXT_LIMIT",
    "Telemetry",
    "TelemetryError",
    "telemetry_for",
    "traced",
]

#: seconds a run's end waits for its spans to be exported (shielded; then it goes on)
FLUSH_TIMEOUT = 2.0
#: seconds :meth:`Telemetry.close` waits for the last spans to be exported
CLOSE_TIMEOUT = 5.0
#: where an OTLP/HTTP collector listens when nothing says otherwise
DEFAULT_ENDPOINT = "http://localhost:4318"
_TRACES_PATH = "/v1/traces"
#: outcomes that say the run could not be carried out (as ``cmbs batch`` counts errors):
#: the root span's status is ERROR for these alone
_ERRORS = frozenset({Outcome.AGENT_ERROR, Outcome.EXECUTOR_ERROR, Outcome.AUDIT_ERROR})
_MISSING = "OpenTelemetry is not installed: pip install 'cmbs-async[otel]'"
#: characters a span keeps of a text the agent or a command wrote (the gate's message and
#: detail, what a step observed, an action's name...; the audit log has it whole): a
#: longer one is cut, ending ``… [cut: N chars]``. A step's span then holds some 100 KB
#: at most, so the SDK's batch of 512 spans stays under the exporter's 64 MiB request cap
TEXT_LIMIT = 2048
#: characters a span keeps of the masks as JSON (ASCII; the posture history grows with
#: the run); also the SDK's own cap on every attribute unless the environment sets one
MASKS_LIMIT = 8192
#: room :func:`_text` keeps for its ``… [cut: N chars]``
_MARK = 40
#: the variables that set the SDK's cap on an attribute's length
_LENGTH_VARIABLES = ("OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT", "OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT")
#: the batch span processor's variables, and the parameters they set
_BATCHING = {
    "OTEL_BSP_MAX_QUEUE_SIZE": "max_queue_size",
    "OTEL_BSP_SCHEDULE_DELAY": "schedule_delay_millis",
    "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "max_export_batch_size",
    "OTEL_BSP_EXPORT_TIMEOUT": "export_timeout_millis",
}
#: headers the exporter sets itself: never withheld
_OWN_HEADERS = frozenset({"content-type", "content-encoding", "content-length", "user-agent"})


class TelemetryError(CmbsError, RuntimeError):
    """Telemetry cannot be set up (the ``otel`` extra is missing, an endpoint is not a
    URL, an ``OTEL_*`` variable has a value OpenTelemetry refuses); the message is one
    line."""


class Telemetry:
    """Where runs send their traces: a tracer provider of its own (the process's global
    one is left alone) whose batch processor exports spans to ``exporter`` from a
    background thread.

    Give it to any number of runs (``RunConfig(telemetry=...)``), at once if need be.
    Each run flushes its spans as it ends, waiting at most ``flush_timeout`` seconds
    (shielded): a collector that is down or slow costs a run that long and never its
    outcome. :meth:`close` (or leaving ``with``; :meth:`aclose` and ``async with`` on an
    event loop) exports what is left and stops.
    Most callers want :meth:`from_env`; an exporter of one's own (OpenTelemetry's
    ``InMemorySpanExporter``, say) goes here.

    The SDK's variables apply (``OTEL_BSP_*``, ``OTEL_*_LIMIT``, ``OTEL_SERVICE_NAME``...);
    :class:`TelemetryError`, naming the variable, for a value it refuses. Attributes are
    capped at :data:`MASKS_LIMIT` characters unless a variable sets the SDK's cap.
    """

    def __init__(
        self,
        exporter: SpanExporter,
        *,
        flush_timeout: float = FLUSH_TIMEOUT,
        endpoint: str | None = None,
    ) -> None:
        try:
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
        except ImportError as exc:
            raise TelemetryError(_MISSING) from exc

        batching = _batching()  # the OTEL_BSP_* variables, checked
        try:
            # OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES, as the SDK reads them; "cmbs"
            # where neither names the service
            resource = Resource.create()
            if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
                resource = resource.merge(Resource({"service.name": "cmbs"}))
            provider = TracerProvider(
                resource=resource, span_limits=_span_limits(), shutdown_on_exit=False
            )
            processor = BatchSpanProcessor(
                exporter,
                max_queue_size=batching.get("max_queue_size"),
                schedule_delay_millis=batching.get("schedule_delay_millis"),
                max_export_batch_size=batching.get("max_export_batch_size"),
                export_timeout_millis=batching.get("export_timeout_millis"),
            )
        except ValueError as exc:  # a variable's value the SDK refuses
            message = str(exc)
            for variable, parameter in _BATCHING.items():
                message = message.replace(parameter, variable)
            raise TelemetryError(_line(f"OpenTelemetry's settings: {message}")) from None
        self._provider: TracerProvider = provider
        self._provider.add_span_processor(processor)
        self.tracer: Tracer = self._provider.get_tracer("cmbs_async", __version__)
        #: seconds a run's end waits for its spans to be exported
        self.flush_timeout = flush_timeout
        #: where the spans go, for a person to read (``None``: an exporter's own business)
        self.endpoint = endpoint
        self._closed = False

    @classmethod
    def from_env(
        cls, endpoint: str | None = None, *, flush_timeout: float = FLUSH_TIMEOUT
    ) -> Telemetry:
        """Export over OTLP/HTTP (protobuf) to ``endpoint``, a collector's base URL
        (``http://localhost:4318``; ``/v1/traces`` is added unless it is there), or,
        without one, where the standard variables say: ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``
        as it is, else ``OTEL_EXPORTER_OTLP_ENDPOINT`` plus ``/v1/traces``, else
        :data:`DEFAULT_ENDPOINT`. Headers (``OTEL_EXPORTER_OTLP_HEADERS``, ``..._TRACES_HEADERS``),
        the export timeout, compression and certificates come from the variables too, and
        the service name from ``OTEL_SERVICE_NAME`` (``cmbs`` by default).

        The variables' headers (an API key, often) and credential provider are for the
        collector the variables name: an ``endpoint`` elsewhere (another scheme, host or
        port) is sent neither. :class:`TelemetryError` if ``endpoint``, or the variables'
        endpoint where there is none, is not an http(s) URL with a host."""
        env = _env_traces_url()
        if endpoint is None:  # checked: spans must go somewhere
            for variable in (_TRACES_VARIABLE, _ENDPOINT_VARIABLE):
                if value := os.environ.get(variable, "").strip():
                    _traces_url(value, named=variable)
                    break
        else:
            endpoint = _traces_url(endpoint)
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError as exc:
            raise TelemetryError(_MISSING) from exc
        # the variables' credentials stay with the variables' collector
        session = None if endpoint is None or _same_origin(endpoint, env) else _withholding()
        try:
            exporter = OTLPSpanExporter(endpoint=endpoint, session=session)
        except (ValueError, RuntimeError) as exc:  # a credential provider not found...
            raise TelemetryError(_line(f"OpenTelemetry's OTLP exporter: {exc}")) from None
        return cls(exporter, flush_timeout=flush_timeout, endpoint=endpoint or env)

    async def flush(self) -> bool:
        """Export the spans ended so far, waiting at most :attr:`flush_timeout` seconds
        (shielded from cancellation); whether the export finished in that time. The SDK's
        flush cannot be interrupted, so it runs in a daemon thread left to finish alone:
        nothing waits for it, not even the interpreter's exit."""
        if self._closed:
            return False
        flushing = threading.Thread(
            target=self._provider.force_flush, name="cmbs-otel-flush", daemon=True
        )
        flushing.start()
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(flushing.join, self.flush_timeout)
        return not flushing.is_alive()

    def close(self, timeout: float = CLOSE_TIMEOUT) -> bool:
        """Export what is left and stop, blocking at most ``timeout`` seconds; whether it
        finished in time (spans a collector did not take by then are dropped)."""
        if self._closed:
            return True
        self._closed = True
        closing = threading.Thread(
            target=self._provider.shutdown, name="cmbs-otel-close", daemon=True
        )
        closing.start()
        closing.join(timeout)
        return not closing.is_alive()

    async def aclose(self, within: float = CLOSE_TIMEOUT) -> bool:
        """:meth:`close` (blocking at most ``within`` seconds) in a worker thread,
        shielded, for code on an event loop."""
        with anyio.CancelScope(shield=True):
            closed = await anyio.to_thread.run_sync(self.close, within)
        return closed

    def __enter__(self) -> Telemetry:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    async def __aenter__(self) -> Telemetry:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return f"Telemetry(endpoint={self.endpoint!r})"


def telemetry_for(otel: str | None) -> Telemetry | None:
    """The telemetry ``cmbs --otel`` asks for: ``None`` (the flag is absent: off, whatever
    the environment says), ``""`` (the flag alone: where the ``OTEL_EXPORTER_OTLP_*``
    variables say, else :data:`DEFAULT_ENDPOINT`) or a collector's URL. Off too where
    ``OTEL_SDK_DISABLED`` is ``true``, OpenTelemetry's own switch.
    :class:`TelemetryError` if the ``otel`` extra is missing or the URL is not one (said
    even where ``OTEL_SDK_DISABLED`` turns telemetry off)."""
    if otel is None:
        return None
    if otel:
        _traces_url(otel)  # a mistake on the command line is one, whatever the variables
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    return Telemetry.from_env(otel or None)


def traced(
    trail: Trail,
    telemetry: Telemetry | None,
    *,
    spec: ScenarioSpec,
    session_id: str,
    agent: str,
    on_step: Callable[[TraceEntry], None] | None,
) -> tuple[Trail, Callable[[TraceEntry], None] | None]:
    """The trail and the ``on_step`` a run uses: as they are without telemetry; with it,
    wrapped to trace the run. The trail opens the run's span and each step's, filling
    them in as the step is recorded, judged and executed; ``on_step`` ends the step's
    span once the step is concluded (with the masks after it, and the audit record it
    ended on), then calls the run's own ``on_step``."""
    if telemetry is None:
        return trail, on_step
    run = _Traced(trail, telemetry, spec=spec, session_id=session_id, agent=agent, on_step=on_step)
    return run, run.concluded


class _Traced:
    """A run's trail that also traces the run; the run's end exports its spans."""

    def __init__(
        self,
        trail: Trail,
        telemetry: Telemetry,
        *,
        spec: ScenarioSpec,
        session_id: str,
        agent: str,
        on_step: Callable[[TraceEntry], None] | None,
    ) -> None:
        from opentelemetry.trace import SpanKind, set_span_in_context

        self._trail = trail
        self._telemetry = telemetry
        self._on_step = on_step
        self._root: Span = telemetry.tracer.start_span(
            _text(f"invoke_agent {spec.id}"),
            kind=SpanKind.INTERNAL,
            attributes={
                "gen_ai.operation.name": "invoke_agent",
                "gen_ai.agent.name": _text(agent),
                "gen_ai.conversation.id": session_id,
                "cmbs.scenario.id": _text(spec.id),
                "cmbs.session.id": session_id,
                "cmbs.profile": _text(spec.profile),
            },
        )
        self._parent = set_span_in_context(self._root)
        self._internal = SpanKind.INTERNAL
        self._steps: dict[int, _Step] = {}  # open: recorded, not yet concluded

    @property
    def stalled(self) -> bool:
        return self._trail.stalled

    @property
    def head(self) -> str | None:
        return self._trail.head

    async def begin(self, containment: Containment | None) -> None:
        await self._trail.begin(containment)
        if containment is not None:
            self._root.set_attribute("cmbs.sandbox", _text(containment.sandbox))

    async def step(self, number: int, message: AgentMessage, flags: tuple[Flag, ...]) -> None:
        attributes: dict[str, Any] = {
            "gen_ai.operation.name": "execute_tool",
            "gen_ai.tool.call.id": str(number),
            "gen_ai.tool.type": "function",
            "cmbs.step": number,
        }
        if flags:
            attributes["cmbs.review.flags"] = [_text(flag.trigger) for flag in flags[:64]]
        span = self._telemetry.tracer.start_span(
            "execute_tool", context=self._parent, kind=self._internal, attributes=attributes
        )
        self._steps[number] = _Step(span)
        await self._trail.step(number, message, flags)

    async def supervision(self, number: int, supervision: SupervisionRecord) -> None:
        await self._trail.supervision(number, supervision)
        step = self._steps.get(number)
        if step is not None:
            step.attributes["cmbs.review.verdict"] = _text(supervision.verdict.value)
            step.attributes["cmbs.review.action"] = _text(supervision.action.value)

    async def decision(self, decision: Decision) -> None:
        await self._trail.decision(decision)
        step = self._steps.get(decision.step_number)
        if step is None:
            return
        attributes = step.attributes
        action = decision.action_type
        if action is not None:
            action = _text(action)
            step.span.update_name(f"execute_tool {action}")
            attributes["gen_ai.tool.name"] = action
        if decision.spec is not None and decision.spec.description:
            attributes["gen_ai.tool.description"] = _text(decision.spec.description)
        attributes["cmbs.verdict"] = decision.verdict.value
        attributes["cmbs.message"] = _text(decision.message)
        if decision.detail is not None:
            attributes["cmbs.detail"] = _text(decision.detail)
        if isinstance(decision.payload, PosturePayload):
            attributes["cmbs.posture"] = _text(decision.payload.posture)
        step.running = decision.needs_execution

    async def observation(self, number: int, observation: Observation) -> None:
        await self._trail.observation(number, observation)
        step = self._steps.get(number)
        if step is None:
            return
        step.running = False
        step.attributes["cmbs.observed"] = _text(observation.summary())
        if observation.kind == "command" and observation.exit_status is not None:
            step.attributes["process.exit.code"] = observation.exit_status

    async def evidence(self, number: int, chain: dict[str, Any]) -> None:
        await self._trail.evidence(number, chain)

    def concluded(self, entry: TraceEntry) -> None:
        """End the step's span: the trace line is made, every record of the step durable."""
        step = self._steps.pop(entry.step, None)
        if step is not None:
            attributes = step.attributes
            attributes["cmbs.verdict"] = entry.verdict.value
            if entry.masks is not None:
                attributes["cmbs.masks"] = _text(entry.masks.model_dump_json(), MASKS_LIMIT)
            if entry.stopped_by is not None:
                attributes["cmbs.stopped_by"] = _text(entry.stopped_by)
            if entry.refused is not None:
                attributes["cmbs.refused"] = _text(entry.refused)
            if step.running and entry.observed is not None:  # killed as it ran
                attributes["cmbs.observed"] = _text(entry.observed)
            self._end(step.span, attributes)
        if self._on_step is not None:
            self._on_step(entry)

    async def end(self, result: ScenarioResult, *, until: float) -> None:
        await self._trail.end(result, until=until)
        error = result.outcome.value if result.outcome in _ERRORS else None
        for step in self._steps.values():  # steps the run ended in (an executor failed...)
            self._end(step.span, step.attributes, error=error)
        self._steps.clear()
        attributes: dict[str, Any] = {
            "cmbs.outcome": result.outcome.value,
            "cmbs.steps": result.steps,
            "cmbs.masks": _text(result.masks.model_dump_json(), MASKS_LIMIT),
        }
        for verdict, count in result.verdicts.items():
            attributes[f"cmbs.verdicts.{verdict}"] = count
        reason = None if result.reason is None else _text(result.reason)
        if result.posture is not None:
            attributes["cmbs.posture"] = _text(result.posture)
        if reason is not None:
            attributes["cmbs.reason"] = reason
        self._end(self._root, attributes, error=error, reason=reason)
        await self._telemetry.flush()

    def _end(
        self,
        span: Span,
        attributes: dict[str, Any],
        *,
        error: str | None = None,
        reason: str | None = None,
    ) -> None:
        """End ``span`` with ``attributes`` and the hash of the audit record the trail
        ends on so far; with status ERROR (``error.type``: the outcome) for an ``error``."""
        head = self._trail.head
        if head is not None:
            attributes["cmbs.audit.hash"] = head
        if error is not None:
            from opentelemetry.trace import Status, StatusCode

            attributes["error.type"] = error
            span.set_status(Status(StatusCode.ERROR, reason))
        span.set_attributes(attributes)
        span.end()


@dataclass(slots=True)
class _Step:
    """A step's span while it is open, and the attributes it is given as it ends (all at
    once: setting each takes the span's lock)."""

    span: Span
    attributes: dict[str, Any] = field(default_factory=dict)
    running: bool = False  # allowed to run, nothing observed yet


def _text(text: str, limit: int = TEXT_LIMIT) -> str:
    """``text`` as a span holds it: cut to ``limit`` characters, ending with how many were
    cut (a slice: the whole text is never copied), and lone surrogates (which JSON can
    carry and UTF-8 cannot: the exporter would drop the whole batch) as ``?``."""
    if len(text) > limit:
        keep = limit - _MARK
        text = f"{text[:keep]}… [cut: {len(text) - keep} chars]"
    try:
        text.encode()
    except UnicodeEncodeError:
        text = text.encode(errors="replace").decode()
    return text


def _line(message: str) -> str:
    """``message`` on one line, not too long to read."""
    return _text(" ".join(message.split()), 500)


def _span_limits() -> SpanLimits:
    """The SDK's limits as the variables set them, and, where none caps an attribute's
    length, :data:`MASKS_LIMIT` (a backstop: :func:`_text` cuts what the agent wrote)."""
    from opentelemetry.sdk.trace import SpanLimits

    if any(variable in os.environ for variable in _LENGTH_VARIABLES):
        return SpanLimits()
    return SpanLimits(max_span_attribute_length=MASKS_LIMIT)


def _batching() -> dict[str, int]:
    """The batch span processor's parameters the ``OTEL_BSP_*`` variables set. The SDK
    logs a traceback and goes on for a value that is not a number, and refuses one out
    of range naming its parameter; here either is a :class:`TelemetryError` naming the
    variable."""
    settings: dict[str, int] = {}
    for variable, parameter in _BATCHING.items():
        value = os.environ.get(variable, "").strip()
        if not value:  # OpenTelemetry's rule: empty is unset
            continue
        try:
            number = int(value)
        except ValueError:
            number = -1
        least = 0 if parameter == "export_timeout_millis" else 1
        if number < least:
            kind = "a whole number of milliseconds" if "millis" in parameter else "a whole number"
            raise TelemetryError(
                _line(f"{variable} must be {kind} from {least} up, not {_text(value, 100)!r}")
            )
        settings[parameter] = number
    return settings


_ENDPOINT_VARIABLE = "OTEL_EXPORTER_OTLP_ENDPOINT"
_TRACES_VARIABLE = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"


def _traces_url(endpoint: str, *, named: str | None = None) -> str:
    """A collector's base URL as the URL its traces go to (``/v1/traces`` added to its
    path); :class:`TelemetryError` unless it is an http(s) URL with a host and, if it
    names one, a port from 1 to 65535 (the variable ``named`` gave it, if one did)."""
    url = endpoint.strip()
    problem: str | None = None
    parts: SplitResult | None = None
    if any(not c.isprintable() or c.isspace() for c in url):
        problem = "it holds spaces or control characters"
    else:
        try:
            parts = urlsplit(url)
            if parts.port == 0:  # urlsplit takes it; nothing listens there
                problem = "port 0"
        except ValueError as exc:  # "Invalid IPv6 URL", "Port out of range 0-65535"...
            problem = str(exc)
    if problem is None and parts is not None and parts.scheme in ("http", "https"):
        if parts.hostname:
            path = parts.path.rstrip("/")
            if not path.endswith(_TRACES_PATH):
                path += _TRACES_PATH
            return urlunsplit(parts._replace(path=path))
    what = f"{named} must be" if named else "an OTLP endpoint is"
    said = f" ({problem})" if problem else ""
    raise TelemetryError(
        _line(
            f"{what} an http(s) URL such as {DEFAULT_ENDPOINT}, not {_text(endpoint, 200)!r}{said}"
        )
    )


def _env_traces_url() -> str:
    """Where OpenTelemetry's exporter sends traces by the standard variables."""
    traces = os.environ.get(_TRACES_VARIABLE, "").strip()
    if traces:
        return traces
    base = os.environ.get(_ENDPOINT_VARIABLE, "").strip() or DEFAULT_ENDPOINT
    return base.rstrip("/") + _TRACES_PATH


def _origin(url: str) -> tuple[str, str, int] | None:
    """``url``'s scheme, host and port (the scheme's own if it names none), or ``None``
    where it is no http(s) URL with a host."""
    try:
        parts = urlsplit(url.strip())
        port = parts.port
    except ValueError:
        return None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return None
    default = 443 if parts.scheme == "https" else 80
    return parts.scheme, parts.hostname, default if port is None else port


def _same_origin(url: str, other: str) -> bool:
    """Whether both URLs name one collector: the same scheme, host and port."""
    origin = _origin(url)
    return origin is not None and origin == _origin(other)


def _withholding() -> requests.Session:
    """A session for an exporter sending elsewhere than the variables say: it sends
    none of the headers the variables add (``OTEL_EXPORTER_OTLP_TRACES_HEADERS``, else
    ``OTEL_EXPORTER_OTLP_HEADERS``), the exporter's own protocol headers apart. Being
    the exporter's session, it also stands in for a credential provider's (the
    ``OTEL_PYTHON_EXPORTER_OTLP_*_CREDENTIAL_PROVIDER`` variables) and its credentials.
    It takes the headers off each request as it is sent, redirects' included."""
    import requests
    from opentelemetry.util.re import parse_env_headers

    given = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_HEADERS") or os.environ.get(
        "OTEL_EXPORTER_OTLP_HEADERS", ""
    )
    withheld = (
        frozenset(name.strip().lower() for name in parse_env_headers(given, liberal=True))
        - _OWN_HEADERS
    )

    class Withholding(requests.Session):
        def send(self, request: requests.PreparedRequest, **kwargs: Any) -> requests.Response:
            for name in withheld:
                request.headers.pop(name, None)  # case-insensitive, as headers are
            return super().send(request, **kwargs)

    return Withholding()
