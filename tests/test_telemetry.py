"""OpenTelemetry: a run's trace in a real OTLP receiver (Arize Phoenix), read back from it;
nothing imported or sent when telemetry is off; a collector that is down or silent costs a
run a bounded flush, never its outcome; an agent's huge steps are cut on spans, never erase
a run's trace; a mistaken endpoint or variable is one line; the variables' API key goes to
their collector alone."""

from __future__ import annotations

import http.server
import json
import os
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from cmbs_async import CallableAgent, Outcome, ScenarioSpec, Turn, run_scenario
from cmbs_async.audit import SQLiteAuditStore, load_or_create_key
from cmbs_async.demo import demo_agent, demo_scenario
from cmbs_async.telemetry import TEXT_LIMIT, Telemetry, TelemetryError, telemetry_for

from .helpers import CMBS, cmbs, one_line_exit_2, step
from .sshd import free_port

pytestmark = pytest.mark.anyio

_STARTUP = 180.0  # seconds Phoenix may take to start (migrations on a slow machine)
_INGEST = 30.0  # seconds spans may take to show in Phoenix's API once exported


def phoenix_program() -> str:
    """Phoenix's ``phoenix`` program: ``CMBS_PHOENIX`` (its own venv, as CI installs it),
    else one on PATH. Skips without it; CI must have it."""
    program = os.environ.get("CMBS_PHOENIX") or shutil.which("phoenix")
    if program is None or not Path(program).exists():
        if os.environ.get("CI"):
            pytest.fail("CI must have Arize Phoenix (CMBS_PHOENIX, see .ci/run)")
        pytest.skip(
            "needs Arize Phoenix, a real OTLP receiver: pip install arize-phoenix in a venv "
            "of its own and set CMBS_PHOENIX to its bin/phoenix"
        )
    return program


@pytest.fixture(scope="session")
def phoenix(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real Phoenix on free ports of 127.0.0.1, its data in a temporary folder; its base
    URL (OTLP/HTTP on ``/v1/traces``, the REST API on ``/v1``). Stopped (only it) after."""
    program = phoenix_program()
    home = tmp_path_factory.mktemp("phoenix")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "PHOENIX_"))}
    env |= {
        "PHOENIX_WORKING_DIR": str(home),
        "PHOENIX_HOST": "127.0.0.1",
        "PHOENIX_PORT": str(port),
        "PHOENIX_GRPC_PORT": str(free_port()),
        "PHOENIX_TELEMETRY_ENABLED": "false",
        "PHOENIX_ALLOW_EXTERNAL_RESOURCES": "false",
    }
    base = f"http://127.0.0.1:{port}"
    with open(home / "phoenix.log", "wb") as log:
        server = subprocess.Popen(
            [program, "serve"], cwd=home, env=env, stdout=log, stderr=subprocess.STDOUT
        )
    try:
        started = time.monotonic()
        while not _healthy(base):
            if server.poll() is not None or time.monotonic() - started > _STARTUP:
                tail = (home / "phoenix.log").read_text(errors="replace")[-2000:]
                pytest.fail(f"Phoenix did not start (exit {server.poll()}):\n{tail}")
            time.sleep(0.25)
        yield base
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=15)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def _healthy(base: str) -> bool:
    try:
        return httpx.get(f"{base}/healthz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


async def spans_in(base: str, project: str, *, count: int) -> list[dict[str, Any]]:
    """The spans of ``project`` in Phoenix, once there are ``count`` (or what is there
    after :data:`_INGEST` seconds: Phoenix writes what it receives in batches)."""
    spans: list[dict[str, Any]] = []
    async with httpx.AsyncClient(base_url=base, timeout=10) as client:
        with anyio.move_on_after(_INGEST):
            while True:
                spans = []
                cursor: str | None = None
                while True:
                    params: dict[str, Any] = {"limit": 1000} | (
                        {"cursor": cursor} if cursor else {}
                    )
                    reply = await client.get(f"/v1/projects/{project}/spans", params=params)
                    if reply.status_code == 404:  # no span has reached the project yet
                        break
                    reply.raise_for_status()
                    body = reply.json()
                    spans += body["data"]
                    cursor = body.get("next_cursor")
                    if not cursor:
                        break
                if len(spans) >= count:
                    break
                await anyio.sleep(0.2)
    return spans


@pytest.fixture
def project(monkeypatch: pytest.MonkeyPatch) -> str:
    """A Phoenix project of the test's own, named by the standard resource variable."""
    name = f"cmbs-{uuid.uuid4().hex[:12]}"
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", f"openinference.project.name={name}")
    return name


@pytest.fixture
def store(tmp_path: Path) -> Iterator[SQLiteAuditStore]:
    db = SQLiteAuditStore(tmp_path / "audit.db", key=load_or_create_key(tmp_path / "key"))
    yield db
    db.close()


def stored_hashes(path: Path, session_id: str) -> dict[int | None, str]:
    """Each step's last record's hash as the audit database holds it (``None``: the end)."""
    with sqlite3.connect(path) as db:
        rows = db.execute(
            "SELECT step, kind, hash FROM records WHERE session_id = ? ORDER BY seq",
            (session_id,),
        ).fetchall()
    last: dict[int | None, str] = {}
    for number, kind, digest in rows:
        if kind != "session":
            last[number] = digest
    return last


def spec(**fields: object) -> ScenarioSpec:
    base: dict[str, object] = {"id": "otel", "goal": "check it"}
    return ScenarioSpec.model_validate(base | fields)


async def one_step(turn: Turn) -> str | None:
    """Writes a script, then stops: a run of one quick step."""
    if turn.step == 1:
        return step("generate_script", {"path": "a.sh", "content": "echo hi\n"})
    return None


async def test_a_run_is_one_trace_with_a_span_per_step_in_phoenix(
    phoenix: str, project: str, store: SQLiteAuditStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", phoenix)  # the standard variable
    async with Telemetry.from_env() as telemetry:
        assert telemetry.endpoint == f"{phoenix}/v1/traces"
        result = await run_scenario(
            demo_scenario(), agent=demo_agent(), audit=store, telemetry=telemetry
        )
    assert result.outcome is Outcome.TERMINATED and result.session_id is not None
    spans = await spans_in(phoenix, project, count=13)
    assert len(spans) == 13  # the run's and its twelve steps'
    assert len({s["context"]["trace_id"] for s in spans}) == 1
    (root,) = [s for s in spans if s["parent_id"] is None]
    assert root["name"] == "invoke_agent demo-sshd-x11-forwarding"
    attributes = root["attributes"]
    assert attributes["gen_ai.operation.name"] == "invoke_agent"
    assert attributes["gen_ai.conversation.id"] == result.session_id
    assert attributes["cmbs.outcome"] == "terminated"
    assert attributes["cmbs.posture"] == "non_compliant"
    assert attributes["cmbs.steps"] == 12
    assert root["status_code"] != "ERROR"

    steps = sorted(
        (s for s in spans if s["parent_id"] is not None),
        key=lambda s: int(s["attributes"]["gen_ai.tool.call.id"]),
    )
    assert {s["parent_id"] for s in steps} == {root["context"]["span_id"]}
    hashes = stored_hashes(store.path, result.session_id)
    for span, entry in zip(steps, result.trace, strict=True):
        attributes = span["attributes"]
        assert span["name"] == f"execute_tool {entry.action}"
        assert attributes["gen_ai.operation.name"] == "execute_tool"
        assert attributes["gen_ai.tool.name"] == entry.action
        assert attributes["gen_ai.tool.call.id"] == str(entry.step)
        assert attributes["cmbs.verdict"] == entry.verdict.value
        assert attributes["cmbs.message"] == entry.message
        assert entry.masks is not None
        assert json.loads(attributes["cmbs.masks"]) == entry.masks.model_dump(mode="json")
        assert attributes["cmbs.audit.hash"] == hashes[entry.step]
        assert span["status_code"] != "ERROR"  # a step the gate judged, blocked or not
    assert root["attributes"]["cmbs.audit.hash"] == hashes[None]  # the end record

    first, fourth, eleventh = (
        steps[0]["attributes"],
        steps[3]["attributes"],
        steps[10]["attributes"],
    )
    # "compliant" before any evidence: blocked, and the evidence mask says why
    assert (first["cmbs.verdict"], first["cmbs.posture"]) == ("BLOCK", "compliant")
    assert first["cmbs.stopped_by"] == "evidence (none, not successful)"
    assert json.loads(first["cmbs.masks"])["evidence"] == "none"
    assert fourth["process.exit.code"] == 2  # the script's typo
    assert fourth["cmbs.observed"] == "exit 2: cannot read sshd_conf"
    # "non_compliant" once cmbs-opa printed false: allowed
    assert (eleventh["cmbs.verdict"], eleventh["cmbs.posture"]) == ("ALLOW", "non_compliant")


async def test_runs_at_once_are_a_trace_each_and_a_failed_one_is_an_error(
    phoenix: str, project: str
) -> None:
    async def broken(turn: Turn) -> str | None:
        if turn.step == 2:
            raise RuntimeError("the model endpoint went away")
        return await one_step(turn)

    results = {}
    telemetry = telemetry_for(phoenix)  # as ``cmbs run --otel URL`` asks for it
    assert telemetry is not None
    async with telemetry:

        async def run(name: str, agent: CallableAgent) -> None:
            results[name] = await run_scenario(spec(id=name), agent=agent, telemetry=telemetry)

        async with anyio.create_task_group() as tg:
            tg.start_soon(run, "fine", CallableAgent(one_step))
            tg.start_soon(run, "broken", CallableAgent(broken))
    assert results["fine"].outcome is Outcome.AGENT_FINISHED
    assert results["broken"].outcome is Outcome.AGENT_ERROR

    spans = await spans_in(phoenix, project, count=4)
    assert len(spans) == 4
    roots = {s["attributes"]["cmbs.scenario.id"]: s for s in spans if s["parent_id"] is None}
    assert set(roots) == {"fine", "broken"}
    for name, root in roots.items():
        trace = [s for s in spans if s["context"]["trace_id"] == root["context"]["trace_id"]]
        assert [s["name"] for s in trace if s is not root] == ["execute_tool generate_script"]
        assert root["attributes"]["gen_ai.conversation.id"] == results[name].session_id
    assert roots["fine"]["status_code"] != "ERROR"
    assert roots["broken"]["status_code"] == "ERROR"
    assert roots["broken"]["attributes"]["error.type"] == "agent_error"
    assert "went away" in roots["broken"]["status_message"]


async def test_a_run_has_exported_its_spans_when_it_returns() -> None:
    """The batch processor would wait five seconds; the run's end flushes."""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    async with Telemetry(exporter) as telemetry:
        result = await run_scenario(spec(), agent=CallableAgent(one_step), telemetry=telemetry)
        names = [span.name for span in exporter.get_finished_spans()]
    assert names == ["execute_tool generate_script", "invoke_agent otel"]
    assert result.outcome is Outcome.AGENT_FINISHED


@pytest.fixture
def silent_collector() -> Iterator[tuple[str, socket.socket]]:
    """A collector that takes connections and never answers: the worst a collector can do
    (one that is down refuses at once). Its URL and its listening socket."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        yield f"http://127.0.0.1:{listener.getsockname()[1]}", listener


def reached(listener: socket.socket) -> bool:
    """Whether something connected to ``listener`` (the exporter tried to send)."""
    listener.settimeout(5)
    try:
        connection, _ = listener.accept()
    except TimeoutError:
        return False
    connection.close()
    return True


async def test_a_silent_collector_costs_a_run_a_bounded_flush_not_its_outcome(
    silent_collector: tuple[str, socket.socket], monkeypatch: pytest.MonkeyPatch
) -> None:
    url, listener = silent_collector
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "30")  # the exporter would wait 30 s
    telemetry = Telemetry.from_env(url, flush_timeout=0.5)
    result = await run_scenario(spec(), agent=CallableAgent(one_step), telemetry=telemetry)
    assert result.outcome is Outcome.AGENT_FINISHED
    assert result.duration_s < 0.5 + 5  # the flush gave up after 0.5 s (5 s: a loaded machine)
    assert reached(listener)  # it did try
    started = time.monotonic()
    assert telemetry.close(timeout=0.5) is False  # the export still hangs: given up on
    assert time.monotonic() - started < 0.5 + 3


async def test_a_run_past_its_deadline_ends_within_it_and_a_bounded_flush(
    silent_collector: tuple[str, socket.socket], monkeypatch: pytest.MonkeyPatch
) -> None:
    url, listener = silent_collector
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "30")

    async def hang(turn: Turn) -> str | None:
        if turn.step == 1:
            return await one_step(turn)
        await anyio.sleep_forever()
        return None

    telemetry = Telemetry.from_env(url, flush_timeout=0.5)
    started = time.monotonic()
    result = await run_scenario(
        spec(deadline_s=1.0), agent=CallableAgent(hang), telemetry=telemetry
    )
    elapsed = time.monotonic() - started
    assert result.outcome is Outcome.DEADLINE_EXCEEDED
    assert elapsed < 1.0 + 0.5 + 5  # deadline, flush, and room for a loaded machine
    assert reached(listener)
    started = time.monotonic()
    assert await telemetry.aclose(within=0.5) is False
    assert time.monotonic() - started < 0.5 + 3


def test_telemetry_off_imports_and_sends_nothing(tmp_path: Path) -> None:
    """A run without telemetry, with the standard variables pointing at a collector of the
    test's: no OpenTelemetry module is imported, and nothing connects."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        env = os.environ | {
            "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{listener.getsockname()[1]}",
            "OTEL_SERVICE_NAME": "cmbs-test",
        }
        program = (
            "import json, sys, anyio\n"
            "from cmbs_async import run_scenario\n"
            "from cmbs_async.demo import demo_agent, demo_scenario\n"
            "result = anyio.run(lambda: run_scenario(demo_scenario(), agent=demo_agent()))\n"
            "loaded = [m for m in sys.modules if m.split('.')[0] == 'opentelemetry']\n"
            "print(json.dumps([result.outcome.value, loaded]))\n"
        )
        done = subprocess.run(
            [sys.executable, "-c", program],
            capture_output=True,
            text=True,
            env=env,
            cwd=tmp_path,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        outcome, loaded = json.loads(done.stdout)
        assert outcome == "terminated"
        assert loaded == []
        listener.setblocking(False)
        with pytest.raises(BlockingIOError):
            listener.accept()


def endpoint_of(otel: str) -> str | None:
    """Where ``telemetry_for(otel)`` sends spans (it is closed again at once)."""
    telemetry = telemetry_for(otel)
    assert telemetry is not None
    with telemetry:
        return telemetry.endpoint


def test_telemetry_for_the_command_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector.invalid:4318")
    assert telemetry_for(None) is None  # no --otel: off, whatever the environment says
    assert endpoint_of("") == "http://collector.invalid:4318/v1/traces"
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://traces.invalid/v1/traces")
    assert endpoint_of("") == "http://traces.invalid/v1/traces"
    assert endpoint_of("http://127.0.0.1:4318/") == "http://127.0.0.1:4318/v1/traces"
    assert endpoint_of("https://c.invalid/v1/traces") == "https://c.invalid/v1/traces"
    with pytest.raises(TelemetryError, match="http\\(s\\) URL") as refused:
        telemetry_for("localhost:4318")
    assert "\n" not in str(refused.value)
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")  # OpenTelemetry's own switch
    assert telemetry_for("http://127.0.0.1:4318") is None


def test_without_the_extra_telemetry_says_so_in_one_line(tmp_path: Path) -> None:
    """Where OpenTelemetry's SDK cannot be imported, asking for telemetry is one clear
    line (a CmbsError), and runs without it are untouched."""
    blocker = tmp_path / "blocker"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'opentelemetry':\n"
        "            raise ImportError(f'no module named {name!r}')\n"
        "sys.meta_path.insert(0, Block())\n"
    )
    program = (
        "from cmbs_async._errors import CmbsError\n"
        "from cmbs_async.telemetry import telemetry_for\n"
        "try:\n"
        "    telemetry_for('')\n"
        "except CmbsError as exc:\n"
        "    print(exc)\n"
    )
    env = os.environ | {"PYTHONPATH": str(blocker)}
    done = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, env=env, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "OpenTelemetry is not installed: pip install 'cmbs-async[otel]'\n"


@pytest.mark.parametrize("how", ["--otel-endpoint", "--otel"])
async def test_cmbs_run_exports_the_run_it_shows(
    phoenix: str, project: str, tmp_path: Path, how: str
) -> None:
    """``cmbs demo --otel-endpoint URL``, or ``--otel`` with the standard variable: the
    trace in Phoenix is the run the command printed."""
    env = os.environ | {"XDG_DATA_HOME": str(tmp_path / "data")}
    flags = [how, phoenix] if how == "--otel-endpoint" else [how]
    if how == "--otel":
        env["OTEL_EXPORTER_OTLP_ENDPOINT"] = phoenix
    done = await anyio.run_process([*CMBS, "demo", "--json", *flags], env=env, check=False)
    assert done.returncode == 0, done.stderr.decode()
    shown = json.loads(done.stdout)
    spans = await spans_in(phoenix, project, count=13)
    (root,) = [s for s in spans if s["parent_id"] is None]
    assert root["attributes"]["gen_ai.conversation.id"] == shown["session_id"]
    verdicts = sorted(
        (int(s["attributes"]["gen_ai.tool.call.id"]), s["attributes"]["cmbs.verdict"])
        for s in spans
        if s["parent_id"] is not None
    )
    assert verdicts == [(t["step"], t["verdict"]) for t in shown["trace"]]


# --- mistakes of the command line and the variables: one line each -----------------------


NO_URLS = ["http://[::1", "http://localhost:99999", "http://localhost:port", "http://h:0"]


@pytest.mark.parametrize("url", NO_URLS)
def test_cmbs_refuses_an_otel_endpoint_that_is_no_url_in_one_line(url: str) -> None:
    """A broken IPv6 host was a ValueError traceback; a port no URL can have was taken,
    and the run's spans silently went nowhere."""
    done = cmbs("demo", "--no-audit", "--otel-endpoint", url)
    one_line_exit_2(done)
    assert "--otel" in done.stderr


def test_an_endpoint_that_is_no_url_is_refused_even_with_the_sdk_disabled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for url in NO_URLS:
        with pytest.raises(TelemetryError, match="http\\(s\\) URL") as refused:
            telemetry_for(url)
        assert "\n" not in str(refused.value)
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")  # off, but the mistake is still one
    with pytest.raises(TelemetryError, match="Port out of range"):
        telemetry_for("http://localhost:99999")
    assert telemetry_for("") is None  # the variables' endpoint is not read when off
    monkeypatch.delenv("OTEL_SDK_DISABLED")
    # the variables' endpoint, when it is the one used, is checked too, and named
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:port")
    with pytest.raises(TelemetryError, match="^OTEL_EXPORTER_OTLP_ENDPOINT must be"):
        telemetry_for("")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://[::1/v1/traces")
    with pytest.raises(TelemetryError, match="^OTEL_EXPORTER_OTLP_TRACES_ENDPOINT must be"):
        telemetry_for("")
    assert endpoint_of("http://127.0.0.1:4318") == "http://127.0.0.1:4318/v1/traces"


BAD_VARIABLES = [
    "OTEL_BSP_MAX_QUEUE_SIZE=-1",
    "OTEL_BSP_MAX_EXPORT_BATCH_SIZE=0",
    "OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT=abc",
]


@pytest.mark.parametrize("variable", BAD_VARIABLES)
def test_cmbs_refuses_a_bad_opentelemetry_variable_in_one_line(variable: str) -> None:
    """The SDK raised ValueError for these as the tracer provider was made: a traceback."""
    name, _, value = variable.partition("=")
    env = dict(os.environ, **{name: value})
    done = cmbs("demo", "--no-audit", "--otel-endpoint", "http://127.0.0.1:9", env=env)
    one_line_exit_2(done)
    assert name in done.stderr


@pytest.mark.parametrize(
    "variable",
    [
        *BAD_VARIABLES,
        "OTEL_BSP_SCHEDULE_DELAY=soon",  # the SDK logged a traceback and went on
        "OTEL_BSP_EXPORT_TIMEOUT=-5",
        "OTEL_BSP_MAX_EXPORT_BATCH_SIZE=4096",  # more than the queue holds (2048)
        "OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT=-3",
        "OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT=lots",
    ],
)
def test_a_bad_opentelemetry_variable_is_a_telemetry_error_naming_it(
    variable: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    name, _, value = variable.partition("=")
    monkeypatch.setenv(name, value)
    with pytest.raises(TelemetryError, match=name) as refused:
        Telemetry(InMemorySpanExporter())
    assert "\n" not in str(refused.value)
    with pytest.raises(TelemetryError, match=name):
        telemetry_for("http://127.0.0.1:9")


def test_an_empty_batching_variable_is_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    """OpenTelemetry's rule: an empty variable is as good as none."""
    monkeypatch.setenv("OTEL_BSP_MAX_QUEUE_SIZE", "")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", " 100 ")
    assert endpoint_of("http://127.0.0.1:9") == "http://127.0.0.1:9/v1/traces"


# --- an agent's huge steps -----------------------------------------------------------------


def huge_action_agent(size: int, *, then_wait: int | None = None) -> CallableAgent:
    """Steps naming an action no profile has, ``size`` characters long: the gate's detail
    quotes it whole. After ``then_wait`` steps, if given, it waits forever."""
    big = "x" * size

    async def agent(turn: Turn) -> str | None:
        if then_wait is not None and turn.step > then_wait:
            await anyio.sleep_forever()
        return step(big)

    return CallableAgent(agent)


def is_cut(text: str) -> bool:
    return len(text) <= TEXT_LIMIT and text.endswith(" chars]") and "… [cut: " in text


async def test_agent_text_on_a_span_is_cut_saying_so() -> None:
    """Span attributes carried the agent's text whole (``cmbs.detail`` quoting an unknown
    action type: up to the 4 MiB step cap, each step), serialized in the supervisor's
    process."""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    async with Telemetry(exporter) as telemetry:
        result = await run_scenario(
            spec(id="big", max_steps=2), agent=huge_action_agent(1_000_000), telemetry=telemetry
        )
        spans = exporter.get_finished_spans()
    assert result.steps == 2
    longest = max(len(str(value)) for span in spans for value in (span.attributes or {}).values())
    assert longest <= TEXT_LIMIT
    details = [str((span.attributes or {})["cmbs.detail"]) for span in spans[:2]]
    assert all(is_cut(detail) for detail in details), details[0][-100:]
    assert details[0].startswith("action.type")  # what the gate said, as far as it goes


async def test_an_agents_huge_steps_leave_the_runs_trace_in_phoenix(
    phoenix: str, project: str
) -> None:
    """36 steps of 2 MB each (every one under the step cap): the batch of spans was over
    the exporter's 64 MiB request cap, so it was dropped whole, the run's own root span
    with it. The agent erased its trace."""
    async with Telemetry.from_env(phoenix) as telemetry:
        result = await run_scenario(
            spec(id="erase", deadline_s=120, max_steps=36),
            agent=huge_action_agent(2_000_000),
            telemetry=telemetry,
        )
    assert result.steps == 36
    spans = await spans_in(phoenix, project, count=37)
    (root,) = [s for s in spans if s["parent_id"] is None]
    assert root["attributes"]["cmbs.steps"] == 36
    steps = [s for s in spans if s["parent_id"] is not None]
    assert len(steps) == 36
    assert all(is_cut(s["attributes"]["cmbs.detail"]) for s in steps)


async def test_huge_steps_past_the_deadline_end_within_it_and_the_flush(
    phoenix: str, project: str
) -> None:
    """Steps just under the 4 MiB cap until the deadline: the batch thread serialising
    them held the GIL, and a run with a 3 s deadline and the 2 s flush returned after
    12.8 s. Now it ends within both, its trace whole."""
    async with Telemetry.from_env(phoenix) as telemetry:
        assert telemetry.flush_timeout == 2.0  # the default
        started = time.monotonic()
        result = await run_scenario(
            spec(id="late", deadline_s=3.0, max_steps=10_000),
            agent=huge_action_agent(3_900_000, then_wait=40),
            telemetry=telemetry,
        )
        elapsed = time.monotonic() - started
    assert result.outcome is Outcome.DEADLINE_EXCEEDED
    assert result.steps >= 10
    assert elapsed < 3.0 + 2.0 + 2.0  # deadline, flush, and room for a loaded machine
    spans = await spans_in(phoenix, project, count=result.steps + 1)
    (root,) = [s for s in spans if s["parent_id"] is None]
    assert root["attributes"]["cmbs.outcome"] == "deadline_exceeded"


# --- the variables' headers go to their collector alone -------------------------------------


@dataclass
class Collector:
    """An OTLP/HTTP collector that takes every request: its URL, and the headers
    (lower-cased names) and body of each request it took."""

    url: str
    received: list[tuple[dict[str, str], bytes]] = field(default_factory=list)

    def headers(self) -> list[dict[str, str]]:
        return [headers for headers, _ in self.received]


@pytest.fixture
def collector() -> Iterator[Collector]:
    taken: list[tuple[dict[str, str], bytes]] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            taken.append(({k.lower(): v for k, v in self.headers.items()}, body))
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield Collector(f"http://127.0.0.1:{server.server_address[1]}", taken)
    finally:
        server.shutdown()
        server.server_close()


def test_cmbs_sends_the_variables_api_key_only_where_they_say(
    collector: Collector, tmp_path: Path
) -> None:
    """OTEL_EXPORTER_OTLP_HEADERS carries the operator's vendor API key for the collector
    OTEL_EXPORTER_OTLP_ENDPOINT names; ``--otel-endpoint`` elsewhere (plain http, here)
    got the key too."""
    env = dict(
        os.environ,
        XDG_DATA_HOME=str(tmp_path / "data"),
        OTEL_EXPORTER_OTLP_ENDPOINT="https://otlp.vendor.example",
        OTEL_EXPORTER_OTLP_HEADERS="authorization=Bearer%20VENDOR-SECRET,x-team=ops",
    )
    done = cmbs("demo", "--no-audit", "--otel-endpoint", collector.url, env=env)
    assert done.returncode == 0, done.stderr
    assert collector.received, "nothing was exported"
    assert "VENDOR-SECRET" not in json.dumps(collector.headers())
    assert all("x-team" not in headers for headers in collector.headers())
    assert any(b"invoke_agent" in body for _, body in collector.received)


@pytest.mark.parametrize(
    ("variables", "given", "sent"),
    [
        # the variables name this collector, and --otel-endpoint too (path aside)
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "{url}"}, "{url}/v1/traces", True),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "{url}/v1/traces"}, "{url}", True),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "{url}"}, None, True),  # --otel alone
        # another collector: another host (the same machine), scheme, or none named
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "{url}"}, "{local}", False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "https://{host}"}, "{url}", False),
        (
            {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "https://vendor.example/v1/traces"},
            "{url}",
            False,
        ),
        ({}, "{url}", False),  # the variables' collector is http://localhost:4318
    ],
)
async def test_the_variables_headers_go_to_the_collector_they_name_alone(
    collector: Collector,
    monkeypatch: pytest.MonkeyPatch,
    variables: dict[str, str],
    given: str | None,
    sent: bool,
) -> None:
    host = collector.url.removeprefix("http://")
    local = collector.url.replace("127.0.0.1", "localhost")
    for name, value in variables.items():
        monkeypatch.setenv(name, value.format(url=collector.url, host=host))
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "Api-Key=SECRET,user-agent=mine")
    endpoint = None if given is None else given.format(url=collector.url, local=local)
    async with Telemetry.from_env(endpoint) as telemetry:
        result = await run_scenario(spec(), agent=CallableAgent(one_step), telemetry=telemetry)
    assert result.outcome is Outcome.AGENT_FINISHED
    assert collector.received, "nothing was exported"
    for headers in collector.headers():
        assert headers.get("api-key") == ("SECRET" if sent else None)
        if not sent:  # the exporter's own headers stay its own
            assert headers["content-type"] == "application/x-protobuf"


def test_a_span_never_holds_what_utf8_cannot_carry() -> None:
    """A lone surrogate (JSON can carry one) would fail the encoding of the whole batch
    of spans; the gate's parser refuses them today, and a span would not hold one."""
    from cmbs_async.telemetry import _text

    assert _text("a\ud800b") == "a?b"
    assert _text("fine") == "fine"
    assert is_cut(_text("\ud800" * 10_000))
