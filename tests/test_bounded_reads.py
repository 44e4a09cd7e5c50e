"""Bounded reads everywhere (issue 22, item 5): every file the command line is handed
(scenario, steps, IT-Bench data, review configuration) is read with a size cap and a
nesting cap, each refused in one line naming the cap, quickly and without taking the
host's memory; whatever an agent sends (a scripted line, a callable's step, an MCP tool
call) is bounded the same before the audit trail keeps it; and ``itbench run`` checks
its ``--workdir`` before it makes anything."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from mcp import ClientSession
from mcp.client.stdio import stdio_client
from mcp.shared.exceptions import MCPError

from cmbs_async import CallableAgent, ScenarioSpec, Turn, run_scenario
from cmbs_async._bounds import ARTIFACT_MAX_CHARS, COMMAND_MAX_CHARS, STEP_MAX_BYTES
from cmbs_async._reading import (
    ReadError,
    loads_json,
    loads_toml,
    loads_yaml,
    read_bytes,
    read_json,
    read_text,
)
from cmbs_async.audit import SQLiteAuditStore, load_or_create_key
from cmbs_async.mcp_server import MESSAGE_MAX_BYTES
from cmbs_async.replayer import replay
from executors import NullExecutor

from .helpers import CMBS, needs_ansible, step
from .test_mcp import _server as _mcp_server
from .test_mcp import _text

MiB = 1024 * 1024
#: What a refused start may use at most (the interpreter and its imports take ~100 MiB):
#: far below what reading /dev/zero or a file of gigabytes whole would take.
RSS_LIMIT_KIB = 400 * 1024
#: How long a refusal may take, at most, on a busy machine.
QUICKLY_S = 30.0


@pytest.fixture
def fifo(tmp_path: Path) -> Iterator[Path]:
    """A FIFO that a writer keeps filling with zeros, without end."""
    path = tmp_path / "endless.fifo"
    os.mkfifo(path)
    writer = subprocess.Popen(
        ["sh", "-c", f"exec cat /dev/zero > '{path}'"], stderr=subprocess.DEVNULL
    )
    yield path
    writer.kill()
    writer.wait()


def measured(*args: str, cwd: Path | None = None) -> tuple[int, str, float, int]:
    """``cmbs ARGS``: its exit status, stderr, wall time, and the most memory (KiB of
    resident set) it used, as the kernel counted it for that process."""
    err_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"cmbs-err-{os.getpid()}-{time.time_ns()}"
    started = time.monotonic()
    with open(err_path, "w+") as err:
        proc = subprocess.Popen(
            [*CMBS, *args], stdout=subprocess.DEVNULL, stderr=err, stdin=subprocess.DEVNULL, cwd=cwd
        )
        while True:  # wait4 reaps it and says what it used; polled, to bound the wait
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() - started > 120:
                proc.kill()
                raise AssertionError(f"cmbs {' '.join(args)} did not end")
            time.sleep(0.02)
        proc.returncode = os.waitstatus_to_exitcode(status)
        err.seek(0)
        said = err.read()
    err_path.unlink()
    return proc.returncode, said, time.monotonic() - started, usage.ru_maxrss


def refused(args: list[str], *said: str, cwd: Path | None = None) -> str:
    status, stderr, took, rss = measured(*args, cwd=cwd)
    assert status == 2, stderr
    assert stderr.count("\n") == 1 and "Traceback" not in stderr, stderr
    for text in said:
        assert text in stderr, stderr
    assert took < QUICKLY_S, took
    assert rss < RSS_LIMIT_KIB, f"{rss} KiB"
    return stderr


def sparse(path: Path, size: int) -> Path:
    """A file of ``size`` bytes that takes no room on disk."""
    path.touch()
    os.truncate(path, size)
    return path


@pytest.fixture
def scenario(tmp_path: Path) -> Path:
    path = tmp_path / "s.yaml"
    path.write_text("id: bounded\ngoal: g\n")
    return path


@pytest.fixture
def steps(tmp_path: Path) -> Path:
    path = tmp_path / "steps.jsonl"
    path.write_text(step("check_status", {"command": "true"}) + "\n")
    return path


def itbench_data(tmp_path: Path, goal: str = "Use ansible.") -> Path:
    path = tmp_path / "data.json"
    ansible_ini = '[rhel9_servers]\nrhel9 ansible_host="192.0.2.1"\n'
    vars_ = {"ansible_ini": ansible_ini, "ansible_user_key": "k"}
    path.write_text(json.dumps({"goal_template": goal, "vars": vars_}))
    return path


# --- files the command line is handed -----------------------------------------------------


@pytest.mark.parametrize(
    ("command", "source"),  # batch takes regular files only (or folders of them)
    [("run", "dev-zero"), ("run", "fifo"), ("run", "sparse"), ("batch", "sparse")],
)
def test_a_scenario_file_without_end_or_too_large_is_one_line(
    request: pytest.FixtureRequest, tmp_path: Path, steps: Path, source: str, command: str
) -> None:
    if source == "dev-zero":
        path = Path("/dev/zero")
    elif source == "fifo":
        path = request.getfixturevalue("fifo")
    else:
        path = sparse(tmp_path / "huge.yaml", 8 * MiB + 1)
    extra = ["--no-audit"] if command == "run" else ["--out", str(tmp_path / "r.jsonl")]
    refused(
        [command, str(path), "--agent", f"script:{steps}", *extra],
        f"{path}: larger than 8 MiB (the cap for a scenario file)",
    )


@pytest.mark.parametrize("source", ["dev-zero", "sparse"])
def test_a_steps_file_without_end_or_too_large_is_one_line(
    tmp_path: Path, scenario: Path, source: str
) -> None:
    path = Path("/dev/zero") if source == "dev-zero" else sparse(tmp_path / "s.jsonl", 64 * MiB + 1)
    refused(
        ["run", str(scenario), "--agent", f"script:{path}", "--no-audit"],
        f"{path}: larger than 64 MiB (the cap for a steps file)",
    )


@pytest.mark.parametrize("source", ["dev-zero", "sparse"])
def test_itbench_data_without_end_or_too_large_is_one_line(tmp_path: Path, source: str) -> None:
    path = Path("/dev/zero") if source == "dev-zero" else sparse(tmp_path / "d.json", 8 * MiB + 1)
    workdir = tmp_path / "w"
    refused(
        ["itbench", "run", str(path), "--workdir", str(workdir), "--agent", "script:x"],
        f"{path}: larger than 8 MiB (the cap for IT-Bench scenario data)",
    )
    assert not workdir.exists()


@pytest.mark.parametrize("source", ["dev-zero", "sparse"])
def test_a_review_config_without_end_or_too_large_is_one_line(
    tmp_path: Path, scenario: Path, steps: Path, source: str
) -> None:
    path = Path("/dev/zero") if source == "dev-zero" else sparse(tmp_path / "c.toml", MiB + 1)
    refused(
        ["run", str(scenario), "--agent", f"script:{steps}", "--config", str(path), "--no-audit"],
        f"{path}: larger than 1 MiB (the cap for a configuration file)",
    )


def _deep(kind: str) -> str:
    if kind == "json":
        return '{"id": "x", "goal": "g", "vars": ' + "[" * 100_000 + "]" * 100_000 + "}"
    if kind == "yaml-flow":
        return "id: x\ngoal: g\nvars: " + "[" * 100_000 + "]" * 100_000 + "\n"
    if kind == "yaml-block":
        return "id: x\ngoal: g\nvars:\n" + "".join("  " * i + "- \n" for i in range(1, 2000))
    if kind == "yaml-aliases":  # "a billion laughs": nine levels of nine aliases each
        lines = ['a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
        lines += [f"a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 10)]
        return "id: x\ngoal: g\n" + "\n".join(lines) + "\n"
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["json", "yaml-flow", "yaml-block", "yaml-aliases"])
def test_a_scenario_nested_or_expanded_without_bound_is_one_line(
    tmp_path: Path, steps: Path, kind: str
) -> None:
    path = tmp_path / ("deep.json" if kind == "json" else "deep.yaml")
    path.write_text(_deep(kind))
    said = (
        "aliases repeat more than 1000000 nodes"
        if kind == "yaml-aliases"
        else "nested deeper than 64 levels"
    )
    refused(["run", str(path), "--agent", f"script:{steps}", "--no-audit"], f"{path}: {said}")


def test_itbench_data_and_a_review_config_nested_without_bound_are_one_line(
    tmp_path: Path, scenario: Path, steps: Path
) -> None:
    data = tmp_path / "deep.json"
    data.write_text(
        '{"goal": "Use ansible.", "vars": {}, "x": ' + "[" * 50_000 + "]" * 50_000 + "}"
    )
    workdir = tmp_path / "w"
    refused(
        ["itbench", "run", str(data), "--workdir", str(workdir), "--agent", "script:x"],
        f"{data}: nested deeper than 64 levels",
    )
    assert not workdir.exists()
    kubeconfig = "[" * 900 + "]" * 900  # inside the data: YAML that the data's JSON holds
    data.write_text(
        json.dumps({"goal": "Use kubectl and OPA.", "vars": {"kubeconfig": kubeconfig}})
    )
    refused(
        ["itbench", "run", str(data), "--workdir", str(workdir), "--agent", "script:x"],
        "kubeconfig: nested deeper than 64 levels",
    )
    assert not workdir.exists()
    config = tmp_path / "deep.toml"
    config.write_text("[supervision]\nmodel = " + "[" * 50_000 + "]" * 50_000 + "\n")
    refused(
        ["run", str(scenario), "--agent", f"script:{steps}", "--config", str(config), "--no-audit"],
        f"{config}: nested deeper than 64 levels",
    )


# --- the reader itself ----------------------------------------------------------------------


def test_the_reader_takes_at_most_the_cap_and_names_it(tmp_path: Path) -> None:
    exact = tmp_path / "exact"
    exact.write_bytes(b"x" * 1000)
    assert read_bytes(exact, what="a test file", max_bytes=1000) == b"x" * 1000
    with pytest.raises(ReadError, match=r"exact: larger than 999 bytes \(the cap for a test"):
        read_bytes(exact, what="a test file", max_bytes=999)
    with pytest.raises(ReadError, match=r"/dev/zero: larger than 64 KiB \(the cap for a t"):
        read_text("/dev/zero", what="a test file", max_bytes=64 * 1024)
    with pytest.raises(ReadError, match="cannot read: Is a directory"):
        read_text(tmp_path, what="a test file")
    with pytest.raises(ReadError, match="not UTF-8 text"):
        (tmp_path / "latin1").write_bytes(b"caf\xe9")
        read_text(tmp_path / "latin1", what="a test file")
    lonely = tmp_path / "lonely.fifo"  # no writer: read as empty, never a hang
    os.mkfifo(lonely)
    started = time.monotonic()
    assert read_text(lonely, what="a test file") == ""
    assert time.monotonic() - started < 5


def test_nesting_is_counted_outside_strings_and_up_to_the_cap(tmp_path: Path) -> None:
    assert loads_json("[" * 64 + "]" * 64, origin="t") is not None
    with pytest.raises(ReadError, match="^t: nested deeper than 64 levels$"):
        loads_json("[" * 65 + "]" * 65, origin="t")
    brackets = json.dumps({"s": "[" * 1000 + '\\"{' * 100, "t": ["{[" * 50]})
    assert loads_json(brackets, origin="t")["s"].startswith("[[[")
    assert loads_yaml("a: '" + "[" * 1000 + "'", origin="t") == {"a": "[" * 1000}
    assert loads_toml('a = "[[[[{{{{"\n# [[[[[[[\nb = [[1], [2]]\n', origin="t")["b"] == [[1], [2]]
    with pytest.raises(ReadError, match="^t: not valid JSON: "):
        loads_json("{nope", origin="t")
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 10 + "]" * 10)
    with pytest.raises(ReadError, match="deep.json: nested deeper than 5 levels"):
        read_json(deep, what="a test file", max_depth=5)


# --- what an agent sends ---------------------------------------------------------------------


def _spec() -> ScenarioSpec:
    return ScenarioSpec(id="bounded", goal="g", deadline_s=30)


def _db_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.parent.glob(path.name + "*"))


@pytest.mark.anyio
async def test_a_step_over_the_cap_is_refused_kept_small_and_replayed(tmp_path: Path) -> None:
    big = "x" * (5 * MiB)
    said: list[dict[str, Any]] = [
        {
            "belief": {},
            "action": {"type": "generate_script", "payload": {"path": "a", "content": big}},
        },
        {
            "belief": {},
            "action": {
                "type": "generate_script",
                "payload": {"path": "a", "content": "y" * (ARTIFACT_MAX_CHARS + 1)},
            },
        },
        {
            "belief": {},
            "action": {
                "type": "check_status",
                "payload": {"command": "t" * (COMMAND_MAX_CHARS + 1)},
            },
        },
        {"belief": {}, "action": {"type": "check_status", "payload": {"command": "true"}}},
    ]
    seen: list[Turn] = []

    async def agent(turn: Turn) -> Any:
        seen.append(turn)
        return said[turn.step - 1] if turn.step <= len(said) else None

    db = tmp_path / "audit.db"
    store = SQLiteAuditStore(db, key=load_or_create_key(tmp_path / "key"))
    try:
        result = await run_scenario(
            _spec(), agent=CallableAgent(agent), executor=NullExecutor(), audit=store
        )
        assert [t.verdict.value for t in result.trace] == ["CONTINUE"] * 3 + ["ALLOW"]
        first, artifact, command = (seen[i].response for i in (1, 2, 3))
        assert first is not None and artifact is not None and command is not None
        assert first.detail is not None and first.detail.startswith(
            "larger than 4 MiB (the cap for an agent's step): "
        )
        assert "\n" not in first.detail and "SHA-256" in first.detail
        assert artifact.detail == (
            f"action.payload.content: String should have at most {ARTIFACT_MAX_CHARS} characters"
        )
        assert command.detail == (
            f"action.payload.command: String should have at most {COMMAND_MAX_CHARS} characters"
        )
        assert result.session_id is not None
        assert replay(store, result.session_id).identical
    finally:
        store.close()
    # the 5 MiB step is kept as its size and hash; the 1 MiB artifact (within the step
    # cap, refused by the payload's) is kept as it came
    assert _db_size(db) < 3 * MiB
    assert STEP_MAX_BYTES == 4 * MiB


@pytest.mark.anyio
async def test_an_mcp_artifact_over_the_cap_is_refused_and_not_kept(
    tmp_path: Path, scenario: Path
) -> None:
    db = tmp_path / "audit.db"
    async with (
        stdio_client(_mcp_server(scenario, tmp_path)) as (read, write),
        ClientSession(read, write) as client,
    ):
        await client.initialize()
        ran = await client.call_tool("check_status", {"command": "true"})
        assert not ran.is_error
        before = _db_size(db)
        # over the step cap: refused in one line, kept as its size and hash
        big = await client.call_tool("generate_script", {"path": "a", "content": "x" * (6 * MiB)})
        assert big.is_error
        assert "larger than 4 MiB (the cap for an agent's step)" in _text(big)
        assert "\n" not in _text(big)
        # over the transport's cap: never reaches the server, answered all the same
        with pytest.raises(MCPError, match=r"larger than 16 MiB \(the cap for one MCP message\)"):
            await client.call_tool(
                "generate_script", {"path": "a", "content": "x" * (MESSAGE_MAX_BYTES + 1)}
            )
        # the session goes on
        again = await client.call_tool("check_status", {"command": "echo still here"})
        assert not again.is_error and "still here" in _text(again)
        assert _db_size(db) - before < 256 * 1024
    store = SQLiteAuditStore(db, read_only=True)
    try:
        assert store.verify().intact
    finally:
        store.close()


# --- itbench run checks everything before it makes anything ---------------------------------


@pytest.mark.parametrize("workdir", ["{{ x }}", "w/{{x}}", "{% if %}", "{# c #}"])
def test_an_itbench_workdir_that_reads_as_a_template_is_one_line(
    tmp_path: Path, workdir: str
) -> None:
    data = itbench_data(tmp_path)
    before = sorted(os.listdir(tmp_path))
    refused(
        ["itbench", "run", str(data), "--workdir", workdir, "--agent", "script:x", "--no-audit"],
        "would read as a template placeholder",
        cwd=tmp_path,
    )
    assert sorted(os.listdir(tmp_path)) == before  # no DIR, no user_key


def test_itbench_run_checks_its_tar_and_its_workdir_before_making_anything(
    tmp_path: Path,
) -> None:
    needs_ansible()  # its programs are checked first
    data = itbench_data(tmp_path)
    before = sorted(os.listdir(tmp_path))
    refused(
        ["itbench", "run", str(data), "--workdir", "w", "--agent", "script:x", "--no-audit"]
        + ["--tar", str(tmp_path / "nowhere" / "a.tar")],
        "its directory does not exist",
        cwd=tmp_path,
    )
    refused(  # outside the workdir root it is given: the sandbox would refuse it later
        ["itbench", "run", str(data), "--workdir", "elsewhere/w", "--agent", "script:x"]
        + ["--no-audit", "--workdir-root", "root"],
        "is outside the workdir root",
        cwd=tmp_path,
    )
    assert sorted(os.listdir(tmp_path)) == before


def test_an_identity_file_too_large_is_one_line(
    tmp_path: Path, scenario: Path, steps: Path
) -> None:
    key = sparse(tmp_path / "id_big", 3 << 30)  # asyncssh alone would read it whole
    refused(
        ["run", str(scenario), "--agent", f"script:{steps}", "--no-audit"]
        + ["--executor", "ssh://u@127.0.0.1:1", "--identity", str(key)],
        "larger than 1 MiB (the cap for an identity file)",
    )


# --- a model's reply ----------------------------------------------------------------------------


@pytest.mark.anyio
async def test_a_model_reply_over_the_cap_is_not_read_whole() -> None:
    from cmbs_async import ModelEndpointError, OpenAIAgent
    from cmbs_async._chat import REPLY_MAX_BYTES
    from cmbs_async.review import OpenAIReviewer, ReviewerError, ReviewRequest, SupervisionConfig

    from .helpers import chat_server

    huge = "x" * (REPLY_MAX_BYTES + 1)
    turn = Turn(scenario_id="x", goal="g", step=1)
    async with chat_server(huge) as server:
        base = f"http://127.0.0.1:{server.port}/v1"
        async with OpenAIAgent(model="m", base_url=base, response_format="none") as agent:
            with pytest.raises(ModelEndpointError, match=r"larger than 16 MiB \(the cap for a"):
                await agent.next_step(turn)
        reviewer = OpenAIReviewer(SupervisionConfig(base_url=base, timeout_seconds=20))
        request = ReviewRequest(goal="g", commitment="c", trace="t", assessment="a", flags=())
        async with reviewer:
            with pytest.raises(ReviewerError, match=r"larger than 16 MiB \(the cap for a chat"):
                await reviewer.review(request)
        assert server.requests == 2  # each refused once, not retried


def test_a_batch_results_file_to_resume_is_read_with_caps(
    tmp_path: Path, scenario: Path, steps: Path
) -> None:
    args = ["batch", str(scenario), "--agent", f"script:{steps}", "--resume", "--out"]
    refused([*args, "/dev/zero"], "/dev/zero is not a results file (not a regular file)")
    deep = tmp_path / "deep.jsonl"
    deep.write_text("[" * 100_000 + "]" * 100_000 + "\n")
    refused([*args, str(deep)], f"{deep}:1 is not a result line")
