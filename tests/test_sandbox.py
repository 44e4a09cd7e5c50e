"""The sandbox, attacked as a hostile agent would: nothing outlives a command, nothing is
written outside the workdir, none of the operator's secrets can be read."""

from __future__ import annotations

import base64
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import anyio
import pytest

import executors
from cmbs_async import Outcome, ScenarioSpec, ScriptedAgent, run_scenario
from cmbs_async.protocol import CommandEnv
from executors import LocalExecutor
from executors.sandbox import SandboxUnavailable, find_bwrap

from .helpers import CMBS, processes_with, step, unique_seconds

pytestmark = pytest.mark.anyio


@pytest.fixture
def sandboxed() -> LocalExecutor:
    executor = LocalExecutor(sandbox="bwrap", kill_grace=0.3)
    assert executor.containment == "bwrap"
    return executor


@pytest.fixture
def outside_tmp() -> Iterator[Path]:
    """A directory outside /tmp: the sandbox's private /tmp would hide it anyway."""
    path = Path(tempfile.mkdtemp(prefix="cmbs-test-", dir="/var/tmp"))
    yield path
    shutil.rmtree(path)


@pytest.fixture
def no_bwrap(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A machine where bubblewrap is not installed."""
    monkeypatch.setenv("CMBS_BWRAP", str(Path("/nonexistent/bwrap")))
    find_bwrap.cache_clear()
    yield
    monkeypatch.undo()
    find_bwrap.cache_clear()


ESCAPES = {
    "setsid": "setsid sleep {m} &",
    "double fork": "sh -c '(sleep {m} &) &'; sleep 0.2;",
    "nohup": "nohup sleep {m} >/dev/null 2>&1 &",
    "TERM-ignoring": "sh -c 'trap \"\" TERM HUP; exec sleep {m}' &",
    "setsid + TERM-ignoring": "setsid sh -c 'trap \"\" TERM; sleep {m}' &",
}


@pytest.mark.parametrize("attack", list(ESCAPES))
async def test_nothing_a_command_starts_outlives_it(
    sandboxed: LocalExecutor, tmp_path: Path, attack: str
) -> None:
    mark = unique_seconds()
    with anyio.fail_after(10):
        observation = await sandboxed.run_command(
            str(tmp_path), ESCAPES[attack].format(m=mark) + " echo started", timeout=30
        )
    assert observation.success and "started" in observation.stdout.text
    assert processes_with(mark) == []


async def test_without_the_sandbox_setsid_escapes(tmp_path: Path) -> None:
    """Why the sandbox is the default: a process group does not hold a new session."""
    mark = unique_seconds()
    bare = LocalExecutor(sandbox="none", kill_grace=0.3)
    try:
        await bare.run_command(str(tmp_path), f"setsid sleep {mark} & echo started", timeout=30)
        escaped = processes_with(mark)
        assert escaped != []
    finally:
        for pid in processes_with(mark):
            os.kill(pid, 9)


async def test_a_timed_out_escapee_dies_with_the_sandbox(
    sandboxed: LocalExecutor, tmp_path: Path
) -> None:
    mark = unique_seconds()
    command = f"setsid sh -c 'trap \"\" TERM; sleep {mark}' & trap '' TERM; sleep {mark}"
    started = anyio.current_time()
    observation = await sandboxed.run_command(str(tmp_path), command, timeout=0.5)
    assert observation.timed_out
    assert anyio.current_time() - started < 3
    assert processes_with(mark) == []


async def test_the_host_is_read_only_and_tmp_is_private(
    sandboxed: LocalExecutor, tmp_path: Path
) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    workdir = tmp_path / "work"
    workdir.mkdir()
    marker = f"cmbs-sandbox-test-{os.getpid()}"
    command = (
        f"echo x > {outside}/f; echo x > /{marker}; echo x > /tmp/{marker}; "
        "mount -o remount,rw / 2>/dev/null && echo REMOUNTED; echo ok > inside.txt"
    )
    observation = await sandboxed.run_command(str(workdir), command, timeout=30)
    assert "REMOUNTED" not in observation.stdout.text
    assert "Read-only file system" in observation.stderr.text
    assert list(outside.iterdir()) == []
    assert not await anyio.Path(f"/{marker}").exists()
    assert not await anyio.Path(f"/tmp/{marker}").exists()
    assert (workdir / "inside.txt").read_text() == "ok\n"


async def test_secrets_are_out_of_sight(
    tmp_path: Path, outside_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = outside_tmp / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "id_ed25519").write_text("PRIVATE-SSH-KEY\n")
    data = outside_tmp / "data"
    (data / "cmbs").mkdir(parents=True)
    (data / "cmbs" / "signing_key").write_text("PRIVATE-SIGNING-KEY\n")
    elsewhere_key = outside_tmp / "keys" / "operator.key"
    elsewhere_key.parent.mkdir()
    elsewhere_key.write_text("PRIVATE-NAMED-KEY\n")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("XDG_DATA_HOME", str(data))
    monkeypatch.setenv("CMBS_AGENT_API_KEY", "sk-agent-secret")
    monkeypatch.setenv("CMBS_REVIEWER_API_KEY", "sk-reviewer-secret")
    monkeypatch.setenv("KUBECONFIG", "/etc/kube/config")
    executor = LocalExecutor(sandbox="bwrap", hidden=[str(elsewhere_key)])
    workdir = tmp_path / "work"
    workdir.mkdir()
    command = (
        f"env; cat {home}/.ssh/id_ed25519 {data}/cmbs/signing_key {elsewhere_key}; "
        "cat ~/.ssh/id_ed25519; echo HOME=$HOME; touch $HOME/ok && echo home-writable"
    )
    declared = CommandEnv(values={"SCENARIO_VAR": "1"}, pass_env=("KUBECONFIG",))
    observation = await executor.run_command(str(workdir), command, timeout=30, env=declared)
    seen = observation.stdout.text + observation.stderr.text
    assert "No such file or directory" in seen  # hidden, not merely unreadable
    for secret in ("PRIVATE", "sk-agent-secret", "sk-reviewer-secret", "CMBS_"):
        assert secret not in seen
    assert "KUBECONFIG=/etc/kube/config" in seen and "SCENARIO_VAR=1" in seen
    assert "HOME=/tmp/home" in seen and "home-writable" in seen
    assert not (home / "ok").exists()


async def test_a_declared_readable_path_is_seen_read_only(
    outside_tmp: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = outside_tmp / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "target_key").write_text("KEY-FOR-THE-TARGET\n")
    (home / ".ssh" / "other_key").write_text("OTHER-KEY\n")
    monkeypatch.setenv("HOME", str(home))
    executor = LocalExecutor(sandbox="bwrap")
    declared = CommandEnv(readable=(str(home / ".ssh" / "target_key"),))
    command = f"cat {home}/.ssh/target_key {home}/.ssh/other_key; echo x >> {home}/.ssh/target_key"
    observation = await executor.run_command(str(tmp_path), command, timeout=30, env=declared)
    assert "KEY-FOR-THE-TARGET" in observation.stdout.text
    assert "OTHER-KEY" not in observation.stdout.text
    assert "Read-only file system" in observation.stderr.text
    assert (home / ".ssh" / "target_key").read_text() == "KEY-FOR-THE-TARGET\n"


async def test_the_environment_is_an_allow_list_even_without_the_sandbox(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CMBS_AGENT_API_KEY", "sk-agent-secret")
    executor = LocalExecutor(sandbox="none")
    observation = await executor.run_command(str(tmp_path), "env", timeout=30)
    assert observation.success and "PATH=" in observation.stdout.text
    assert "sk-agent-secret" not in observation.stdout.text


async def test_a_program_in_the_workdir_is_never_found_by_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An operator PATH with an empty or relative entry would find the agent's own program
    (an `opa` that prints `true`, say) by its bare name."""
    monkeypatch.setenv("PATH", f".::bin:{os.environ['PATH']}")
    (tmp_path / "bin").mkdir()
    for fake in (tmp_path / "cmbs-agent-opa", tmp_path / "bin" / "cmbs-agent-opa"):
        fake.write_text("#!/bin/sh\necho true\n")
        fake.chmod(0o755)
    for sandbox in ("none", "auto"):
        observed = await LocalExecutor(sandbox=sandbox).run_command(
            str(tmp_path), "cmbs-agent-opa eval x", timeout=30
        )
        assert observed.exit_status == 127 and observed.stdout.text == ""


async def test_network_none_cuts_the_sandbox_off(sandboxed: LocalExecutor, tmp_path: Path) -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        port = server.getsockname()[1]
        probe = (
            f"{sys.executable} -c \"import socket; socket.create_connection(('127.0.0.1', {port}),"
            " timeout=5); print('connected')\""
        )
        on = await sandboxed.run_command(str(tmp_path), probe, timeout=30)
        off = await sandboxed.run_command(
            str(tmp_path), probe, timeout=30, env=CommandEnv(network=False)
        )
    assert on.success and "connected" in on.stdout.text
    assert not off.success and "connected" not in off.stdout.text


async def test_a_whole_run_reports_its_sandbox_and_leaves_nothing(tmp_path: Path) -> None:
    mark = unique_seconds()
    agent = ScriptedAgent(
        [
            step("check_status", {"command": f"setsid sleep {mark} & nohup sleep {mark} &"}),
            step("check_status", {"command": "cat $HOME/.ssh/* ~/.ssh/*; env"}),
        ]
    )
    spec = ScenarioSpec(id="contained", goal="g", workdir=str(tmp_path))
    result = await run_scenario(spec, agent=agent, executor=LocalExecutor())
    assert result.sandbox == "bwrap" and result.summary()["sandbox"] == "bwrap"
    assert result.outcome is Outcome.AGENT_FINISHED
    assert processes_with(mark) == []


def test_bwrap_is_refused_where_it_is_not_installed(no_bwrap: None) -> None:
    with pytest.raises(SandboxUnavailable, match="apt-get install bubblewrap"):
        LocalExecutor(sandbox="bwrap")
    assert LocalExecutor(sandbox="auto").containment == "none"


def _demo(*options: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CMBS, "demo", "--no-audit", "--json", *options],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )


def test_the_cli_says_when_commands_run_bare() -> None:
    without = os.environ | {"CMBS_BWRAP": "/nonexistent/bwrap"}
    auto = _demo(env=without)
    assert auto.returncode == 0
    warning = auto.stderr.strip().splitlines()
    assert len(warning) == 1 and "without a sandbox" in warning[0]
    assert json.loads(auto.stdout)["sandbox"] == "none"
    refused = _demo("--sandbox", "bwrap", env=without)
    assert refused.returncode == 2 and refused.stdout == ""
    assert refused.stderr.count("\n") == 1 and "apt-get install bubblewrap" in refused.stderr
    installed = _demo(env=dict(os.environ))
    assert installed.returncode == 0 and installed.stderr == ""
    assert json.loads(installed.stdout)["sandbox"] == "bwrap"
    bare = _demo("--sandbox", "none", env=dict(os.environ))
    assert bare.stderr == "" and json.loads(bare.stdout)["sandbox"] == "none"


def test_a_cli_run_cannot_read_its_own_signing_key_or_audit_db(
    tmp_path: Path, outside_tmp: Path
) -> None:
    key, db = outside_tmp / "operator.key", outside_tmp / "audit.db"
    scenario = tmp_path / "scenario.yaml"
    scenario.write_text("id: snoop\ngoal: g\n")
    steps = tmp_path / "steps.jsonl"
    snoop = f"base64 {key}; base64 {db}; ls -a {outside_tmp}; env"
    steps.write_text(step("check_status", {"command": snoop}) + "\n")
    done = subprocess.run(
        [*CMBS, "run", str(scenario), "--agent", f"script:{steps}", "--json"]
        + ["--signing-key", str(key), "--audit-db", str(db)],
        capture_output=True,
        text=True,
        timeout=120,
        env=os.environ | {"CMBS_AGENT_API_KEY": "sk-agent-secret"},
        check=False,
    )
    assert done.returncode == 3, done.stderr
    result = json.loads(done.stdout)
    assert result["sandbox"] == "bwrap"
    secret = base64.b64encode(key.read_bytes()).decode()[:16]
    shown = done.stdout + db.read_bytes().decode("utf-8", "replace")
    assert secret not in shown and "sk-agent-secret" not in shown
    assert "exit 0" in result["trace"][0]["observed"]  # it ran; it saw empty files


def test_a_killed_cmbs_leaves_no_command_running(tmp_path: Path) -> None:
    """SIGKILL gives cmbs no chance to clean up: the sandbox must end by itself."""
    mark = unique_seconds()
    program = (
        "import anyio, sys\n"
        "from executors import LocalExecutor\n"
        "anyio.run(lambda: LocalExecutor().run_command(sys.argv[1], sys.argv[2], timeout=None))\n"
    )
    command = f"setsid sleep {mark} & sleep {mark}"
    parent = subprocess.Popen([sys.executable, "-c", program, str(tmp_path), command])
    try:
        deadline = time.monotonic() + 30
        while len(processes_with(mark)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(processes_with(mark)) == 2
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 5
    while processes_with(mark) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert processes_with(mark) == []


def test_a_secret_among_the_tools_stays_hidden(tmp_path: Path) -> None:
    """The interpreter and this package's code are shown again; a key kept among them not."""
    tools = Path(executors.__file__).resolve().parent.parent
    key = tools / f".cmbs-test-key-{unique_seconds()}"
    key.write_text("PRIVATE-KEY-AMONG-THE-TOOLS\n")
    try:
        # the directory around the tools hidden too, as a home around a venv would be
        executor = LocalExecutor(sandbox="bwrap", hidden=[str(key), str(tools.parent)])
        command = f"cat {key}; {sys.executable} -c 'import executors; print(\"tools ok\")'"
        observation = anyio.run(partial(executor.run_command, str(tmp_path), command, timeout=30))
    finally:
        key.unlink()
    assert "tools ok" in observation.stdout.text
    assert "PRIVATE" not in observation.stdout.text


@pytest.mark.parametrize("where", ["root", "home", "parent of home", "tmp", "tools"])
def test_a_workdir_that_would_expose_what_is_hidden_is_refused(
    where: str, outside_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The workdir is mounted writable over everything: it must not be ``/``, a home, the
    shared ``/tmp`` (other runs' workdirs) or the interpreter's tree, and the run says so."""
    home = outside_tmp / "home"
    (home / ".ssh").mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    tools = Path(executors.__file__).resolve().parent.parent
    workdir = {
        "root": "/",
        "home": str(home),
        "parent of home": str(outside_tmp),
        "tmp": tempfile.gettempdir(),
        "tools": str(tools),
    }[where]
    spec = ScenarioSpec(id="exposed", goal="g", workdir=workdir)
    agent = ScriptedAgent([step("check_status", {"command": "touch cmbs-test-exposed"})])
    result = anyio.run(partial(run_scenario, spec, agent=agent, executor=LocalExecutor()))
    assert result.outcome is Outcome.EXECUTOR_ERROR
    assert "give the scenario a directory of its own" in result.reason
    assert result.trace == []
    assert not (Path(workdir) / "cmbs-test-exposed").exists()


def test_a_scenario_cannot_pass_the_operators_keys_to_commands(tmp_path: Path) -> None:
    scenario = tmp_path / "scenario.yaml"
    scenario.write_text("id: leak\ngoal: g\npass_env: [KUBECONFIG, CMBS_AGENT_API_KEY]\n")
    done = subprocess.run(
        [*CMBS, "run", str(scenario), "--agent", "script:/dev/null", "--no-audit"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1
    assert "CMBS_AGENT_API_KEY may hold the operator's credentials" in done.stderr
    with pytest.raises(ValueError, match="OPENAI_API_KEY may hold"):
        CommandEnv(pass_env=("OPENAI_API_KEY",))
