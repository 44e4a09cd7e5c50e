"""A scenario's own profile reaches the agent: ``cmbs run`` and ``cmbs batch`` prompt a
model (a real HTTP server on 127.0.0.1) with that profile's action names and constrain it
with that profile's schema; the batch summary and progress count earned runs and blocked
posture claims in the profile's words."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path
from typing import Any

import anyio
import pytest

from cmbs_async.batch import Progress
from cmbs_async.profile import load_profile

from .helpers import CMBS, EVALUATE, chat_server, evaluated_files, step

pytestmark = pytest.mark.anyio

#: A vocabulary that shares no action name with the built-in CISO profile.
MINE = """
name: mine
affordances: [shell]
actions:
  probe:
    kind: run_command
    evidence_on_success: successful
    posture_signals: [answer]
    description: Look at the host
  settle: {kind: declare_posture, description: Say what the posture is}
  stop: {kind: terminate, description: End the task}
signals:
  answer: {violation: ["^false$"], no_violation: ["^true$"]}
"""

#: Per vocabulary: the command, declare and terminate actions of an agent that first
#: claims a posture it has not observed (blocked), then does the work and earns the end.
WORDS = {
    "mine": ("probe", "settle", "stop"),
    "ciso": ("check_status", "declare_posture", "terminate"),
}
#: Per vocabulary, the work: `mine` names no evaluators, so any command's answer counts;
#: the CISO profile admits only an evaluator (cmbs-opa over the scenario's collected data).
WORK = {
    "mine": "echo probed > probed.txt; echo true",
    "ciso": EVALUATE,
}


def claims_too_early(body: dict[str, Any]) -> str:
    """The model: answers in the vocabulary its prompt lists, by the step number it is told."""
    system, user = (message["content"] for message in body["messages"])
    vocabulary = "mine" if "- probe:" in system else "ciso"
    run, declare, stop = WORDS[vocabulary]
    number = int(re.search(r"STEP: (\d+)", user).group(1))  # type: ignore[union-attr]
    done = {"posture": "compliant", "evidence": "successful"}
    return [
        step(declare, {"posture": "compliant"}, posture="compliant"),  # nothing observed yet
        step(run, {"command": WORK[vocabulary]}),
        step(declare, {"posture": "compliant"}, **done),
        step(stop, **done),
    ][min(number, 4) - 1]


def action_names(body: dict[str, Any]) -> set[str]:
    """The action names the request's response schema allows."""
    schema = body["response_format"]["json_schema"]["schema"]
    return {
        variant["properties"]["type"]["const"]
        for variant in schema["properties"]["action"]["oneOf"]
    }


def scenario(folder: Path, name: str, profile: str) -> Path:
    path = folder / f"{name}.yaml"
    spec = {"id": name, "goal": "check the host", "deadline_s": 60, "profile": profile}
    path.write_text(json.dumps(spec | {"files": evaluated_files("no")}))
    return path


async def test_cmbs_run_prompts_with_the_scenario_profile(tmp_path: Path) -> None:
    (tmp_path / "mine.yaml").write_text(MINE)
    spec = scenario(tmp_path, "own", str(tmp_path / "mine.yaml"))
    workdir = tmp_path / "work"
    async with chat_server(claims_too_early) as server:
        run = await anyio.run_process(
            [
                *CMBS,
                "run",
                str(spec),
                "--agent",
                f"openai:m@http://127.0.0.1:{server.port}/v1",
                "--no-audit",
                "--json",
                "--workdir",
                str(workdir),
            ],
            check=False,
        )
    assert run.returncode == 0, run.stderr.decode()
    result = json.loads(run.stdout)
    assert result["outcome"] == "terminated" and result["posture"] == "compliant"
    assert [t["action"] for t in result["trace"]] == ["settle", "probe", "settle", "stop"]
    assert (workdir / "probed.txt").read_text() == "probed\n"  # the probe really ran
    assert len(server.bodies) == 4
    for body in server.bodies:
        system = body["messages"][0]["content"]
        assert re.findall(r"(?m)^- (\w+):", system) == ["probe", "settle", "stop"]
        assert "declare_posture" not in system and "check_status" not in system
        assert action_names(body) == {"probe", "settle", "stop"}


async def test_cmbs_batch_prompts_and_summarizes_each_scenario_in_its_profile(
    tmp_path: Path,
) -> None:
    (tmp_path / "mine.yaml").write_text(MINE)
    folder = tmp_path / "scenarios"
    folder.mkdir()
    scenario(folder, "own", str(tmp_path / "mine.yaml"))
    scenario(folder, "stock", "ciso")
    async with chat_server(claims_too_early) as server:
        run = await anyio.run_process(
            [
                *CMBS,
                "batch",
                str(folder),
                "--agent",
                f"openai:m@http://127.0.0.1:{server.port}/v1",
                "--out",
                str(tmp_path / "out.jsonl"),
            ],
            check=False,
        )
    assert run.returncode == 0, run.stdout.decode() + run.stderr.decode()  # every run earned
    vocabularies = {frozenset(action_names(body)) for body in server.bodies}
    assert vocabularies == {frozenset(WORDS["mine"]), frozenset(load_profile("ciso").actions)}
    rows = {
        line.split()[0]: line.split()
        for line in run.stdout.decode().splitlines()
        if line.split()[:1] in (["own"], ["stock"])
    }
    # scenario, agent, runs, earned, mean s, p95 s, blocked claims, outcomes...
    assert rows["own"][2:4] == ["1", "1"] and rows["own"][6] == "1"
    assert rows["stock"][2:4] == ["1", "1"] and rows["stock"][6] == "1"


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_counts_what_did_not_end_terminated() -> None:
    terminal = _Terminal()
    progress = Progress(3, stream=terminal)
    for outcome in ("terminated", "agent_error", "runner_error"):
        progress.start()
        progress.finish({"outcome": outcome})
    progress.close()
    assert "3/3 done, 0 running, 2 not earned" in terminal.getvalue().rsplit("\r", 1)[-1]
