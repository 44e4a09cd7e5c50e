"""The SSH executor against a real OpenSSH sshd on 127.0.0.1 (marker ``ssh``).

Commands run in a sandbox on the host, each in a PID namespace of its own: what they
start is found here by a unique ``sleep`` argument (:func:`processes_with`), never by a
pid they report. asyncssh runs on asyncio only: these tests pin the backend.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import anyio
import pytest

from cmbs_async import Gate, Outcome, ScenarioSpec, ScriptedAgent, load_profile, run_scenario
from cmbs_async.demo import demo_agent, demo_scenario
from cmbs_async.protocol import CommandEnv, Limits
from executors import ExecutorError
from executors.ssh import (
    CONTAINMENTS,
    SANDBOXES,
    SSHAuthRefused,
    SSHExecutor,
    SSHHostKeyRejected,
    SSHLauncherUnavailable,
    SSHTarget,
    SSHUnreachable,
)

from .helpers import (
    files_under,
    listing,
    needs_visible_venv,
    processes_with,
    step,
    swap_the_workdir_run,
    swapping,
    unique_seconds,
    until,
)
from .sshd import LocalSshd, ThrowawayUser, free_port, sshd_available

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


def gone(path: str) -> bool:
    return not os.path.lexists(path)


def read(path: Path) -> str:
    return path.read_text()


def target(sshd: LocalSshd, **options: object) -> SSHTarget:
    defaults: dict[str, object] = {
        "identities": (sshd.client_key,),
        "known_hosts": sshd.known_hosts,
    }
    return SSHTarget.parse(sshd.url, **(defaults | options))


@pytest.fixture
async def executor(sshd: LocalSshd) -> AsyncIterator[SSHExecutor]:
    async with SSHExecutor(target(sshd), kill_grace=0.3) as ex:
        yield ex


@pytest.fixture(params=CONTAINMENTS)
async def contained(sshd: LocalSshd, request: pytest.FixtureRequest) -> AsyncIterator[SSHExecutor]:
    """The executor held to one containment (each works as root here; ``session-kill``
    only because it is named)."""
    async with SSHExecutor(target(sshd), kill_grace=0.3, containments=(request.param,)) as ex:
        yield ex


async def test_a_whole_scenario_runs_over_ssh(executor: SSHExecutor) -> None:
    needs_visible_venv()
    # the host is this machine: its cmbs-opa is this environment's
    path = f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin"
    spec = demo_scenario().model_copy(update={"env": {"PATH": path}})
    result = await run_scenario(spec, agent=demo_agent(), executor=executor)
    assert result.outcome is Outcome.TERMINATED
    assert result.posture == "non_compliant"
    assert result.trace[3].observed == "exit 2: cannot read sshd_conf"
    assert result.trace[9].observed == "exit 0: false"


async def test_over_ssh_what_ran_is_the_evaluation_and_a_copy_of_the_agents_file_earns_nothing(
    executor: SSHExecutor,
) -> None:
    from .test_provenance import CLAIM, FABRICATIONS, SPEC

    needs_visible_venv()
    path = f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin"
    env = CommandEnv(values={"PATH": path})
    workdir = await executor.prepare(None, {"a.json": "{}"}, env=env)
    try:
        program = await executor.resolve_program(workdir, "cmbs-opa", env=env)
        assert program is not None and program.path == str(Path(sys.executable).parent / "cmbs-opa")
        copied = await executor.run_command(workdir, "cp a.json b.json", timeout=10)
        assert [(c.path, c.change) for c in copied.changes] == [("b.json", "created")]
        ran = await executor.run_program(
            workdir, [program.path, "eval", "-i", "b.json", "--format", "raw", "input"],
            timeout=10, inputs=["b.json", "../x"],
        )  # fmt: skip
        assert ran.argv is not None and ran.argv[0] == program.path and ran.stdout.text == "{}\n"
        assert ran.inputs[0].sha256 == copied.changes[0].sha256
        assert ran.inputs[1].outside == "a path that leaves the workdir"
    finally:
        await executor.cleanup(workdir)
    spec = SPEC.model_copy(update={"env": {"PATH": path}})
    result = await run_scenario(
        spec, agent=ScriptedAgent(FABRICATIONS["cp"] + CLAIM), executor=executor
    )
    assert result.posture is None and result.masks is not None
    assert result.masks.posture_admissible == {"compliant": True, "non_compliant": True}


async def test_prepare_proves_the_sandbox_with_its_canary(executor: SSHExecutor) -> None:
    workdir = await executor.prepare(None, {}, env=CommandEnv(network="none"))
    try:
        containment = executor.containment_of(workdir)
    finally:
        await executor.cleanup(workdir)
    assert containment.sandbox == "pidns" and executor.containment == "pidns"
    assert containment.user == "root (no capabilities)"
    assert containment.network == "none"
    assert containment.limits == {"tmp": 256 << 20, "shm": 64 << 20}
    tried = {(check.name, check.target) for check in containment.canary}
    assert {("create a file", "~"), ("create a file", "/etc"), ("create a file", "/tmp")} <= tried
    assert ("signal the launcher", "its own process namespace") in tried
    assert ("reach the network", "192.0.2.1:9") in tried
    assert containment.leaks == ()
    assert gone(workdir)


async def test_the_private_tmp_has_the_declared_size(executor: SSHExecutor) -> None:
    small = CommandEnv(limits=Limits(tmp="1MiB", shm="1MiB"))
    workdir = await executor.prepare(None, {}, env=small)
    limits = executor.containment_of(workdir).limits
    fill = "head -c 2097152 /dev/zero > /tmp/big; echo $?; head -c 2097152 /dev/zero > big"
    observation = await executor.run_command(workdir, f"{fill}; echo $?", timeout=30)
    await executor.cleanup(workdir)
    assert limits == {"tmp": 1 << 20, "shm": 1 << 20}
    assert observation.stdout.text == "1\n0\n"  # /tmp is full at 1 MiB; the workdir is not
    assert "No space left on device" in observation.stderr.text


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
    await executor.cleanup(prepared, remove=False)
    assert (workdir / "a" / "b.txt").read_text() == "seeded"


async def test_a_workdir_holding_the_login_home_is_refused(executor: SSHExecutor) -> None:
    for workdir, guarded in (("/", "/"), ("/root", "/root"), ("/etc/cmbs", "/etc")):
        with pytest.raises(ExecutorError, match=f"would let commands change {guarded}:"):
            await executor.prepare(workdir, {})
    assert gone("/etc/cmbs")


async def test_a_missing_program_is_unavailable_over_ssh(executor: SSHExecutor) -> None:
    workdir = await executor.prepare(None, {})
    try:
        observation = await executor.run_command(workdir, "cmbs-no-such-opa eval x", timeout=10)
    finally:
        await executor.cleanup(workdir)
    assert observation.exit_status == 127 and observation.program_found is False
    assert "not found" in observation.stderr.text
    profile = load_profile("ciso")  # with the missing program as the only provider
    gate = Gate(profile.model_copy(update={"providers": {"opa_eval": ("cmbs-no-such-opa",)}}))
    gate.decide(step("execute_opa", {"command": "cmbs-no-such-opa eval x"}))
    gate.observe(observation)
    assert gate.masks.affordances["opa_eval"] == "unavailable"


async def test_deadline_kills_the_remote_process_tree(sshd: LocalSshd, marker: str) -> None:
    command = f"sh -c 'exec sleep {marker}' & setsid sleep {marker} & sleep {marker}"
    async with SSHExecutor(target(sshd), kill_grace=0.3) as executor:
        started = anyio.current_time()
        result = await run_scenario(
            ScenarioSpec(id="ssh-deadline", goal="g", deadline_s=4),
            agent=ScriptedAgent([step("check_status", {"command": command})]),
            executor=executor,
        )
        elapsed = anyio.current_time() - started
    assert result.outcome is Outcome.DEADLINE_EXCEEDED
    assert elapsed < 10
    assert processes_with(marker) == []  # the host is this machine: nothing of it survives


async def test_a_command_timeout_kills_it_and_says_so(executor: SSHExecutor, marker: str) -> None:
    workdir = await executor.prepare(None, {})
    # A time-out long enough for a loaded machine to start the command.
    with anyio.fail_after(20):
        observation = await executor.run_command(
            workdir, f"echo started; sleep {marker}", timeout=3
        )
    await executor.cleanup(workdir)
    assert observation.timed_out and not observation.success
    assert observation.error == "command timed out after 3 s"
    assert observation.stdout.text == "started\n"
    assert processes_with(marker) == []


async def test_a_background_grandchild_does_not_hold_the_channel(
    executor: SSHExecutor, marker: str
) -> None:
    workdir = await executor.prepare(None, {})
    with anyio.fail_after(10):
        observation = await executor.run_command(
            workdir,
            f"sh -c 'exec sleep {marker}' & "
            f"until pgrep -f 'slee[p] {marker}' >/dev/null; do sleep 0.01; done; echo done",
            timeout=30,
        )
    await executor.cleanup(workdir)
    assert observation.success and observation.stdout.text == "done\n"
    assert await until(lambda: not processes_with(marker)), "the grandchild still runs"


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


async def test_more_scenarios_than_channels_run_at_once(sshd: LocalSshd) -> None:
    """Each prepared workdir holds a channel (its launcher): past ``max_channels`` the
    executor opens another connection instead of making scenarios wait."""
    outputs: dict[int, str] = {}
    all_ran = anyio.Event()
    async with SSHExecutor(target(sshd), max_channels=3) as executor:

        async def scenario(i: int) -> None:
            workdir = await executor.prepare(None, {"n": str(i)})
            observation = await executor.run_command(workdir, "cat n", timeout=30)
            outputs[i] = observation.stdout.text
            if len(outputs) == 7:
                all_ran.set()
            await all_ran.wait()  # every workdir held until all have run a command
            await executor.cleanup(workdir)

        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                for i in range(7):
                    tg.start_soon(scenario, i)
    assert outputs == {i: str(i) for i in range(7)}


async def test_two_scenarios_share_a_workdir_until_the_last_cleans_up(
    executor: SSHExecutor, tmp_path: Path
) -> None:
    shared = str(tmp_path / "shared")
    first = await executor.prepare(shared, {"a": "1"})
    second = await executor.prepare(shared, {"b": "2"})
    with pytest.raises(ExecutorError, match="is in use with another sandbox"):
        await executor.prepare(shared, {}, env=CommandEnv(network="none"))
    await executor.cleanup(first)
    observation = await executor.run_command(second, "cat a b", timeout=30)
    await executor.cleanup(second)
    assert first == second == shared
    assert observation.stdout.text == "12"
    assert gone(shared)


async def test_output_is_capped_head_and_tail(sshd: LocalSshd) -> None:
    async with SSHExecutor(target(sshd), output_cap=1000) as executor:
        workdir = await executor.prepare(None, {})
        observation = await executor.run_command(workdir, "seq 1 100000; echo end >&2", timeout=30)
        await executor.cleanup(workdir)
    out = observation.stdout
    assert out.truncated and out.total_bytes == len("".join(f"{i}\n" for i in range(1, 100001)))
    assert out.head.startswith("1\n2\n3\n") and out.tail.endswith("99999\n100000\n")
    assert len(out.head) == len(out.tail) == 500
    assert observation.stderr.text == "end\n"


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
        workdir = await ex.prepare(None, {})
        observation = await ex.run_command(workdir, "echo pinned", timeout=10)
        await ex.cleanup(workdir)
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

        started = Path(workdir, "started")

        async def drop_the_connection() -> None:
            assert await until(started.exists, within=30)  # the command runs
            assert sshd.process is not None
            found = await anyio.run_process(["pgrep", "-P", str(sshd.process.pid)], check=False)
            children = found.stdout.decode().split()
            for pid in children:
                os.kill(int(pid), signal.SIGKILL)

        async with anyio.create_task_group() as tg:
            tg.start_soon(drop_the_connection)
            observation = await executor.run_command(
                workdir, "touch started; sleep 5; echo late", timeout=20
            )
        assert not observation.success
        assert observation.error is not None and "lost during the command" in observation.error
        assert "late" not in observation.stdout.text
        again = await executor.run_command(workdir, "cat started && echo back", timeout=10)
        assert again.success and again.stdout.text == "back\n"
        assert executor.containment_of(workdir).sandbox == "pidns"  # rebuilt and proven
        await executor.cleanup(workdir)
    assert gone(workdir)


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


# -- what a hostile command leaves behind -----------------------------------------------

#: What a command may start to outlive itself, each around ``sleep MARKER``.
LEFTOVERS = {
    "background job": "sleep {} &",
    "TERM-ignoring job": "sh -c 'trap \"\" TERM; sleep {}' &",
    "setsid": "setsid sleep {} &",
    "double fork": "(sh -c 'sleep {} &' &);",
    "nohup": "nohup sleep {} >/dev/null 2>&1 &",
}


@pytest.fixture
def markers() -> Iterator[dict[str, str]]:
    """A unique ``sleep`` argument per leftover; whatever still runs with one is killed after."""
    chosen = {name: unique_seconds() for name in LEFTOVERS}
    yield chosen
    for marker in chosen.values():
        for pid in processes_with(marker):
            os.kill(pid, signal.SIGKILL)


def launch_and_confirm(markers: dict[str, str]) -> str:
    """Shell code starting every leftover, then printing how many it saw running (its own
    process table; ``slee[p]`` keeps pgrep from matching itself)."""
    launch = " ".join(LEFTOVERS[name].format(marker) for name, marker in markers.items())
    patterns = " ".join(f"'slee[p] {marker}'" for marker in markers.values())
    return (
        f"{launch} i=0; while :; do n=0; for m in {patterns}; do "
        'pgrep -f "$m" >/dev/null && n=$((n+1)); done; '
        f"[ $n = {len(markers)} ] || [ $i = 200 ] && break; sleep 0.05; i=$((i+1)); done; "
        "echo running=$n"
    )


async def survivors(markers: dict[str, str]) -> dict[str, list[int]]:
    """The leftovers still running after a moment's grace for the kernel to reap them."""
    await until(lambda: not any(processes_with(marker) for marker in markers.values()))
    return {name: pids for name, marker in markers.items() if (pids := processes_with(marker))}


async def test_nothing_a_command_starts_outlives_it(
    contained: SSHExecutor, markers: dict[str, str]
) -> None:
    workdir = await contained.prepare(None, {})
    observation = await contained.run_command(workdir, launch_and_confirm(markers), timeout=60)
    assert all(processes_with(marker) == [] for marker in markers.values())  # already
    await contained.cleanup(workdir)
    assert observation.stdout.text == f"running={len(markers)}\n", observation.stderr.text
    assert observation.success
    assert contained.containment == contained.containments[0]
    assert await survivors(markers) == {}


async def test_a_time_out_kills_what_ignores_term_or_left_the_session(
    contained: SSHExecutor, markers: dict[str, str]
) -> None:
    workdir = await contained.prepare(None, {})
    command = f"{launch_and_confirm(markers)}; trap '' TERM; sleep 60"
    with anyio.fail_after(30):
        observation = await contained.run_command(workdir, command, timeout=5)
    assert observation.timed_out
    assert observation.stdout.text == f"running={len(markers)}\n", observation.stderr.text
    assert await survivors(markers) == {}
    await contained.cleanup(workdir)


async def test_a_dropped_connection_ends_the_remote_command(
    sshd: LocalSshd, markers: dict[str, str], containment: str
) -> None:
    async with SSHExecutor(target(sshd), containments=(containment,)) as executor:
        workdir = await executor.prepare(None, {})

        async def kill_the_sshd_child_once_all_run() -> None:
            assert await until(lambda: all(processes_with(m) for m in markers.values()), within=50)
            assert sshd.process is not None
            found = await anyio.run_process(["pgrep", "-P", str(sshd.process.pid)], check=False)
            for pid in found.stdout.decode().split():
                os.kill(int(pid), signal.SIGKILL)

        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                tg.start_soon(kill_the_sshd_child_once_all_run)
                observation = await executor.run_command(
                    workdir, f"{launch_and_confirm(markers)}; sleep 60", timeout=None
                )
        await executor.cleanup(workdir)
    assert observation.error == f"connection to {target(sshd).label} lost during the command"
    assert await survivors(markers) == {}
    assert gone(workdir)  # removed by a fresh launcher


@pytest.fixture(params=CONTAINMENTS)
def containment(request: pytest.FixtureRequest) -> str:
    return str(request.param)


async def test_the_containment_is_known_once_prepared(sshd: LocalSshd) -> None:
    executor = SSHExecutor(target(sshd))
    assert executor.containment == "unknown" and executor.containments == SANDBOXES
    async with executor:
        workdir = await executor.prepare(None, {})
        await executor.cleanup(workdir)
        assert executor.containment == "pidns"  # the fixture's sshd logs in as root
    with pytest.raises(ValueError, match="containments must be some of"):
        SSHExecutor(target(sshd), containments=("chroot",))


@pytest.fixture(scope="module")
def user_sshd() -> Iterator[LocalSshd]:
    """An sshd logging in as a throwaway user without root, whose shell is /bin/sh."""
    with ThrowawayUser("cmbstest") as user, LocalSshd(user=user) as server:
        yield server


@pytest.mark.skipif(os.geteuid() != 0, reason="adding a throwaway user needs root")
async def test_a_login_without_root_gets_the_sandbox_it_may_use(
    user_sshd: LocalSshd, markers: dict[str, str]
) -> None:
    # unshare needs CAP_SYS_ADMIN; bwrap works where unprivileged user namespaces do
    bwrap = ["bwrap", "--ro-bind", "/", "/", "--unshare-pid", "--", "true"]
    allowed = await anyio.run_process(["su", user_sshd.user, "-c", shlex.join(bwrap)], check=False)
    async with SSHExecutor(target(user_sshd)) as executor:
        if allowed.returncode != 0:
            with pytest.raises(ExecutorError, match="allows none of the containments"):
                await executor.prepare(None, {})
            return
        workdir = await executor.prepare(None, {})
        containment = executor.containment_of(workdir)
        observation = await executor.run_command(workdir, launch_and_confirm(markers), timeout=60)
        whoami = await executor.run_command(workdir, "id -un; echo $HOME", timeout=60)
        await executor.cleanup(workdir)
    assert containment.sandbox == "bwrap" and containment.user == user_sshd.user
    assert containment.leaks == ()
    assert whoami.stdout.text == f"{user_sshd.user}\n/tmp/home\n"
    assert observation.stdout.text == f"running={len(markers)}\n", observation.stderr.text
    assert await survivors(markers) == {}
    async with SSHExecutor(target(user_sshd), containments=("pidns",)) as executor:
        with pytest.raises(ExecutorError, match="allows none of the containments pidns"):
            await executor.prepare(None, {})


# -- a login shell that talks first ------------------------------------------------------

#: What a chatty profile or a ForceCommand wrapper prints before any command, on stdout
#: and stderr, the last line unfinished and more than a read's worth.
NOISE = "Last login: never\n" + "x" * 70_000 + "\nno newline here"


@pytest.fixture(scope="module")
def noisy_sshd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSshd]:
    noise = tmp_path_factory.mktemp("motd") / "noise"
    noise.write_text(NOISE)
    force = f'ForceCommand cat {noise}; cat {noise} >&2; eval "$SSH_ORIGINAL_COMMAND"\n'
    with LocalSshd(extra_config=force) as server:
        yield server


async def test_the_launcher_is_found_after_what_the_login_shell_prints(
    noisy_sshd: LocalSshd, marker: str
) -> None:
    async with SSHExecutor(target(noisy_sshd), kill_grace=0.3, output_cap=1 << 20) as executor:
        workdir = await executor.prepare(None, {})
        plain = await executor.run_command(workdir, "echo out; echo err >&2", timeout=30)
        timed = await executor.run_command(
            workdir, f"trap 'echo term > got-term; exit 0' TERM; sleep {marker}", timeout=1
        )
        flag = read(Path(workdir, "got-term"))
        await executor.cleanup(workdir)
    assert plain.success and plain.stdout.text == "out\n"
    assert plain.stderr.text == "err\n"  # the login's noise is not the command's
    assert timed.timed_out
    assert flag == "term\n"  # the group got TERM before the KILL
    assert processes_with(marker) == []


@pytest.fixture(scope="module")
def pythonless_sshd() -> Iterator[LocalSshd]:
    """An sshd whose sessions find no python3 (each hidden under /dev/null)."""
    hide = (
        "for f in /usr/bin/python3* /usr/libexec/platform-python*; do "
        '[ -e "$f" ] && mount --bind /dev/null "$f"; done; PATH=/usr/bin:/bin; '
        'eval "$SSH_ORIGINAL_COMMAND"'
    )
    force = f"ForceCommand unshare --mount --propagation private sh -c {shlex.quote(hide)}\n"
    with LocalSshd(extra_config=force) as server:
        yield server


async def test_a_host_without_python3_is_a_clear_error(pythonless_sshd: LocalSshd) -> None:
    async with SSHExecutor(target(pythonless_sshd)) as executor:
        with pytest.raises(SSHLauncherUnavailable) as refused:
            await executor.prepare(None, {})
    label = target(pythonless_sshd).label
    assert str(refused.value) == f"{label} has no python3: the SSH executor's launcher needs it"


# -- artifacts a hostile command prepared for ---------------------------------------------


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A directory outside every workdir; it holds one file the attacks must not touch."""
    directory = tmp_path / "outside"
    directory.mkdir()
    (directory / "keep").write_text("keep")
    return directory


async def test_a_hard_link_to_a_file_outside_is_replaced_not_written_through(
    executor: SSHExecutor, tmp_path: Path
) -> None:
    victim = tmp_path / "victim"
    victim.write_text("secret")
    workdir = await executor.prepare(str(tmp_path / "work"), {})
    # the sandbox sees no file outside to link (another mount: EXDEV); someone else may
    linked = await executor.run_command(workdir, "ln /etc/hostname hl", timeout=30)
    assert not linked.success and "Invalid cross-device link" in linked.stderr.text
    os.link(victim, tmp_path / "work" / "hl")

    observation = await executor.write_artifact(workdir, "hl", "new")

    assert observation.success
    assert victim.read_text() == "secret" and victim.stat().st_nlink == 1
    assert (tmp_path / "work" / "hl").read_text() == "new"
    await executor.cleanup(workdir, remove=False)


async def test_a_sandboxed_command_cannot_swap_its_workdir(sshd: LocalSshd, outside: Path) -> None:
    spec, agent = swap_the_workdir_run(outside)
    async with SSHExecutor(target(sshd)) as executor:
        result = await run_scenario(spec, agent=agent, executor=executor)
    assert result.outcome is Outcome.AGENT_FINISHED, result.reason
    # its workdir is a mount point there: it stays (the link lands inside it)
    assert "Device or resource busy" in result.trace[0].stderr
    assert result.trace[1].observed == "wrote check.sh"
    assert listing(outside) == ["keep"]


async def test_a_workdir_swapped_for_a_link_ends_the_run_in_executor_error(
    sshd: LocalSshd, outside: Path
) -> None:
    spec, agent = swap_the_workdir_run(outside)
    # only without a sandbox can a command replace its own workdir
    async with SSHExecutor(target(sshd), containments=("session-kill",)) as executor:
        result = await run_scenario(spec, agent=agent, executor=executor)
    assert result.outcome is Outcome.EXECUTOR_ERROR
    assert result.reason is not None
    assert result.reason.startswith("workdir /tmp/cmbs-")
    assert result.reason.endswith(" was deleted or replaced during the run")
    assert listing(outside) == ["keep"]
    left = result.reason.split()[1]  # the agent's link, which cleanup leaves alone
    assert os.readlink(left) == str(outside)
    os.unlink(left)


async def test_a_workdir_not_prepared_here_is_checked_from_its_first_write(
    executor: SSHExecutor, tmp_path: Path, outside: Path
) -> None:
    workdir = tmp_path / "work"
    workdir.mkdir()
    assert (await executor.write_artifact(str(workdir), "a", "1")).success
    workdir.rename(tmp_path / "moved")
    workdir.symlink_to(outside)
    with pytest.raises(ExecutorError, match="was deleted or replaced during the run"):
        await executor.write_artifact(str(workdir), "a", "2")
    assert listing(outside) == ["keep"]


async def test_a_daemon_swapping_a_directory_for_a_link_gets_nothing_outside(
    executor: SSHExecutor, tmp_path: Path, outside: Path
) -> None:
    workdir = await executor.prepare(str(tmp_path / "work"), {})
    written = set()
    with swapping(workdir, outside):
        for i in range(200):
            observation = await executor.write_artifact(workdir, f"sub/f{i}", str(i))
            if observation.success:
                written.add(i)
            else:
                assert observation.error is not None and f"'sub/f{i}'" in observation.error
    assert listing(outside) == ["keep"]
    assert files_under(workdir) == {f"f{i}": str(i) for i in written}
    await executor.cleanup(workdir)


async def test_a_scenarios_declared_environment_reaches_remote_commands(
    executor: SSHExecutor, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KUBECONFIG", "/etc/kube/config")
    monkeypatch.setenv("CMBS_AGENT_API_KEY", "sk-agent-secret")
    declared = CommandEnv(values={"SCENARIO_VAR": "a b'c"}, pass_env=("KUBECONFIG",))
    workdir = await executor.prepare(None, {}, env=declared)
    observation = await executor.run_command(workdir, "env", timeout=30, env=declared)
    await executor.cleanup(workdir)
    assert observation.success
    assert "SCENARIO_VAR=a b'c" in observation.stdout.text
    assert "KUBECONFIG=/etc/kube/config" in observation.stdout.text
    assert "sk-agent-secret" not in observation.stdout.text
    assert "SSH_AUTH_SOCK" not in observation.stdout.text
