"""The SSH executor against a real OpenSSH sshd on 127.0.0.1 (marker ``ssh``).

asyncssh runs on asyncio only: these tests pin the backend.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from cmbs_async import Gate, Outcome, ScenarioSpec, ScriptedAgent, load_profile, run_scenario
from cmbs_async.demo import demo_agent, demo_scenario
from executors.ssh import (
    SSHAuthRefused,
    SSHExecutor,
    SSHHostKeyRejected,
    SSHTarget,
    SSHUnreachable,
)

from .helpers import live_pids, step
from .sshd import LocalSshd, free_port, sshd_available

pytestmark = [
    pytest.mark.ssh,
    pytest.mark.anyio,
    # CI installs openssh-server: there a missing sshd is a failure, not a skip.
    pytest.mark.skipif(
        not sshd_available() and not os.environ.get("CI"), reason="OpenSSH sshd is not installed"
    ),
]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def sshd() -> Iterator[LocalSshd]:
    with LocalSshd() as server:
        yield server


def target(sshd: LocalSshd, **options: object) -> SSHTarget:
    defaults: dict[str, object] = {
        "identities": (sshd.client_key,),
        "known_hosts": sshd.known_hosts,
    }
    return SSHTarget.parse(sshd.url, **(defaults | options))


@pytest.fixture
async def executor(sshd: LocalSshd) -> object:
    async with SSHExecutor(target(sshd), kill_grace=0.3) as ex:
        yield ex


async def test_a_whole_scenario_runs_over_ssh(executor: SSHExecutor) -> None:
    result = await run_scenario(demo_scenario(), agent=demo_agent(), executor=executor)
    assert result.outcome is Outcome.TERMINATED
    assert result.posture == "non_compliant"
    assert result.trace[3].observed == "exit 2: cannot read sshd_conf"
    assert result.trace[5].observed == "exit 0: false"


async def test_the_remote_workdir_is_confined(executor: SSHExecutor, tmp_path: Path) -> None:
    workdir = tmp_path / "remote"
    outside = tmp_path / "outside"
    outside.mkdir()
    prepared = await executor.prepare(str(workdir), {"a/b.txt": "seeded"})
    assert (workdir / "a" / "b.txt").read_text() == "seeded"
    (workdir / "out").symlink_to(outside)
    (workdir / "victim").symlink_to(outside / "victim")
    for path, reason in [
        ("../escape", "'..'"),
        ("/etc/x", "absolute"),
        ("out/p.yaml", "outside the workdir"),
        ("victim", "symbolic link"),
    ]:
        observation = await executor.write_artifact(prepared, path, "x")
        assert not observation.success and reason in (observation.error or ""), path
    assert list(outside.iterdir()) == []


async def test_a_missing_program_is_unavailable_over_ssh(executor: SSHExecutor) -> None:
    workdir = await executor.prepare(None, {})
    try:
        observation = await executor.run_command(workdir, "cmbs-no-such-opa eval x", timeout=10)
    finally:
        await executor.cleanup(workdir)
    assert observation.exit_status == 127 and observation.program_found is False
    assert "not found" in observation.stderr.text
    assert "cmbs-pgid" not in observation.stderr.text
    gate = Gate(load_profile("ciso"))
    gate.decide(step("execute_opa", {"command": "cmbs-no-such-opa eval x"}))
    gate.observe(observation)
    assert gate.masks.affordances["opa_eval"] == "unavailable"


async def test_deadline_kills_the_remote_process_tree(sshd: LocalSshd, tmp_path: Path) -> None:
    pidfile = tmp_path / "pids"
    command = f"sh -c 'echo $$ >> {pidfile}; exec sleep 60' & echo $$ >> {pidfile}; sleep 60"
    async with SSHExecutor(target(sshd), kill_grace=0.3) as executor:
        started = anyio.current_time()
        result = await run_scenario(
            ScenarioSpec(id="ssh-deadline", goal="g", deadline_s=1.5),
            agent=ScriptedAgent([step("check_status", {"command": command})]),
            executor=executor,
        )
        elapsed = anyio.current_time() - started
    assert result.outcome is Outcome.DEADLINE_EXCEEDED
    assert elapsed < 6
    pids = [int(p) for p in pidfile.read_text().split()]
    assert len(set(pids)) == 2
    assert live_pids(pids) == []  # the host is this machine: nothing of it survives


async def test_a_command_timeout_kills_it_and_says_so(
    executor: SSHExecutor, tmp_path: Path
) -> None:
    pidfile = tmp_path / "pid"
    with anyio.fail_after(10):
        observation = await executor.run_command(
            str(tmp_path), f"echo $$ > {pidfile}; sleep 60", timeout=0.5
        )
    assert observation.timed_out and not observation.success
    assert observation.error == "command timed out after 0.5 s"
    assert live_pids([int(pidfile.read_text())]) == []


async def test_a_background_grandchild_does_not_hold_the_channel(
    executor: SSHExecutor, tmp_path: Path
) -> None:
    pidfile = tmp_path / "pid"
    with anyio.fail_after(5):
        observation = await executor.run_command(
            str(tmp_path), f"sleep 60 & echo $! > {pidfile}; echo done", timeout=30
        )
    assert observation.success and observation.stdout.text == "done\n"
    await anyio.sleep(0.2)
    assert live_pids([int(pidfile.read_text())]) == []


async def test_thirty_concurrent_commands_on_one_connection(executor: SSHExecutor) -> None:
    workdir = await executor.prepare(None, {})
    outputs: dict[int, str] = {}

    async def one(i: int) -> None:
        observation = await executor.run_command(workdir, f"sleep 0.2; echo {i}", timeout=30)
        assert observation.success, observation.error
        outputs[i] = observation.stdout.text

    try:
        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                for i in range(30):
                    tg.start_soon(one, i)
    finally:
        await executor.cleanup(workdir)
    assert outputs == {i: f"{i}\n" for i in range(30)}


async def test_a_wrong_host_key_is_refused(sshd: LocalSshd) -> None:
    wrong = str(Path(sshd.known_hosts).with_name("wrong_known_hosts"))
    async with SSHExecutor(target(sshd, known_hosts=wrong)) as executor:
        with pytest.raises(SSHHostKeyRejected, match="not verified"):
            await executor.prepare(None, {})
        result = await run_scenario(demo_scenario(), agent=demo_agent(), executor=executor)
    assert result.outcome is Outcome.EXECUTOR_ERROR
    assert result.reason == f"host key of {sshd.user}@127.0.0.1:{sshd.port} not verified " + (
        "(unknown host or key mismatch)"
    )


async def test_a_pinned_host_key_is_accepted(sshd: LocalSshd) -> None:
    async with SSHExecutor(target(sshd, known_hosts=None, host_key=sshd.host_public_key)) as ex:
        observation = await ex.run_command("/", "echo pinned", timeout=10)
    assert observation.stdout.text == "pinned\n"


async def test_a_refused_key_and_an_unreachable_host(sshd: LocalSshd) -> None:
    other = str(Path(sshd.client_key).with_name("other_key"))
    async with SSHExecutor(target(sshd, identities=(other,))) as executor:
        with pytest.raises(SSHAuthRefused, match="authentication refused"):
            await executor.prepare(None, {})
    closed = SSHTarget(host="127.0.0.1", port=free_port(), known_hosts=sshd.known_hosts)
    async with SSHExecutor(closed) as executor:
        with pytest.raises(SSHUnreachable, match="cannot reach 127.0.0.1"):
            await executor.prepare(None, {})


async def test_a_dropped_connection_is_an_honest_failure_then_reconnects(
    sshd: LocalSshd,
) -> None:
    async with SSHExecutor(target(sshd)) as executor:
        workdir = await executor.prepare(None, {})

        async def drop_the_connection() -> None:
            await anyio.sleep(0.5)
            assert sshd.process is not None
            found = await anyio.run_process(["pgrep", "-P", str(sshd.process.pid)], check=False)
            children = found.stdout.decode().split()
            for pid in children:
                os.kill(int(pid), signal.SIGKILL)

        async with anyio.create_task_group() as tg:
            tg.start_soon(drop_the_connection)
            observation = await executor.run_command(workdir, "sleep 5; echo late", timeout=20)
        assert not observation.success
        assert observation.error is not None and "lost during the command" in observation.error
        assert "late" not in observation.stdout.text
        again = await executor.run_command(workdir, "echo back", timeout=10)
        assert again.success and again.stdout.text == "back\n"
        await executor.cleanup(workdir)


def test_cli_runs_a_scenario_over_ssh(sshd: LocalSshd, tmp_path: Path) -> None:
    scenario = tmp_path / "s.yaml"
    scenario.write_text(f"id: over-ssh\ngoal: g\nhost: {sshd.url}\nfiles: {{f: hi}}\n")
    steps = tmp_path / "steps.jsonl"
    steps.write_text(step("check_status", {"command": "cat f"}) + "\n")
    base = [sys.executable, "-m", "cmbs_async", "run", str(scenario), "--agent", f"script:{steps}"]
    keys = ["--identity", sshd.client_key, "--known-hosts", sshd.known_hosts, "--json"]
    done = subprocess.run([*base, *keys], capture_output=True, text=True, timeout=60)
    result = json.loads(done.stdout)
    assert done.returncode == 3 and result["outcome"] == "agent_finished", done.stderr
    assert result["trace"][0]["observed"] == "exit 0: hi"

    wrong = str(Path(sshd.known_hosts).with_name("wrong_known_hosts"))
    done = subprocess.run(
        [*base, "--identity", sshd.client_key, "--known-hosts", wrong],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 3
    assert "reason    host key of" in done.stdout and "Traceback" not in done.stderr

    done = subprocess.run(
        [*base, "--identity", sshd.client_key, "--insecure-no-host-key-check", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert json.loads(done.stdout)["trace"][0]["observed"] == "exit 0: hi"
    assert "host_key_check_disabled" in done.stderr
    assert sshd.client_key not in done.stderr + done.stdout
