"""Each promise of the local containment, tried as a hostile agent would, with real
processes and a real bubblewrap, checked on the host afterwards (its process table, its
files, its control groups).

What a scenario's commands get: one sandbox per scenario, commands as an unprivileged
user (as root: one of the scenario's own, no account of the host) with no capability,
each the init of a PID namespace of its own; nothing writable but the workdir; the other
workdirs of the root out of sight, and another executor's out of reach; the operator's
signing key and audit database out of reach; the scenario's limits (processes, memory,
``/tmp``, ``/dev/shm``) its own; with ``network: none``, no socket that reaches anything;
and a canary that proves all of it before the agent's first step, failing closed when
the sandbox leaks. Nothing a sandbox ran, nor the sandbox, outlives its cleanup.
"""

from __future__ import annotations

import hashlib
import os
import pwd
import re
import shutil
import signal
import socket
import sqlite3
import stat
import subprocess
import sys
import tempfile
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import anyio
import pytest

from cmbs_async import (
    CallableAgent,
    Outcome,
    ScenarioSpec,
    ScriptedAgent,
    SQLiteAuditStore,
    Turn,
    load_or_create_key,
    run_scenario,
)
from cmbs_async.audit.store import RecordKind
from executors import ExecutorError, LocalExecutor
from executors.errors import SandboxLeak
from executors.observation import CommandEnv, Limits, Observation
from executors.sandbox import find_bwrap

from .helpers import live_pids, processes_with, step, unique_seconds, until

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.skipif(
        os.geteuid() != 0 or find_bwrap() is None,
        reason="the sandbox's user, limits and control groups need root and bubblewrap",
    ),
]

PYTHON = os.path.realpath(sys.executable)
#: The names the canary gives what it tries, as the containment report lists them.
CANARY = {
    "write outside the workdir",
    "read a hidden path",
    "read a root-only file",
    "hold a capability",
    "run as root",
}
ROOT_ONLY = [
    path
    for path in ("/etc/shadow", "/etc/gshadow", "/etc/ssh/ssh_host_ed25519_key")
    if os.path.exists(path) and not os.stat(path).st_mode & 0o044
]


@pytest.fixture
async def executor(tmp_path: Path) -> AsyncIterator[LocalExecutor]:
    async with LocalExecutor(
        sandbox="bwrap", workdir_root=str(tmp_path), kill_grace=0.3
    ) as executor:
        yield executor


@pytest.fixture
def visible() -> Iterator[Path]:
    """A directory outside ``/tmp`` anyone may look into: the sandbox shows it, read-only."""
    path = Path(tempfile.mkdtemp(prefix="cmbs-test-", dir="/var/tmp"))
    path.chmod(0o755)
    yield path
    subprocess.run(["chattr", "-R", "-i", str(path)], capture_output=True, check=False)
    shutil.rmtree(path)


async def run(
    executor: LocalExecutor, workdir: str, command: str, env: CommandEnv | None = None
) -> Observation:
    return await executor.run_command(workdir, command, timeout=60, env=env)


def said(observation: Observation) -> str:
    return observation.stdout.text + observation.stderr.text


def sandbox_uid(executor: LocalExecutor, workdir: str) -> int:
    """Who ``workdir``'s commands run as, as its containment report says ("name (uid)")."""
    user = executor.containment_of(workdir).user
    found = re.fullmatch(r".* \((\d+)\)", user or "")
    assert found is not None, user
    return int(found.group(1))


def host_account(uid: int) -> str | None:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return None


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# What the host holds, looked at from here (quick calls on local files).


def on_host(*parts: str | Path) -> bool:
    return os.path.lexists(os.path.join(*parts))


def host_text(*parts: str | Path) -> str:
    return Path(*parts).read_text()


def host_listing(path: str | Path) -> list[str]:
    return sorted(os.listdir(path))


# -- who commands run as ------------------------------------------------------------------


async def test_commands_run_as_an_unprivileged_user_without_any_capability(
    executor: LocalExecutor,
) -> None:
    workdir = await executor.prepare(None, {})
    uid = sandbox_uid(executor, workdir)
    observation = await run(
        executor,
        workdir,
        "id -u; id -g; grep -E '^(Cap[A-Za-z]+|NoNewPrivs):' /proc/self/status",
    )
    lines = observation.stdout.text.split("\n")
    assert uid != 0 and lines[:2] == [str(uid), str(uid)]
    for kind in ("Inh", "Prm", "Eff", "Bnd", "Amb"):  # none now, and none to be had later
        assert f"Cap{kind}:\t0000000000000000" in lines
    assert "NoNewPrivs:\t1" in lines


async def test_each_scenario_runs_as_a_user_of_its_own_that_owns_nothing_here(
    executor: LocalExecutor,
) -> None:
    """As root, no account of the host: each scenario's files are its own, out of the
    others' reach even where their directories can be searched."""
    if executor.user is not None:
        pytest.skip(f"every command runs as the one user {executor.user}")
    workdirs = [await executor.prepare(None, {}) for _ in range(3)]
    uids = [sandbox_uid(executor, workdir) for workdir in workdirs]
    assert len(set(uids)) == 3 and 0 not in uids
    assert [host_account(uid) for uid in uids] == [None] * 3
    observed = [await run(executor, workdir, "id -u") for workdir in workdirs]
    assert [o.stdout.text for o in observed] == [f"{uid}\n" for uid in uids]


@pytest.mark.skipif(not ROOT_ONLY, reason="no file only root may read")
async def test_a_root_only_file_cannot_be_read(executor: LocalExecutor) -> None:
    workdir = await executor.prepare(None, {})
    files = " ".join(ROOT_ONLY)
    observation = await run(executor, workdir, f"cat {files}; base64 {files}; cp {files} .")
    assert observation.stdout.text == ""
    assert observation.stderr.text.count("Permission denied") >= 3 * len(ROOT_ONLY)
    assert os.listdir(workdir) == []
    for path in ROOT_ONLY:  # what the host holds there is nowhere in what the command said
        first = host_text(path).splitlines()[0]
        assert first not in said(observation)


@pytest.mark.skipif(shutil.which("setcap") is None, reason="setcap is not installed")
async def test_a_setuid_or_file_capability_program_gains_nothing(
    executor: LocalExecutor, visible: Path
) -> None:
    """Programs the host would run with privileges (set up here as root, as an attacker
    would hope to find them): inside, no new privilege is ever granted."""
    suid, cat, python = visible / "suid-id", visible / "cap-cat", visible / "cap-python"
    shutil.copy("/usr/bin/id", suid)
    suid.chmod(0o4755)
    shutil.copy("/bin/cat", cat)
    shutil.copy(PYTHON, python)
    for program, caps in (
        (cat, "cap_dac_read_search+eip"),
        (python, "cap_setuid,cap_sys_admin+eip"),
    ):
        await anyio.run_process(["setcap", caps, str(program)])
    workdir = await executor.prepare(None, {})
    uid = sandbox_uid(executor, workdir)
    become_root = f"{python} -c 'import os; os.setuid(0); print(\"ROOT\")'"
    observation = await run(
        executor, workdir, f"{suid} -u; {cat} /etc/shadow; {become_root}; su -c id root </dev/null"
    )
    assert observation.stdout.text == f"{uid}\n"
    assert "/etc/shadow: Permission denied" in observation.stderr.text
    assert "PermissionError" in observation.stderr.text and "ROOT" not in said(observation)


# -- one PID namespace per command ----------------------------------------------------------


async def test_each_command_is_alone_in_its_own_pid_namespace(executor: LocalExecutor) -> None:
    """A command sees only its own processes and cannot signal another command's."""
    workdir = await executor.prepare(None, {})
    mark = unique_seconds()
    async with anyio.create_task_group() as tg:
        tg.start_soon(run, executor, workdir, f"sleep {mark}")
        assert await until(lambda: len(processes_with(mark)) == 1, within=30)
        observation = await run(
            executor,
            workdir,
            "echo $$; tr '\\0' ' ' </proc/1/cmdline; echo; ls /proc | grep -c '^[0-9]'; "
            "pkill sleep; kill -KILL -1",
        )
        assert processes_with(mark) != []  # the other command's sleep is still there
        tg.cancel_scope.cancel()
    pid, init, count = observation.stdout.text.splitlines()[:3]
    assert pid == "1" and init.startswith("/bin/sh ")
    assert int(count) < 10  # a fresh /proc: no process of the host nor of another command
    assert await until(lambda: processes_with(mark) == [])


# -- what commands can write and see ------------------------------------------------------


async def test_nothing_outside_the_workdir_can_be_written(
    executor: LocalExecutor, tmp_path: Path, visible: Path
) -> None:
    os.chmod(visible, 0o1777)  # anyone may write here on the host: only the sandbox stops it
    mine = await executor.prepare(None, {})
    other = await executor.prepare(None, {"secret.txt": "OTHER-SCENARIO\n"})
    marker = f"cmbs-test-{unique_seconds()}"
    targets = ["/", "/etc", "/usr", "/var/tmp", str(visible), str(tmp_path), other]
    attempt = "; ".join(f"touch {t}/{marker}; mkdir {t}/{marker}.d" for t in targets)
    observation = await run(
        executor, mine, f"{attempt}; touch /tmp/{marker} /dev/shm/{marker} {marker}"
    )
    for target in targets:
        assert not on_host(target, marker) and not on_host(target, f"{marker}.d")
    assert observation.stderr.text.count("Read-only file system") >= 4
    assert not on_host("/tmp", marker) and not on_host("/dev/shm", marker)
    assert os.listdir(mine) == [marker]  # its own workdir it may write, and nothing else
    assert os.listdir(other) == ["secret.txt"]


async def test_another_scenarios_workdir_under_the_root_is_out_of_sight(
    executor: LocalExecutor, tmp_path: Path
) -> None:
    mine = await executor.prepare(None, {})
    other = await executor.prepare("other", {"secret.txt": "OTHER-SCENARIO\n"})
    observation = await run(
        executor,
        mine,
        f"ls -a {tmp_path}; ls {other}; cat {other}/secret.txt; cd {other}; "
        f"test -e {other} || echo UNSEEN",
    )
    names = observation.stdout.text.split()
    assert names[:3] == [".", "..", os.path.basename(mine)]  # the root holds only its own
    assert "UNSEEN" in names and "OTHER-SCENARIO" not in said(observation)
    assert observation.stderr.text.count("No such file or directory") >= 2


async def test_another_executors_scenario_is_out_of_reach(visible: Path) -> None:
    """Two executors (two cmbs processes, say), each with its root in a directory anyone
    may search: the other's workdir is seen, but is another user's."""
    roots = [visible / "a", visible / "b"]
    for root in roots:
        root.mkdir(mode=0o755)
    async with (
        LocalExecutor(workdir_root=str(roots[0])) as mine,
        LocalExecutor(workdir_root=str(roots[1])) as theirs,
    ):
        workdir = await mine.prepare(None, {})
        other = await theirs.prepare(None, {"secret.txt": "OTHER-SCENARIO\n"})
        observation = await run(
            mine, workdir, f"cat {other}/secret.txt; ls {other}; touch {other}/new"
        )
        assert host_listing(other) == ["secret.txt"]
    assert "OTHER-SCENARIO" not in said(observation) and not observation.stdout.text
    assert "Permission denied" in observation.stderr.text


async def test_seeded_files_and_artifacts_are_the_sandbox_users(executor: LocalExecutor) -> None:
    workdir = await executor.prepare(None, {"etc/sshd_config": "X11Forwarding yes\n"})
    assert (await executor.write_artifact(workdir, "policies/p.rego", "package p\n")).success
    uid = sandbox_uid(executor, workdir)
    for path in ("", "etc", "etc/sshd_config", "policies", "policies/p.rego"):
        assert os.stat(os.path.join(workdir, path)).st_uid == uid != 0, path
    observation = await run(
        executor, workdir, "echo more >> etc/sshd_config && rm policies/p.rego && echo ok"
    )
    assert observation.success and observation.stdout.text == "ok\n"
    assert host_text(workdir, "etc/sshd_config") == "X11Forwarding yes\nmore\n"


async def test_the_signing_key_and_the_audit_database_are_out_of_reach(
    tmp_path: Path, visible: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the operator keeps them anyone may look (a shared disk, say): the key in the
    cmbs data directory, hidden by default; the database named in ``hidden``."""
    monkeypatch.setenv("XDG_DATA_HOME", str(visible / "data"))
    key_path = visible / "data" / "cmbs" / "signing_key"
    key = load_or_create_key(key_path)
    (visible / "data").chmod(0o755)
    key_path.parent.chmod(0o755)
    key_path.chmod(0o644)  # even readable by anyone on the host
    db = visible / "audit" / "audit.db"
    store = SQLiteAuditStore(db, key=key)
    done = await run_scenario(
        ScenarioSpec(id="recorded-earlier", goal="g"),
        agent=ScriptedAgent([step("terminate")]),
        audit=store,
    )
    assert done.session_id is not None
    for path in (db.parent, *db.parent.iterdir()):
        path.chmod(0o777 if path.is_dir() else 0o666)  # even writable by anyone on the host
    key_before, db_before = digest(key_path), digest(db)
    hidden = [f"{db}{suffix}" for suffix in ("", "-wal", "-shm", "-journal")]
    sql = (
        "import sqlite3, sys; c = sqlite3.connect(sys.argv[1]); "
        "print(c.execute('select count(*) from records').fetchall()); "
        "c.execute('create table pwned(x)'); c.commit(); print('WROTE')"
    )
    command = (
        f"cat {key_path}; cat {db} {db}-wal; "
        f'{PYTHON} -c \'open("{key_path}", "w").write("x")\'; echo x >> {key_path}; '
        f'{PYTHON} -c "{sql}" {db}; rm -f {key_path} {db}; cp {db} copied.db; '
        f"ls -la {key_path.parent} {db.parent}"
    )
    async with LocalExecutor(workdir_root=str(tmp_path), hidden=hidden) as executor:
        workdir = await executor.prepare(None, {})
        observation = await run(executor, workdir, command)
        hidden_checks = [
            check.target
            for check in executor.containment_of(workdir).canary
            if check.name == "read a hidden path"
        ]
    seen = said(observation)
    assert str(key_path.parent) in hidden_checks and str(db) in hidden_checks
    secret = key_path.read_text().splitlines()[1][:24]
    assert secret not in seen and "recorded-earlier" not in seen and "WROTE" not in seen
    assert "PermissionError" in seen or "Read-only file system" in seen
    assert digest(key_path) == key_before and digest(db) == db_before
    store.close()
    with sqlite3.connect(db) as check:
        tables = {row[0] for row in check.execute("select name from sqlite_master")}
    assert "pwned" not in tables
    copied = on_host(workdir, "copied.db")  # at most what is there instead: nothing
    assert not copied or host_text(workdir, "copied.db") == ""
    reread = SQLiteAuditStore(db, read_only=True)
    try:
        assert reread.verify().intact
    finally:
        reread.close()


# -- a workdir outside the root --------------------------------------------------------------


@pytest.mark.parametrize("workdir", ["/etc", "../" * 20 + "etc", "link-to-etc"])
async def test_a_workdir_outside_the_root_is_refused_before_anything_runs(
    executor: LocalExecutor, tmp_path: Path, workdir: str
) -> None:
    (tmp_path / "link-to-etc").symlink_to("/etc")
    before = os.stat("/etc")
    listed = sorted(os.listdir("/etc"))
    asked: list[Turn] = []

    async def agent(turn: Turn) -> str:
        asked.append(turn)
        return step("check_status", {"command": "touch cmbs-test-in-etc"})

    spec = ScenarioSpec(id="etc", goal="g", workdir=workdir, files={"cmbs-test-seed": "x"})
    result = await run_scenario(spec, agent=CallableAgent(agent), executor=executor)
    assert result.outcome is Outcome.EXECUTOR_ERROR and asked == [] and result.trace == []
    assert result.reason is not None and "is outside the workdir root" in result.reason
    for action in (
        executor.prepare(workdir, {"cmbs-test-seed": "x"}),
        executor.run_command("/etc", "touch cmbs-test-in-etc", timeout=30),
        executor.write_artifact("/etc", "cmbs-test-artifact", "x"),
    ):
        with pytest.raises(ExecutorError, match="is outside the workdir root"):
            await action
    after = os.stat("/etc")
    assert (after.st_uid, after.st_gid, after.st_mode) == (
        before.st_uid,
        before.st_gid,
        before.st_mode,
    )
    assert sorted(os.listdir("/etc")) == listed


async def test_an_existing_workdir_is_taken_only_if_empty_or_left_by_a_sandbox(
    executor: LocalExecutor, tmp_path: Path
) -> None:
    full, empty, kept = tmp_path / "full", tmp_path / "empty", tmp_path / "kept"
    for directory in (full, empty):
        directory.mkdir()
    (full / "operator.txt").write_text("mine")
    os.chown(full / "operator.txt", 65534, 65534)  # another account's, not root's either
    with pytest.raises(ExecutorError, match="already holds files that are not the sandbox user"):
        await executor.prepare(str(full), {})
    assert full.stat().st_uid == 0 and (full / "operator.txt").stat().st_uid == 65534
    assert await executor.prepare(str(empty), {}) == str(empty)
    assert empty.stat().st_uid == sandbox_uid(executor, str(empty)) != 0  # handed over
    # a workdir kept from an earlier run (named, so not removed) is taken again, whole
    earlier = await executor.prepare(str(kept), {"earlier.txt": "from an earlier run\n"})
    assert (await run(executor, earlier, "mkdir made && echo by-a-command > made/f")).success
    await executor.cleanup(earlier, remove=False)
    again = await executor.prepare(str(kept), {})
    observation = await run(executor, again, "cat earlier.txt made/f; echo more >> made/f")
    assert observation.success, observation.stderr.text
    assert observation.stdout.text == "from an earlier run\nby-a-command\n"
    assert host_text(kept, "made/f") == "by-a-command\nmore\n"


async def test_a_workdir_not_prepared_needs_the_root_and_to_be_writable(
    executor: LocalExecutor, tmp_path: Path
) -> None:
    """``run_command`` on a directory never prepared makes its sandbox then and there,
    proven all the same."""
    workdir = tmp_path / "unprepared"
    workdir.mkdir()  # root's: commands could not write it
    with pytest.raises(ExecutorError, match="cannot write their workdir"):
        await run(executor, str(workdir), "touch x")
    assert os.listdir(workdir) == []
    os.chmod(workdir, 0o777)
    observation = await run(executor, str(workdir), "touch x && id -u")
    assert observation.success and observation.stdout.text != "0\n"
    assert observation.stdout.text == f"{sandbox_uid(executor, str(workdir))}\n"
    assert executor.containment_of(str(workdir)).canary  # proven before it ran
    outside = tmp_path.parent / f"{tmp_path.name}-outside"
    with pytest.raises(ExecutorError, match="is outside the workdir root"):
        await run(executor, str(outside), "touch x")
    assert not on_host(outside)


# -- limits -------------------------------------------------------------------------------------

FORK_BOMBS = {
    "bash": "bash -c ':(){{ :|:& }};:; exec sleep 3' {mark}",
    "python": (
        f"{PYTHON} -c 'import os, time\n"
        "end = time.monotonic() + 3\n"
        "while time.monotonic() < end:\n"
        "    try:\n"
        "        os.fork()\n"
        "    except OSError:\n"
        "        time.sleep(0.01)\n' {mark}"
    ),
}


@pytest.mark.parametrize("bomb", list(FORK_BOMBS))
async def test_a_fork_bomb_hits_its_process_limit_and_no_other_scenario_notices(
    tmp_path: Path, bomb: str
) -> None:
    mark = unique_seconds()
    bounded = CommandEnv(limits=Limits(pids=64))
    async with (
        LocalExecutor(workdir_root=str(tmp_path / "one"), kill_grace=0.3) as one,
        LocalExecutor(workdir_root=str(tmp_path / "two"), kill_grace=0.3) as two,
    ):
        bombed = await one.prepare(None, {}, env=bounded)
        neighbour = await one.prepare(None, {})
        bombing: list[Observation] = []
        others: list[Observation] = []

        async def explode() -> None:
            command = FORK_BOMBS[bomb].format(mark=mark)
            bombing.append(await one.run_command(bombed, command, timeout=60, env=bounded))

        async def carry_on(executor: LocalExecutor, workdir: str | None) -> None:
            if workdir is None:  # a scenario that starts while the bomb goes off
                workdir = await executor.prepare(None, {})
            for index in range(10):
                others.append(await run(executor, workdir, f"echo ok-{index} | cat"))
                await anyio.sleep(0.2)

        async with anyio.create_task_group() as tg:
            tg.start_soon(explode)
            tg.start_soon(carry_on, one, neighbour)
            tg.start_soon(carry_on, two, None)
        after = await one.run_command(bombed, "echo still-here", timeout=60, env=bounded)
    [observation] = bombing
    assert "pids" in observation.limits_hit and not observation.success
    assert observation.error is not None and "process limit (64 processes)" in observation.error
    assert [o.success for o in others] == [True] * 20, [said(o) for o in others if not o.success]
    assert sorted(o.stdout.text for o in others) == sorted([f"ok-{i}\n" for i in range(10)] * 2)
    assert after.success and after.stdout.text == "still-here\n"
    assert processes_with(mark) == []


async def test_a_memory_hog_hits_its_memory_limit_and_the_sandbox_goes_on(
    executor: LocalExecutor,
) -> None:
    bounded = CommandEnv(limits=Limits(memory=128 << 20))
    workdir = await executor.prepare(None, {}, env=bounded)
    hog = f"{PYTHON} -c 'data = b\"x\" * (1 << 30); print(len(data))'"
    observation = await executor.run_command(workdir, hog, timeout=60, env=bounded)
    assert observation.limits_hit == ("memory",) and not observation.success
    assert observation.error is not None and "memory limit (134217728 bytes)" in observation.error
    assert observation.stdout.text == ""
    after = await executor.run_command(workdir, "echo still-here", timeout=60, env=bounded)
    assert after.success and after.stdout.text == "still-here\n" and after.limits_hit == ()


#: A moment before a command does anything: see the race below.
SETTLED = "sleep 1; "


@pytest.mark.parametrize(("name", "where"), [("tmp", "/tmp"), ("shm", "/dev/shm")])
async def test_filling_tmp_or_shm_hits_its_size_limit(
    executor: LocalExecutor, name: str, where: str
) -> None:
    bounded = CommandEnv(limits=Limits(**{name: 8 << 20}))
    workdir = await executor.prepare(None, {}, env=bounded)
    marker = f"cmbs-test-{unique_seconds()}"
    fill = f"{SETTLED}dd if=/dev/zero of={where}/{marker} bs=1M count=64"
    observation = await executor.run_command(workdir, fill, timeout=60, env=bounded)
    assert observation.limits_hit == (name,) and not observation.success
    assert "No space left on device" in observation.stderr.text
    assert observation.error == f"filled the scenario's {where} (8388608 bytes)"
    assert not on_host(where, marker)  # the host's is another one
    after = await executor.run_command(workdir, f"{SETTLED}echo innocent", timeout=60, env=bounded)
    assert after.stdout.text == "innocent\n"
    assert after.limits_hit == () and after.success  # full still, but not its doing


def _argv(pid: int | str) -> list[bytes]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return []


def _launcher_of(workdir: str) -> int:
    """The launcher of ``workdir``'s sandbox: bwrap (its parent) names the workdir."""
    for entry in os.listdir("/proc"):
        argv = _argv(entry) if entry.isdigit() else []
        if argv and b"bwrap" not in argv[0] and any(a.endswith(b"/launcher.py") for a in argv):
            stat_line = Path(f"/proc/{entry}/stat").read_text()
            parent = stat_line.rsplit(")", 1)[1].split()[1]
            if workdir.encode() in _argv(parent):
                return int(entry)
    raise AssertionError(f"no launcher for {workdir}")


async def test_a_fill_is_reported_however_late_the_launcher_reads(tmp_path: Path) -> None:
    """The launcher held up (SIGSTOP, as a busy machine might) while a command fills /tmp."""
    mark = unique_seconds()
    bounded = CommandEnv(limits=Limits(tmp=8 << 20))
    ran: list[Observation] = []
    async with LocalExecutor(workdir_root=str(tmp_path)) as executor:
        workdir = await executor.prepare(None, {}, env=bounded)
        for _ in range(2):  # zygotes made ready, and handed over, before the launcher stops
            await run(executor, workdir, "true", bounded)
            await anyio.sleep(0.5)
        launcher = _launcher_of(workdir)
        fill = f"dd if=/dev/zero of=/tmp/f bs=1M count=64; exec sleep {mark}"

        async def filling() -> None:
            ran.append(await executor.run_command(workdir, fill, timeout=None, env=bounded))

        os.kill(launcher, signal.SIGSTOP)
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(filling)
                assert await until(lambda: len(processes_with(mark)) == 1, within=30)
                os.kill(launcher, signal.SIGCONT)  # /tmp is full by now
                await anyio.sleep(0.5)
                for pid in processes_with(mark):
                    os.kill(pid, signal.SIGKILL)
        finally:
            os.kill(launcher, signal.SIGCONT)
    [observation] = ran
    assert observation.limits_hit == ("tmp",)


# -- network: none ------------------------------------------------------------------------------


class _Listening:
    """A Unix socket anyone may connect to, and the connections it accepted."""

    def __init__(self, path: Path) -> None:
        self.accepted = 0
        self._server = socket.socket(socket.AF_UNIX)
        self._server.bind(str(path))
        path.chmod(0o777)
        self._server.listen(8)
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                connection, _ = self._server.accept()
            except OSError:
                return
            self.accepted += 1
            connection.close()

    def close(self) -> None:
        self._server.shutdown(socket.SHUT_RDWR)
        self._server.close()
        self._thread.join(5)


async def test_network_none_reaches_no_unix_socket_and_no_address(
    executor: LocalExecutor, visible: Path
) -> None:
    """Host services on a Unix socket (one anyone may connect to, one under /run) and on
    the loopback (TCP and UDP): reached with the network, out of reach without it."""
    under_run = Path(f"/run/cmbs-test-{unique_seconds()}.sock")
    sockets = [visible / "service.sock", under_run]
    servers = [_Listening(path) for path in sockets]
    tcp = socket.create_server(("127.0.0.1", 0))
    tcp.settimeout(5)
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("127.0.0.1", 0))
    udp.settimeout(5)
    connect = (
        f"{PYTHON} -c 'import socket, sys; s = socket.socket(socket.AF_UNIX); "
        's.connect(sys.argv[1]); print("CONNECTED")\''
    )
    tcp_port, udp_port = tcp.getsockname()[1], udp.getsockname()[1]
    inet = (
        f"{PYTHON} -c 'import socket; "
        f'socket.create_connection(("127.0.0.1", {tcp_port}), timeout=5); print("TCP")\'; '
        f"{PYTHON} -c 'import socket; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); "
        f's.sendto(b"UDP", ("127.0.0.1", {udp_port}))\''
    )
    cut = CommandEnv(network="none")
    try:
        workdir = await executor.prepare(None, {})
        reached = [await run(executor, workdir, f"{connect} {path}") for path in sockets]
        online = await run(executor, workdir, inet)
        connection, _ = await anyio.to_thread.run_sync(tcp.accept)  # it came, with the network
        connection.close()
        assert (await anyio.to_thread.run_sync(udp.recvfrom, 16))[0] == b"UDP"
        assert await until(lambda: [server.accepted for server in servers] == [1, 1])
        refused = [await run(executor, workdir, f"{connect} {path}", cut) for path in sockets]
        offline = await run(executor, workdir, inet, cut)
        tcp.settimeout(0.5)
        udp.settimeout(0.5)
        with pytest.raises(TimeoutError):
            await anyio.to_thread.run_sync(tcp.accept)
        with pytest.raises(TimeoutError):
            await anyio.to_thread.run_sync(udp.recvfrom, 16)
        accepted = [server.accepted for server in servers]
    finally:
        for server in servers:
            server.close()
        tcp.close()
        udp.close()
        os.unlink(under_run)
    assert [o.stdout.text for o in reached] == ["CONNECTED\n"] * 2
    assert online.success and online.stdout.text == "TCP\n"
    for observation in refused:
        assert "PermissionError" in observation.stderr.text
        assert "CONNECTED" not in observation.stdout.text
    assert accepted == [1, 1]  # only the connections made with the network
    assert "TCP" not in offline.stdout.text
    assert "Connection refused" in offline.stderr.text  # the sandbox's own loopback


# -- the canary -----------------------------------------------------------------------------------


async def test_the_canary_proves_every_check_before_the_first_step(tmp_path: Path) -> None:
    key = load_or_create_key(tmp_path / "key")
    store = SQLiteAuditStore(tmp_path / "audit.db", key=key)
    spec = ScenarioSpec(id="proven", goal="g", network="none")
    async with LocalExecutor(workdir_root=str(tmp_path / "root")) as executor:
        workdir = await executor.prepare(None, {}, env=spec.command_env())
        report = executor.containment_of(workdir)
        result = await run_scenario(
            spec, agent=ScriptedAgent([step("terminate")]), executor=executor, audit=store
        )
    assert report.sandbox == "bwrap" and report.network == "none"
    names = {check.name for check in report.canary}
    assert CANARY | {"open a Unix socket", "connect outside the network policy"} <= names
    assert all(check.held for check in report.canary) and report.leaks == ()
    assert result.containment is not None and result.containment.leaks == ()
    assert {c.name for c in result.containment.canary} == names
    first = next(store.records(result.session_id))
    store.close()
    assert first.kind is RecordKind.SESSION
    assert first.data["containment"] == result.containment.model_dump(mode="json")


#: Wrappers around the real bwrap, each taking one protection away.
LEAKY = {
    "seccomp dropped": ("--seccomp", "skip the next", "open a Unix socket"),
    "host writable": ("--ro-bind", "bind instead", "write outside the workdir"),
}


@pytest.fixture(params=list(LEAKY))
def leaky_bwrap(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[str]:
    """``CMBS_BWRAP`` set to a wrapper that runs the real bwrap with one protection
    removed; yields the canary's name for the leak."""
    option, how, leak = LEAKY[request.param]
    real = shutil.which("bwrap")
    assert real is not None
    change = "skip=1; continue" if how == "skip the next" else 'set -- "$@" --bind; continue'
    wrapper = tmp_path / "leaky-bwrap"
    wrapper.write_text(
        "#!/bin/sh\n"
        "skip=0; changed=0\n"
        'for arg do\n  shift\n  if [ "$skip" = 1 ]; then skip=0; continue; fi\n'
        f'  if [ "$changed" = 0 ] && [ "$arg" = {option} ]; then changed=1; {change}; fi\n'
        '  set -- "$@" "$arg"\ndone\n'
        f'exec {real} "$@"\n'
    )
    wrapper.chmod(0o755)
    monkeypatch.setenv("CMBS_BWRAP", str(wrapper))
    find_bwrap.cache_clear()
    yield leak
    monkeypatch.undo()
    find_bwrap.cache_clear()


async def test_a_leaking_sandbox_fails_closed_before_the_first_step(
    leaky_bwrap: str, tmp_path: Path
) -> None:
    leak = leaky_bwrap
    root = tmp_path / "root"
    spec = ScenarioSpec(id="leaky", goal="g", network="none")
    asked: list[Turn] = []

    async def agent(turn: Turn) -> str:
        asked.append(turn)
        return step("check_status", {"command": "echo ran > ran.txt"})

    store = SQLiteAuditStore(tmp_path / "audit.db", key=load_or_create_key(tmp_path / "key"))
    async with LocalExecutor(sandbox="bwrap", workdir_root=str(root)) as executor:
        with pytest.raises(SandboxLeak, match="^the sandbox leaks: ") as raised:
            await executor.prepare(None, {}, env=spec.command_env())
        result = await run_scenario(
            spec, agent=CallableAgent(agent), executor=executor, audit=store
        )
    leaks = raised.value.containment.leaks
    assert leak in {check.name for check in leaks}  # among what the canary found
    said = f"the sandbox leaks: {leaks[0].name}: {leaks[0].target} ("
    assert str(raised.value).startswith(said)  # the first leak, by name
    assert result.outcome is Outcome.EXECUTOR_ERROR and asked == [] and result.steps == 0
    assert result.reason is not None and result.reason.startswith(said)
    assert result.containment is not None and leak in {c.name for c in result.containment.leaks}
    [first, *rest] = list(store.records(result.session_id))
    store.close()
    assert first.kind is RecordKind.SESSION
    checks = first.data["containment"]["canary"]
    assert {c["name"] for c in checks} >= CANARY and leak in {
        c["name"] for c in checks if not c["held"]
    }
    assert [record.kind for record in rest] == [RecordKind.END]
    assert not root.exists() or os.listdir(root) == []  # nothing ran, nothing is left


# -- what is left behind --------------------------------------------------------------------------

_CGROUPS = (Path("/sys/fs/cgroup/pids/cmbs"), Path("/sys/fs/cgroup/memory/cmbs"))


def _our_cgroups() -> set[Path]:
    """This process's sandboxes' control groups (named after its pid)."""
    mine = f"s{os.getpid()}-"
    return {
        group
        for parent in _CGROUPS
        if parent.is_dir()
        for group in parent.iterdir()
        if group.name.startswith(mine)
    }


def _members(groups: set[Path]) -> list[int]:
    pids: set[int] = set()
    for group in groups:
        try:
            pids.update(int(pid) for pid in (group / "cgroup.procs").read_text().split())
        except FileNotFoundError:
            continue
    return sorted(pids)


async def test_cleanup_and_aclose_leave_no_process_and_no_control_group(tmp_path: Path) -> None:
    before = _our_cgroups()
    mark = unique_seconds()
    executor = LocalExecutor(workdir_root=str(tmp_path), kill_grace=0.3)
    async with executor:
        first = await executor.prepare(None, {})
        first_groups = _our_cgroups() - before
        cut = CommandEnv(network="none")
        second = await executor.prepare(None, {}, env=cut)
        second_groups = _our_cgroups() - before - first_groups
        for workdir, env in ((first, None), (second, cut)):
            command = f"setsid sleep {mark} & echo started"
            observation = await run(executor, workdir, command, env)
            assert observation.stdout.text == "started\n"
        # each sandbox's processes: bwrap (it names the workdir), the launcher, its zygotes
        first_members, second_members = (
            [*processes_with(workdir), _launcher_of(workdir), *_members(groups)]
            for workdir, groups in ((first, first_groups), (second, second_groups))
        )
        assert len(first_groups) == len(second_groups) == 2  # pids and memory, each
        await executor.cleanup(first)
        assert not on_host(first) and live_pids(first_members) == []
        assert not any(group.exists() for group in first_groups)
        assert live_pids(second_members) != []  # the other scenario's sandbox is still up
    assert live_pids(second_members) == [] and processes_with(mark) == []
    assert not any(group.exists() for group in second_groups)
    assert _our_cgroups() == before
    assert host_listing(tmp_path) == [os.path.basename(second)]


async def test_a_workdir_that_cannot_be_removed_is_reported(tmp_path: Path) -> None:
    """Something the run cannot remove (an immutable file, made from the host) is said in
    the result, and the rest of the result stands."""

    async def agent(turn: Turn) -> str | None:
        if turn.step > 1:
            return None
        [workdir] = list((tmp_path / "root").iterdir())
        (workdir / "stuck").write_text("x")
        await anyio.run_process(["chattr", "+i", str(workdir / "stuck")])
        return step("check_status", {"command": "true"})

    if shutil.which("chattr") is None:
        pytest.skip("chattr is not installed")
    try:
        async with LocalExecutor(workdir_root=str(tmp_path / "root")) as executor:
            result = await run_scenario(
                ScenarioSpec(id="stuck", goal="g"), agent=CallableAgent(agent), executor=executor
            )
        assert result.outcome is Outcome.AGENT_FINISHED
        assert result.cleanup_error is not None
        [workdir] = list((tmp_path / "root").iterdir())
        assert f"workdir {workdir} could not be removed" in result.cleanup_error
        assert result.summary()["cleanup_error"] == result.cleanup_error
    finally:
        await anyio.run_process(["chattr", "-R", "-i", str(tmp_path)], check=False)


def test_the_checks_are_made_with_real_files() -> None:
    """The root-only files tried above really are root's alone here."""
    for path in ROOT_ONLY:
        status = os.stat(path)
        assert status.st_uid == 0 and not stat.S_IMODE(status.st_mode) & 0o044


# -- a sandbox's life ---------------------------------------------------------------------------


async def _idle_then_run(root: Path) -> Observation:
    async with LocalExecutor(workdir_root=str(root)) as executor:
        workdir = await executor.prepare(None, {})
        await anyio.sleep(13)  # an agent thinking; trio retires an idle worker thread after 10 s
        return await run(executor, workdir, "echo still-here")


@pytest.mark.parametrize(
    "backend",
    [
        "asyncio",
        "trio",  # which starts processes from worker threads, retired when idle
    ],
)
def test_a_sandbox_outlives_an_idle_agent(backend: str, tmp_path: Path) -> None:
    observation = anyio.run(_idle_then_run, tmp_path, backend=backend)
    assert observation.success and observation.stdout.text == "still-here\n"


async def test_a_sandbox_killed_mid_run_ends_the_run_in_executor_error(tmp_path: Path) -> None:
    """Its bwrap killed from outside (by an operator, say) between two steps: the run ends,
    saying so, and raises nothing."""
    root = tmp_path / "root"

    async def agent(turn: Turn) -> str | None:
        if turn.step == 2:
            [workdir] = host_listing(root)
            killed = processes_with(str(root / workdir))  # bwrap: the workdir is its argument
            assert killed
            for pid in killed:
                os.kill(pid, 9)
        return step("check_status", {"command": f"echo {turn.step}"}) if turn.step < 3 else None

    async with LocalExecutor(workdir_root=str(root)) as executor:
        with anyio.fail_after(60):
            result = await run_scenario(
                ScenarioSpec(id="killed", goal="g"), agent=CallableAgent(agent), executor=executor
            )
    assert result.outcome is Outcome.EXECUTOR_ERROR and result.steps == 2
    assert result.trace[0].observed == "exit 0: 1"
    assert result.reason is not None and "the sandbox ended" in result.reason
    assert not root.exists()  # the workdir removed all the same, and the root made for it
