"""The batch runner: every run exactly one result, resumable after a kill, summarized."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import anyio
import pytest

from cmbs_async import Agent, CallableAgent, ScenarioSpec, Turn
from cmbs_async.audit import load_or_create_key
from cmbs_async.batch import (
    BatchError,
    Job,
    ResultLog,
    error_record,
    plan,
    render_summary,
    run_batch,
    summarize,
)
from cmbs_async.demo import demo_agent, demo_scenario
from cmbs_async.profile import load_profile
from executors import LocalExecutor

from .helpers import CMBS, EVALUATE, evaluated_files, step

DEMO_STEPS = [str(m) for m in demo_agent().messages]
CISO = load_profile("ciso")


def agents(kind: str) -> Callable[[], Agent]:
    async def raises(turn: Turn) -> str:
        raise RuntimeError("model crashed")

    async def hangs(turn: Turn) -> str:
        await anyio.sleep_forever()
        raise AssertionError

    if kind == "raise":
        return lambda: CallableAgent(raises)
    if kind == "hang":
        return lambda: CallableAgent(hangs)
    return demo_agent


@pytest.mark.anyio
async def test_two_hundred_runs_fifty_at_a_time_each_get_one_result(tmp_path: Path) -> None:
    # hanging agents meet a short deadline; the others have time to spare on a busy machine
    deadlines = {"solve": 60.0, "raise": 60.0, "hang": 1.0}
    jobs = [
        Job(
            scenario_file="demo.yaml",
            spec=demo_scenario().model_copy(update={"deadline_s": deadlines[kind]}),
            agent=kind,
            repeat=r,
        )
        for kind in ("solve", "raise", "hang")
        for r in range({"solve": 100, "raise": 50, "hang": 50}[kind])
    ]
    log = ResultLog(tmp_path / "out.jsonl", resume=False)
    started = time.monotonic()
    with anyio.fail_after(60):
        async with LocalExecutor() as executor:
            report = await run_batch(
                jobs, agents=agents, executor=executor, concurrency=50, log=log
            )
    log.close()
    assert time.monotonic() - started < 50
    lines = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert len(lines) == 200 and len({r["key"] for r in lines}) == 200
    outcomes = Counter((r["agent"], r["outcome"]) for r in lines)
    assert outcomes == {
        ("solve", "terminated"): 100,
        ("raise", "agent_error"): 50,
        ("hang", "deadline_exceeded"): 50,
    }
    assert report.records == lines
    hung = [r["duration_s"] for r in lines if r["agent"] == "hang"]
    # each ended at its own deadline, long before the others' 60 s (a loaded machine may be
    # slow to tidy up fifty sandboxes at once)
    assert all(1.0 <= d < 30 for d in hung)
    rows = {row["agent"]: row for row in summarize(lines, profiles={"demo.yaml": CISO})}
    assert rows["solve"]["earned"] == 100 and rows["solve"]["blocked_posture_claims"] == 100
    assert "agent_error 50" in render_summary(list(rows.values()))


def _batch_files(tmp_path: Path, count: int) -> tuple[Path, Path]:
    folder = tmp_path / "scenarios"
    folder.mkdir()
    for i in range(count):
        spec = {"id": f"slow-{i}", "goal": "g", "deadline_s": 30, "files": evaluated_files("no")}
        (folder / f"s{i:02}.yaml").write_text(json.dumps(spec))
    steps = tmp_path / "steps.jsonl"
    steps.write_text(
        step("check_status", {"command": "sleep 0.3"})
        + "\n"
        + step("execute_opa", {"command": EVALUATE})
        + "\n"
        + step(
            "declare_posture", {"posture": "compliant"}, posture="compliant", evidence="successful"
        )
        + "\n"
        + step("terminate", posture="compliant", evidence="successful")
        + "\n"
    )
    return folder, steps


def cmbs_batch(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CMBS, "batch", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_resume_after_sigkill_runs_only_what_is_missing(tmp_path: Path) -> None:
    folder, steps = _batch_files(tmp_path, 20)
    out = tmp_path / "results.jsonl"
    batch = [str(folder), "--agent", f"script:{steps}", "--repeat", "2", "--out", str(out)]
    process = subprocess.Popen(
        [*CMBS, "batch", *batch, "--concurrency", "4"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while not out.exists() or len(out.read_text().splitlines()) < 12:
            assert process.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        os.kill(process.pid, signal.SIGKILL)
        process.wait()
    before = out.read_text().splitlines(keepends=True)
    complete = [line.rstrip("\n") for line in before if line.endswith("\n")]
    assert 12 <= len(complete) < 40
    again = cmbs_batch(*batch, "--concurrency", "8", "--resume")
    assert again.returncode == 0, again.stderr
    after = [json.loads(line) for line in out.read_text().splitlines()]
    keys = [r["key"] for r in after]
    assert len(keys) == 40 and len(set(keys)) == 40  # nothing run twice, nothing missing
    assert [json.dumps(r) for r in after[: len(complete)]] == complete  # nothing lost
    assert all(r["outcome"] == "terminated" for r in after)
    assert f"({len(complete)} from before)" in again.stdout
    assert "40 of 40 runs have results" in again.stdout


def test_a_cut_off_last_line_is_dropped_on_resume(tmp_path: Path) -> None:
    out, key = tmp_path / "r.jsonl", load_or_create_key(tmp_path / "key")
    spec = demo_scenario()
    first, second = (Job("demo.yaml", spec, "solve", r) for r in (0, 1))
    log = ResultLog(out, resume=False, key=key)
    log.append(error_record(first, "x", 0.0, 1.0))
    log.close()
    whole = out.read_text()
    out.write_text(whole + '{"key": "c|d|0", "outc')  # killed mid-write
    log = ResultLog(out, resume=True, key=key)
    assert log.done == {first.key}
    assert out.read_text() == whole + '{"key": "c|d|0", "outc'  # untouched until a write
    log.append(error_record(second, "y", 0.0, 1.0))
    log.close()
    lines = out.read_text().splitlines()
    assert lines[0] == whole.strip() and json.loads(lines[1])["key"] == second.key
    assert len(lines) == 2
    with pytest.raises(BatchError, match="pass --resume"):
        ResultLog(out, resume=False)


def test_sigint_stops_cleanly_and_keeps_results(tmp_path: Path) -> None:
    folder, steps = _batch_files(tmp_path, 20)
    out = tmp_path / "results.jsonl"
    process = subprocess.Popen(
        [
            *CMBS,
            "batch",
            str(folder),
            "--agent",
            f"script:{steps}",
            "--concurrency",
            "4",
            "--out",
            str(out),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 60
    while not out.exists() or len(out.read_text().splitlines()) < 4:
        assert process.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    process.send_signal(signal.SIGINT)
    stdout, stderr = process.communicate(timeout=30)
    assert process.returncode == 130
    assert "--resume" in stderr
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert all(r["outcome"] == "terminated" for r in lines) and 4 <= len(lines) < 20


def test_planning_errors_are_one_line(tmp_path: Path) -> None:
    done = cmbs_batch(str(tmp_path / "nothing-here"), "--agent", "script:x")
    assert done.returncode == 2 and "no scenario files at" in done.stderr
    (tmp_path / "bad.yaml").write_text("id: x\n")
    done = cmbs_batch(str(tmp_path), "--agent", "script:x")
    assert done.returncode == 2 and "goal: Field required" in done.stderr
    with pytest.raises(BatchError, match="--repeat"):
        plan([str(tmp_path)], ["script:x"], 0)


def test_jobs_cover_scenarios_agents_and_repeats(tmp_path: Path) -> None:
    for name in ("a", "b"):
        (tmp_path / f"{name}.yaml").write_text(f"id: {name}\ngoal: g\n")
    scripts = [tmp_path / "x.jsonl", tmp_path / "y.jsonl"]
    for number, path in enumerate(scripts):  # one content each: two agents
        path.write_text((step("terminate") + "\n") * (number + 1))
    jobs = plan([str(tmp_path / "*.yaml")], [f"script:{path}" for path in scripts], 3)
    assert len(jobs) == 12 and len({j.key for j in jobs}) == 12
    assert isinstance(jobs[0].spec, ScenarioSpec)
