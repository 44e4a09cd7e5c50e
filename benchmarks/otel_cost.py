"""What telemetry costs a run: off, exporting in process, and over OTLP to a real receiver.

Run: ``python benchmarks/otel_cost.py [--runs N] [--rounds R] [--otlp URL]``. In one
process, side by side and interleaved round by round (so that drift hits all alike), on
asyncio and trio, the same runs

(a) of the demo scenario (twelve steps, real commands in the sandbox: what a user runs),
(b) of a scenario of 200 steps on a no-op executor (the supervisor's own cost per step),

with telemetry off, exporting to OpenTelemetry's in-process ``InMemorySpanExporter`` (the
spans and the run's flush, no network), and exporting over OTLP/HTTP to a receiver: the
collector at ``--otlp URL``, else an Arize Phoenix this script starts on a free port
(``CMBS_PHOENIX`` or ``phoenix`` on PATH), else that column is left out. The order of
the three turns each round. It prints the median milliseconds per run, the ratios to
"off" (the median of the per-round ratios) and, for (b), what a step costs over "off";
then what "off" costs: the one call a run makes (``traced`` with no telemetry) and the
OpenTelemetry modules a run without telemetry loads (none). Every run ends with its
flush: "otlp" includes the wait for the receiver to take the run's spans.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import anyio
import httpx

from cmbs_async import CallableAgent, ScenarioSpec, Turn, run_scenario
from cmbs_async.demo import demo_agent, demo_scenario
from cmbs_async.telemetry import Telemetry, traced
from executors import NullExecutor

STEP = json.dumps(
    {
        "belief": {"affordances": {}, "posture": "unknown", "evidence": "none"},
        "action": {"type": "check_status", "payload": {"command": "true"}},
    }
)


async def _agent(turn: Turn) -> str:
    return STEP


async def demo_run(telemetry: Telemetry | None) -> float:
    start = time.perf_counter()
    result = await run_scenario(demo_scenario(), agent=demo_agent(), telemetry=telemetry)
    assert result.earned, result.outcome
    return time.perf_counter() - start


async def long_run(telemetry: Telemetry | None) -> float:
    spec = ScenarioSpec(id="bench", goal="g", max_steps=200, deadline_s=3600)
    start = time.perf_counter()
    result = await run_scenario(
        spec, agent=CallableAgent(_agent), executor=NullExecutor(), telemetry=telemetry
    )
    assert result.steps == 200, result.outcome
    return time.perf_counter() - start


async def runs(kind: str, telemetry: Telemetry | None, count: int) -> float:
    """Milliseconds per run, over ``count`` runs one after another."""
    run = demo_run if kind == "demo" else long_run
    total = 0.0
    for _ in range(count):
        total += await run(telemetry)
    return total / count * 1000


@contextmanager
def phoenix() -> Iterator[str | None]:
    """A Phoenix on a free port of 127.0.0.1, its base URL; ``None`` where there is none."""
    program = os.environ.get("CMBS_PHOENIX") or shutil.which("phoenix")
    if program is None:
        yield None
        return
    with socket.socket() as a, socket.socket() as b:
        a.bind(("127.0.0.1", 0))
        b.bind(("127.0.0.1", 0))
        port, grpc = a.getsockname()[1], b.getsockname()[1]
    with tempfile.TemporaryDirectory(prefix="cmbs-phoenix-") as home:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "PHOENIX_"))}
        env |= {
            "PHOENIX_WORKING_DIR": home,
            "PHOENIX_HOST": "127.0.0.1",
            "PHOENIX_PORT": str(port),
            "PHOENIX_GRPC_PORT": str(grpc),
            "PHOENIX_TELEMETRY_ENABLED": "false",
        }
        server = subprocess.Popen(
            [program, "serve"],
            cwd=home,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        base = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 180
            while time.monotonic() < deadline and server.poll() is None:
                try:
                    if httpx.get(f"{base}/healthz", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.25)
            else:
                raise SystemExit("Phoenix did not start")
            yield base
        finally:
            server.terminate()
            server.wait(timeout=30)


def off_cost(samples: int) -> float:
    """Nanoseconds a run without telemetry spends on it: one ``traced`` call."""
    trail: Any = object()
    spec = ScenarioSpec(id="bench", goal="g")
    start = time.perf_counter_ns()
    for _ in range(samples):
        traced(trail, None, spec=spec, session_id="s", agent="a", on_step=None)
    return (time.perf_counter_ns() - start) / samples


def loaded_when_off() -> list[str]:
    """The OpenTelemetry modules a process that ran a scenario without telemetry loaded."""
    program = (
        "import json, sys, anyio\n"
        "from cmbs_async import run_scenario\n"
        "from cmbs_async.demo import demo_agent, demo_scenario\n"
        "anyio.run(lambda: run_scenario(demo_scenario(), agent=demo_agent()))\n"
        "print(json.dumps([m for m in sys.modules if m.split('.')[0] == 'opentelemetry']))\n"
    )
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True)
    return list(json.loads(done.stdout))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="runs per case and round")
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--otlp", metavar="URL", help="a collector's base URL (else Phoenix)")
    args = parser.parse_args()
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    kept = InMemorySpanExporter()  # emptied after each measurement: a heap that grows
    # would slow the garbage collector, and every mode with it
    with phoenix() if args.otlp is None else _given(args.otlp) as receiver:
        modes: dict[str, Telemetry | None] = {"off": None, "in-memory": Telemetry(kept)}
        if receiver is not None:
            modes["otlp"] = Telemetry.from_env(receiver)
        where = f" (otlp: {receiver})" if receiver else " (otlp: no receiver, left out)"
        print(f"ms per run, median of {args.rounds} rounds of {args.runs} runs{where}")
        header = "".join(f"{m:>11}" for m in modes)
        ratios = "".join(f"{m + '/off':>15}" for m in modes if m != "off")
        print(f"{'backend':8} {'scenario':22}{header}{ratios}")
        names = list(modes)
        for backend in ("asyncio", "trio"):
            for kind, label in (("demo", "demo (12 steps, bwrap)"), ("long", "200 steps, no-op")):
                ms: dict[str, list[float]] = {mode: [] for mode in modes}
                for round_ in range(args.rounds):  # the order turns each round
                    for mode in names[round_ % len(names) :] + names[: round_ % len(names)]:
                        ms[mode].append(
                            anyio.run(runs, kind, modes[mode], args.runs, backend=backend)
                        )
                        kept.clear()
                medians = "".join(f"{statistics.median(ms[m]):11.2f}" for m in modes)
                ratio = "".join(f"{_ratio(ms['off'], ms[m]):15.3f}" for m in modes if m != "off")
                print(f"{backend:8} {label:22}{medians}{ratio}")
                if kind == "long":
                    extra = ", ".join(
                        f"{m} {_per_step(ms['off'], ms[m]):.0f} us" for m in modes if m != "off"
                    )
                    print(f"{'':8} {'':22}per step over off: {extra}")
        for telemetry in modes.values():
            if telemetry is not None:
                telemetry.close()
    print(
        f"\noff: {off_cost(200_000):.0f} ns per run (one traced() call); "
        f"OpenTelemetry modules a run without telemetry loads: {len(loaded_when_off())}"
    )


@contextmanager
def _given(url: str) -> Iterator[str]:
    yield url


def _ratio(off: list[float], on: list[float]) -> float:
    """The median of the per-round ratios on / off."""
    return statistics.median(b / a for a, b in zip(off, on, strict=True))


def _per_step(off: list[float], on: list[float]) -> float:
    """Microseconds a step of the 200-step run costs more than off (the median of the
    per-round differences)."""
    return statistics.median(b - a for a, b in zip(off, on, strict=True)) / 200 * 1000


if __name__ == "__main__":
    main()
