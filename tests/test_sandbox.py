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
from collections.abc import AsyncIterator, Iterator
from functools import partial
from pathlib import Path

import anyio
import pytest

import executors
from cmbs_async import Outcome, ScenarioResult, ScenarioSpec, ScriptedAgent, run_scenario
from cmbs_async.protocol import CommandEnv, Observation
from executors import ExecutorError, LocalExecutor
from executors.sandbox import SandboxUnavailable, find_bwrap

from .helpers import CMBS, processes_with, step, unique_seconds

pytestmark = pytest.mark.anyio


@pytest.fixture
async def sandboxed(tmp_path: Path) -> AsyncIterator[LocalExecutor]:
    async with LocalExecutor(
        sandbox="bwrap", workdir_root=str(tmp_path), kill_grace=0.3
    ) as executor:
        assert executor.containment == "bwrap"
        yield executor


@pytest.fixture
async def workdir(sandboxed: LocalExecutor) -> str:
    """A prepared workdir of the sandboxed executor (its sandbox proven)."""
    return await sandboxed.prepare(None, {})


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
    sandboxed: LocalExecutor, workdir: str, attack: str
) -> None:
    mark = unique_seconds()
    with anyio.fail_after(10):
        observation = await sandboxed.run_command(
            workdir, ESCAPES[attack].format(m=mark) + " echo started", timeout=30
        )
    assert observation.success and "started" in observation.stdout.text
    assert processes_with(mark) == []


async def test_without_the_sandbox_setsid_escapes(tmp_path: Path) -> None:
    """Why the sandbox is the default: a process group does not hold a new session."""
    mark = unique_seconds()
    try:
        async with LocalExecutor(
            sandbox="none", workdir_root=str(tmp_path), kill_grace=0.3
        ) as bare:
            workdir = await bare.prepare(None, {})
            command = f"setsid sleep {mark} & echo started"
            await bare.run_command(workdir, command, timeout=30)
        escaped = processes_with(mark)
        assert escaped != []
    finally:
        for pid in processes_with(mark):
            os.kill(pid, 9)


async def test_a_timed_out_escapee_dies_with_the_sandbox(
    sandboxed: LocalExecutor, workdir: str
) -> None:
    mark = unique_seconds()
    command = f"setsid sh -c 'trap \"\" TERM; sleep {mark}' & trap '' TERM; sleep {mark}"
    started = anyio.current_time()
    observation = await sandboxed.run_command(workdir, command, timeout=0.5)
    assert observation.timed_out
    assert anyio.current_time() - started < 3
    assert processes_with(mark) == []


async def test_the_host_is_read_only_and_tmp_is_private(
    sandboxed: LocalExecutor, outside_tmp: Path
) -> None:
    outside = outside_tmp / "outside"
    outside.mkdir()
    os.chmod(outside, 0o1777)  # anyone may write here: only the read-only mount stops it
    os.chmod(outside_tmp, 0o755)
    workdir = Path(await sandboxed.prepare(None, {}))
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
    command = (
        f"env; cat {home}/.ssh/id_ed25519 {data}/cmbs/signing_key {elsewhere_key}; "
        "cat ~/.ssh/id_ed25519; echo HOME=$HOME; touch $HOME/ok && echo home-writable"
    )
    declared = CommandEnv(values={"SCENARIO_VAR": "1"}, pass_env=("KUBECONFIG",))
    hidden = [str(elsewhere_key)]
    async with LocalExecutor(sandbox="bwrap", hidden=hidden, workdir_root=str(tmp_path)) as ex:
        workdir = await ex.prepare(None, {}, env=declared)
        observation = await ex.run_command(workdir, command, timeout=30, env=declared)
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
    os.chmod(outside_tmp, 0o755)  # where homes lie, as /home, anyone may look
    home = outside_tmp / "home"
    (home / ".ssh").mkdir(parents=True)
    for name, content in (("target_key", "KEY-FOR-THE-TARGET\n"), ("other_key", "OTHER-KEY\n")):
        (home / ".ssh" / name).write_text(content)
        os.chmod(home / ".ssh" / name, 0o600)  # root's alone
    monkeypatch.setenv("HOME", str(home))
    declared = CommandEnv(readable=(str(home / ".ssh" / "target_key"),))
    command = f"cat {home}/.ssh/target_key {home}/.ssh/other_key; echo x >> {home}/.ssh/target_key"
    async with LocalExecutor(sandbox="bwrap", workdir_root=str(tmp_path)) as executor:
        workdir = await executor.prepare(None, {}, env=declared)
        observation = await executor.run_command(workdir, command, timeout=30, env=declared)
    assert "KEY-FOR-THE-TARGET" in observation.stdout.text
    assert "OTHER-KEY" not in observation.stdout.text
    assert f"cannot create {home}/.ssh/target_key" in observation.stderr.text
    assert (home / ".ssh" / "target_key").read_text() == "KEY-FOR-THE-TARGET\n"


async def test_a_declared_readable_file_in_a_root_only_directory_is_readable(
    outside_tmp: Path, tmp_path: Path
) -> None:
    key = outside_tmp / "keys" / "target_key"  # outside_tmp is 0700, root's
    key.parent.mkdir(mode=0o700)
    key.write_text("KEY-FOR-THE-TARGET\n")
    os.chmod(key, 0o600)
    declared = CommandEnv(readable=(str(key),))
    async with LocalExecutor(sandbox="bwrap", workdir_root=str(tmp_path)) as executor:
        workdir = await executor.prepare(None, {}, env=declared)
        observation = await executor.run_command(workdir, f"cat {key}", timeout=30, env=declared)
    assert observation.stdout.text == "KEY-FOR-THE-TARGET\n", observation.stderr.text


async def test_the_environment_is_an_allow_list_even_without_the_sandbox(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CMBS_AGENT_API_KEY", "sk-agent-secret")
    async with LocalExecutor(sandbox="none", workdir_root=str(tmp_path)) as executor:
        observation = await executor.run_command(
            await executor.prepare(None, {}), "env", timeout=30
        )
    assert observation.success and "PATH=" in observation.stdout.text
    assert "sk-agent-secret" not in observation.stdout.text


async def test_a_program_in_the_workdir_is_never_found_by_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An operator PATH with an empty or relative entry would find the agent's own program
    (an `opa` that prints `true`, say) by its bare name."""
    monkeypatch.setenv("PATH", f".::bin:{os.environ['PATH']}")
    fake = "#!/bin/sh\necho true\n"
    for sandbox in ("none", "auto"):
        root = tmp_path / sandbox
        async with LocalExecutor(sandbox=sandbox, workdir_root=str(root)) as executor:
            workdir = await executor.prepare(
                None, {"cmbs-agent-opa": fake, "bin/cmbs-agent-opa": fake}
            )
            for program in (Path(workdir, "cmbs-agent-opa"), Path(workdir, "bin/cmbs-agent-opa")):
                program.chmod(0o755)
            observed = await executor.run_command(workdir, "cmbs-agent-opa eval x", timeout=30)
            found = await executor.run_command(
                workdir, "./cmbs-agent-opa; bin/cmbs-agent-opa", timeout=30
            )
        assert observed.exit_status == 127 and observed.stdout.text == ""
        assert found.stdout.text == "true\ntrue\n"  # they would run, named by a path


async def test_network_none_cuts_the_sandbox_off(sandboxed: LocalExecutor, workdir: str) -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        port = server.getsockname()[1]
        probe = (
            f"{sys.executable} -c \"import socket; socket.create_connection(('127.0.0.1', {port}),"
            " timeout=5); print('connected')\""
        )
        on = await sandboxed.run_command(workdir, probe, timeout=30)
        off = await sandboxed.run_command(workdir, probe, timeout=30, env=CommandEnv(network=False))
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
    spec = ScenarioSpec(id="contained", goal="g", workdir=str(tmp_path / "w"))
    async with LocalExecutor(workdir_root=str(tmp_path)) as executor:
        result = await run_scenario(spec, agent=agent, executor=executor)
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
        "async def main(root, command):\n"
        "    executor = LocalExecutor(workdir_root=root)\n"
        "    workdir = await executor.prepare(None, {})\n"
        "    await executor.run_command(workdir, command, timeout=None)\n"
        "anyio.run(main, sys.argv[1], sys.argv[2])\n"
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


#: A bwrap that, when it is to start a sandbox (not when probed), first kills the process
#: that started it and waits until that one is gone, then is the real bwrap.
STARTER_KILLING_BWRAP = """\
#!/bin/sh
case " $* " in
*" --info-fd "*)
    kill -KILL "$PPID"
    while kill -0 "$PPID" 2>/dev/null; do sleep 0.01; done ;;
esac
exec {real} "$@"
"""


def test_a_sandbox_whose_starter_died_as_bwrap_began_ends_by_itself(tmp_path: Path) -> None:
    """cmbs killed between starting bwrap and bwrap's report of the sandbox's init (which
    bwrap writes before it lets the sandbox go on): the sandbox ends all the same, and
    nothing waits for ever in its first instant (found after a SIGKILLed batch: bwrap died
    writing to a report nobody read, and its half-made sandbox stayed)."""
    real = find_bwrap()
    if real is None:
        pytest.skip("needs bubblewrap")
    wrapper = tmp_path / "bwrap"
    wrapper.write_text(STARTER_KILLING_BWRAP.format(real=real))
    wrapper.chmod(0o755)
    root = tmp_path / "workdirs"
    root.mkdir()
    program = (
        "import anyio, sys\n"
        "from executors import LocalExecutor\n"
        "async def main(root):\n"
        "    async with LocalExecutor(sandbox='bwrap', workdir_root=root) as executor:\n"
        "        await executor.prepare(None, {})\n"
        "anyio.run(main, sys.argv[1])\n"
    )
    starter = subprocess.Popen(
        [sys.executable, "-c", program, str(root)],
        env={**os.environ, "CMBS_BWRAP": str(wrapper)},
        stderr=subprocess.DEVNULL,
    )
    assert starter.wait(timeout=60) == -9  # killed by its bwrap, as it began
    # the wrapper, then the real bwrap it becomes, name the root among their arguments
    deadline = time.monotonic() + 10
    while processes_with(str(root)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert processes_with(str(root)) == []


def test_a_secret_among_the_tools_stays_hidden(tmp_path: Path) -> None:
    """The interpreter and this package's code are shown again; a key kept among them not."""
    tools = Path(executors.__file__).resolve().parent.parent
    if tools.parent == Path("/tmp"):  # a clone in /tmp: each sandbox has a /tmp of its own
        pytest.skip("the tools lie directly in /tmp: no directory around them to hide")
    key = tools / f".cmbs-test-key-{unique_seconds()}"
    key.write_text("PRIVATE-KEY-AMONG-THE-TOOLS\n")
    try:
        # the directory around the tools hidden too, as a home around a venv would be
        executor = LocalExecutor(
            sandbox="bwrap", hidden=[str(key), str(tools.parent)], workdir_root=str(tmp_path)
        )
        command = f"cat {key}; {sys.executable} -c 'import executors; print(\"tools ok\")'"
        observation = anyio.run(partial(_run_once, executor, command))
    finally:
        key.unlink()
    assert "tools ok" in observation.stdout.text
    assert "PRIVATE" not in observation.stdout.text


async def _run_once(executor: LocalExecutor, command: str) -> Observation:
    async with executor:
        workdir = await executor.prepare(None, {})
        return await executor.run_command(workdir, command, timeout=30)


def _exposed(where: str, outside_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A directory that, writable, would let commands change what is hidden or used."""
    home = outside_tmp / "home"
    (home / ".ssh").mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    tools = Path(executors.__file__).resolve().parent.parent
    return {
        "root": "/",
        "home": str(home),
        "parent of home": str(outside_tmp),
        "tmp": tempfile.gettempdir(),
        "tools": str(tools),
        "parent of tools": str(tools.parent),
    }[where]


@pytest.mark.parametrize("where", ["root", "home", "parent of home", "tmp", "tools"])
def test_a_workdir_that_would_expose_what_is_hidden_is_refused(
    where: str, outside_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The workdir is mounted writable over everything: it must not be ``/``, a home, the
    shared ``/tmp`` (other runs' workdirs) or the interpreter's tree, and the run says so:
    none lies under the workdir root."""
    workdir = _exposed(where, outside_tmp, monkeypatch)
    spec = ScenarioSpec(id="exposed", goal="g", workdir=workdir)
    agent = ScriptedAgent([step("check_status", {"command": "touch cmbs-test-exposed"})])
    before = os.stat(workdir)
    result = anyio.run(partial(_run_closing, spec, agent, LocalExecutor()))
    assert result.outcome is Outcome.EXECUTOR_ERROR
    assert result.reason is not None and "is outside the workdir root" in result.reason
    assert result.trace == []
    assert not (Path(workdir) / "cmbs-test-exposed").exists()
    after = os.stat(workdir)
    assert (after.st_uid, after.st_gid, after.st_mode) == (
        before.st_uid,
        before.st_gid,
        before.st_mode,
    )


@pytest.mark.parametrize("where", ["root", "home", "parent of home", "tools", "parent of tools"])
def test_a_workdir_root_that_would_expose_what_is_hidden_is_refused(
    where: str, outside_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A root is emptied in every sandbox and its workdirs are writable: it cannot be ``/``
    nor hold a home or the tools."""
    root = _exposed(where, outside_tmp, monkeypatch)
    with pytest.raises(ExecutorError, match="the workdir root"):
        LocalExecutor(workdir_root=root)


def test_a_workdir_holding_a_secret_made_since_is_refused(
    outside_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A secret created under a workdir after the executor was made still stops the run."""
    root = outside_tmp / "root"
    data = root / "w" / "data"
    monkeypatch.setenv("XDG_DATA_HOME", str(data))
    executor = LocalExecutor(workdir_root=str(root))
    (data / "cmbs").mkdir(parents=True)
    (data / "cmbs" / "signing_key").write_text("PRIVATE-SIGNING-KEY\n")
    spec = ScenarioSpec(id="exposed", goal="g", workdir=str(root / "w"))
    agent = ScriptedAgent([step("check_status", {"command": "touch cmbs-test-exposed"})])
    result = anyio.run(partial(_run_closing, spec, agent, executor))
    assert result.outcome is Outcome.EXECUTOR_ERROR
    assert result.reason is not None
    assert "give the scenario a directory of its own" in result.reason
    assert result.trace == []
    assert sorted(os.listdir(root / "w")) == ["data"]
    assert (root / "w").stat().st_uid == 0  # not handed to the sandbox user


async def _run_closing(
    spec: ScenarioSpec, agent: ScriptedAgent, executor: LocalExecutor
) -> ScenarioResult:
    async with executor:
        return await run_scenario(spec, agent=agent, executor=executor)


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
