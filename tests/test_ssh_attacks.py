"""Issue 21, item 8: a hostile agent against the SSH executor and a real sshd.

Each attack is tried for real, as the agent's command (or as what an agent could leave
behind), and the test then looks at what a user would notice: the login's start-up
files, the process table, the deadline, the workdir, what another user can read.
Logins that an attack could wreck are throwaway accounts: a second uid 0 with a home of
its own (root's powers, not root's start-up files) and an unprivileged user.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import anyio
import pytest

from cmbs_async import Outcome, ScenarioSpec, ScriptedAgent, run_scenario
from cmbs_async.protocol import CommandEnv, Containment
from executors.base import CleanupFailed, ExecutorError, SandboxLeak
from executors.ssh import SSHAuthRefused, SSHExecutor, SSHTarget, SSHUnreachable

from .helpers import processes_with, step, until
from .sshd import LocalSshd, ThrowawayUser, free_port, sshd_available

pytestmark = [
    pytest.mark.ssh,
    pytest.mark.anyio,
    pytest.mark.skipif(
        os.geteuid() != 0 or (not sshd_available() and not os.environ.get("CI")),
        reason="needs root (throwaway accounts) and OpenSSH sshd",
    ),
]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def target(sshd: LocalSshd, **options: object) -> SSHTarget:
    defaults: dict[str, object] = {
        "identities": (sshd.client_key,),
        "known_hosts": sshd.known_hosts,
    }
    return SSHTarget.parse(sshd.url, **(defaults | options))


class Login:
    """An sshd and the throwaway account it logs in as (bash its shell, with ~/.ssh)."""

    def __init__(self, account: ThrowawayUser, sshd: LocalSshd) -> None:
        self.account = account
        self.sshd = sshd

    @property
    def home(self) -> Path:
        return self.account.home


def _login(name: str, *, root: bool) -> Iterator[Login]:
    account = ThrowawayUser(name, root=root, shell="/bin/bash")
    with account, LocalSshd(user=name) as sshd:
        keys = account.home / ".ssh"
        keys.mkdir(mode=0o700, exist_ok=True)
        (keys / "authorized_keys").write_text("# the login's own\n")
        (keys / "id_ed25519").write_text("-----BEGIN OPENSSH PRIVATE KEY-----\nnot a key\n")
        if not root:
            subprocess.run(["chown", "-R", f"{name}:", str(account.home)], check=True)
        yield Login(account, sshd)


@pytest.fixture(scope="module")
def root_login() -> Iterator[Login]:
    yield from _login("cmbssshr", root=True)


@pytest.fixture(scope="module")
def user_login() -> Iterator[Login]:
    yield from _login("cmbssshu", root=False)


#: (login, containment): the sandboxes each kind of login gets.
SANDBOXED = [("root", "pidns"), ("root", "bwrap"), ("user", "bwrap")]


@pytest.fixture(params=SANDBOXED, ids=[f"{who}-{how}" for who, how in SANDBOXED])
def sandboxed(request: pytest.FixtureRequest) -> tuple[Login, str]:
    who, how = request.param
    login: Login = request.getfixturevalue(f"{who}_login")
    return login, how


def gone(path: str) -> bool:
    return not os.path.lexists(path)


def read(path: Path) -> str:
    return path.read_text()


def merge(into: Path, *files: str) -> None:
    into.write_text("".join(Path(name).read_text() for name in files))


def every_command_line() -> str:
    """The arguments of every process, as root reads them."""
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                found.append(Path(f"/proc/{pid}/cmdline").read_bytes())
            except OSError:
                pass
    return b"".join(found).decode(errors="replace")


@contextmanager
def tmpfs_at(path: str) -> Iterator[None]:
    """A tmpfs (with a file) mounted at ``path``: what no cleanup may remove."""
    os.mkdir(path)
    subprocess.run(["mount", "-t", "tmpfs", "cmbs-test", path], check=True)
    try:
        Path(path, "inside").write_text("x")
        yield
    finally:
        subprocess.run(["umount", "-l", path], check=False)
        shutil.rmtree(os.path.dirname(path), ignore_errors=True)


def stopped_processes() -> list[tuple[int, str]]:
    """Processes in the stopped state (pid, command line): what a SIGSTOP left behind."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ")
        except (OSError, IndexError):
            continue
        if state in ("T", "t"):
            found.append((int(entry), cmdline.decode(errors="replace")))
    return found


START_UP_FILES = (
    ".ssh/rc",
    ".ssh/authorized_keys",
    ".ssh/environment",
    ".bashrc",
    ".profile",
    ".bash_profile",
    ".bash_login",
)


def snapshot(home: Path) -> dict[str, str | None]:
    """The login's start-up files as they are (None: absent)."""
    return {
        name: (home / name).read_text() if (home / name).exists() else None
        for name in START_UP_FILES
    }


async def test_start_up_files_written_by_the_agent_stay_as_they_were(
    sandboxed: tuple[Login, str], marker: str
) -> None:
    login, how = sandboxed
    before = snapshot(login.home)
    payload = f"(setsid sleep {marker} &) ; sleep 3\\n"
    # what a hostile agent does: find the login's real home, plant code that runs
    # uncontained, and slows, every later session
    attack = (
        f"h={login.home}; for f in {' '.join(START_UP_FILES)}; do "
        f'printf "{payload}" >> "$h/$f" 2>/dev/null && echo "wrote $f"; done; '
        'mkdir -p "$h/.ssh" 2>/dev/null; ls -a "$h/.ssh"'
    )
    agent = ScriptedAgent([step("check_status", {"command": attack})])
    async with SSHExecutor(target(login.sshd), containments=(how,), kill_grace=0.3) as ex:
        first = await run_scenario(
            ScenarioSpec(id="plant", goal="g", deadline_s=30), agent=agent, executor=ex
        )
    assert first.outcome is Outcome.AGENT_FINISHED, first.reason
    assert snapshot(login.home) == before  # nothing reached the real files
    assert "id_ed25519" not in first.trace[0].stdout  # ~/.ssh is hidden from commands

    # the next run on that host: a new session, as sshd would run any ~/.ssh/rc
    probe = ScriptedAgent([step("check_status", {"command": "echo alive"})])
    async with SSHExecutor(target(login.sshd), containments=(how,), kill_grace=0.3) as ex:
        started = anyio.current_time()
        second = await run_scenario(
            ScenarioSpec(id="after", goal="g", deadline_s=6), agent=probe, executor=ex
        )
        elapsed = anyio.current_time() - started
    assert second.outcome is Outcome.AGENT_FINISHED, second.reason
    assert [entry.observed for entry in second.trace] == ["exit 0: alive"]
    assert second.sandbox == how
    assert elapsed < 6
    assert processes_with(marker) == []


async def test_without_a_sandbox_the_containment_says_what_is_not_protected(
    root_login: Login,
) -> None:
    async with SSHExecutor(target(root_login.sshd), containments=("session-kill",)) as ex:
        workdir = await ex.prepare(None, {})
        containment = ex.containment_of(workdir)
        await ex.cleanup(workdir)
    assert containment.sandbox == "session-kill"
    leaked = {(check.name, check.target) for check in containment.leaks}
    assert ("append to a start-up file", "~/.bashrc") in leaked
    assert ("create a file", "~/.ssh") in leaked
    assert ("signal the launcher", "its own process namespace") in leaked
    assert not list(root_login.home.glob("**/.cmbs-canary-*"))  # the canary's files removed


async def test_a_sandbox_the_canary_sees_leaking_is_refused_before_anything_runs(
    root_login: Login,
) -> None:
    # a shared directory as the workdir: what commands write there, every user reads
    async with SSHExecutor(target(root_login.sshd)) as ex:
        with pytest.raises(SandboxLeak) as leaked:
            await ex.prepare("/var/tmp", {"planted": "x"})
    assert str(leaked.value) == (
        f"the pidns sandbox on {target(root_login.sshd).label} leaks: "
        "create a file /var/tmp (created)"
    )
    containment = leaked.value.containment
    assert isinstance(containment, Containment) and containment.sandbox == "pidns"
    assert [check.target for check in containment.leaks] == ["/var/tmp"]
    assert not gone("/var/tmp") and gone("/var/tmp/planted")  # nothing seeded, nothing removed
    assert not [name for name in os.listdir("/var/tmp") if name.startswith(".cmbs-canary-")]


async def test_network_none_without_a_sandbox_is_refused(root_login: Login) -> None:
    async with SSHExecutor(target(root_login.sshd), containments=("session-kill",)) as ex:
        with pytest.raises(ExecutorError, match='network: "none" needs a remote sandbox'):
            await ex.prepare(None, {}, env=CommandEnv(network="none"))


async def test_by_default_a_host_without_a_sandbox_is_refused(user_login: Login) -> None:
    # a login without root may not build the pidns sandbox; nothing weaker is tried
    async with SSHExecutor(target(user_login.sshd), containments=("pidns",)) as ex:
        with pytest.raises(ExecutorError) as refused:
            await ex.prepare(None, {})
    message = str(refused.value)
    assert message.startswith(f"{user_login.account.name}@127.0.0.1:")
    assert "allows none of the containments pidns (pidns: needs root)" in message
    assert "\n" not in message


# -- the operator's SSH configuration and agent ---------------------------------------


@pytest.fixture
def elsewhere() -> Iterator[LocalSshd]:
    """Another host that trusts the key the operator's ssh-agent holds."""
    with LocalSshd() as server:
        yield server


@pytest.fixture
def operator_setup(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, elsewhere: LocalSshd, root_login: Login
) -> Iterator[Path]:
    """An operator's ~/.ssh/config that forwards the agent (and would break any
    connection that read it), and a running ssh-agent holding keys that log in to
    ``elsewhere`` and to the target."""
    home = tmp_path / "operator"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "config").write_text(
        "Host *\n  ForwardAgent yes\n  IdentityFile ~/.ssh/id_%h\n  ProxyCommand false\n"
    )
    monkeypatch.setenv("HOME", str(home))
    sock = tmp_path / "agent.sock"
    started = subprocess.run(
        ["ssh-agent", "-a", str(sock)], capture_output=True, text=True, check=True
    )
    found = re.search(r"SSH_AGENT_PID=(\d+)", started.stdout)
    assert found is not None
    agent_pid = int(found[1])
    monkeypatch.setenv("SSH_AUTH_SOCK", str(sock))
    try:
        for key in (elsewhere.client_key, root_login.sshd.client_key):
            subprocess.run(["ssh-add", "-q", key], check=True, capture_output=True)
        yield home
    finally:
        os.kill(agent_pid, signal.SIGTERM)


async def test_the_operators_ssh_config_and_agent_reach_no_command(
    root_login: Login, elsewhere: LocalSshd, operator_setup: Path, tmp_path: Path
) -> None:
    pwned = tmp_path / "pwned"
    hop = (
        "ssh -o BatchMode=yes -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null "
        f"-p {elsewhere.port} {elsewhere.user}@127.0.0.1 touch {pwned}"
    )
    command = f'echo "agent=${{SSH_AUTH_SOCK:-none}}"; {hop}; echo "ssh=$?"'
    async with SSHExecutor(target(root_login.sshd)) as ex:
        workdir = await ex.prepare(None, {})
        observation = await ex.run_command(workdir, command, timeout=60)
        await ex.cleanup(workdir)
    assert observation.stdout.text.startswith("agent=none\n")
    assert "ssh=0" not in observation.stdout.text
    assert not pwned.exists()  # nothing logged in elsewhere with the operator's agent

    # the agent holds the target's key too, yet the executor never offers it
    async with SSHExecutor(target(root_login.sshd, identities=())) as ex:
        with pytest.raises(SSHAuthRefused, match="authentication refused"):
            await ex.prepare(None, {})


def test_a_host_that_ssh_would_expand_is_refused_in_one_line(operator_setup: Path) -> None:
    for host in ("${x}", "%h", "a b", "-oProxyCommand=id", "host;id", "[::1", "a..b"):
        with pytest.raises(ValueError) as refused:
            SSHTarget.parse(f"ssh://root@{host}:22")
        assert "\n" not in str(refused.value)
    assert SSHTarget.parse("ssh://root@[::1]:22").label == "root@[::1]:22"


# -- what kills a command ---------------------------------------------------------------


async def test_a_command_cannot_stop_what_would_kill_it(
    sandboxed: tuple[Login, str], marker: str
) -> None:
    login, how = sandboxed
    # everything it can signal, then whatever an sshd or python it can see
    command = (
        f"kill -STOP -1; for p in $(pgrep -f 'sshd|python'); do kill -STOP $p; done; sleep {marker}"
    )
    async with SSHExecutor(target(login.sshd), containments=(how,), kill_grace=0.3) as ex:
        workdir = await ex.prepare(None, {})
        started = anyio.current_time()
        observation = await ex.run_command(workdir, command, timeout=4)
        elapsed = anyio.current_time() - started
        again = await ex.run_command(workdir, "echo still", timeout=30)
        await ex.cleanup(workdir)
    assert observation.timed_out
    assert elapsed < 4 + 0.3 + 2
    assert again.stdout.text == "still\n"
    assert processes_with(marker) == []
    assert [p for p in stopped_processes() if "sshd" in p[1] or "python" in p[1]] == []


async def test_without_a_sandbox_a_stopped_sshd_does_not_stretch_the_deadline(
    root_login: Login, marker: str
) -> None:
    # the command's parent is the launcher, the launcher's the sshd serving the channel
    command = (
        'sshd=$(cut -d" " -f4 /proc/$PPID/stat); kill -STOP "$sshd" $PPID; '
        f"setsid sleep {marker} & sleep {marker}"
    )
    agent = ScriptedAgent([step("check_status", {"command": command})])
    async with SSHExecutor(
        target(root_login.sshd), containments=("session-kill",), kill_grace=0.3
    ) as ex:
        started = anyio.current_time()
        result = await run_scenario(
            ScenarioSpec(id="stop", goal="g", deadline_s=4), agent=agent, executor=ex
        )
        elapsed = anyio.current_time() - started
        # the executor goes on, on a new connection
        workdir = await ex.prepare(None, {})
        again = await ex.run_command(workdir, "echo still", timeout=30)
        await ex.cleanup(workdir)
    assert result.outcome is Outcome.DEADLINE_EXCEEDED
    # the kill grace, a second for the launcher to answer, one login to kill it anyway
    assert elapsed < 4 + 0.3 + 1 + 3
    assert await until(lambda: processes_with(marker) == [])
    assert [p for p in stopped_processes() if "sshd" in p[1] or "python" in p[1]] == []
    assert again.stdout.text == "still\n"


# -- cleanup ----------------------------------------------------------------------------


async def test_what_a_command_locked_is_removed_all_the_same(
    sandboxed: tuple[Login, str],
) -> None:
    login, how = sandboxed
    lock = (
        "mkdir -p d/e/f && touch d/e/f/g d/x && ln -s / d/root && "
        "chmod 000 d/e/f && chmod 555 d/e d && chmod 000 d/x && chmod 500 ."
    )
    async with SSHExecutor(target(login.sshd), containments=(how,)) as ex:
        workdir = await ex.prepare(None, {})
        locked = await ex.run_command(workdir, lock, timeout=30)
        await ex.cleanup(workdir)
    assert locked.success, locked.stderr.text
    assert gone(workdir)
    assert not gone("/etc/passwd")  # the link was removed, not followed


async def test_what_cannot_be_removed_is_a_one_line_cleanup_failure(
    root_login: Login,
) -> None:
    async with SSHExecutor(target(root_login.sshd)) as ex:
        workdir = await ex.prepare(None, {"keep/a": "1"})
        mounted = os.path.join(workdir, "busy")
        with tmpfs_at(mounted):
            with pytest.raises(CleanupFailed) as failed:
                await ex.cleanup(workdir)
            left = sorted(os.listdir(workdir))
    message = str(failed.value)
    assert message == (
        f"workdir {workdir} on {target(root_login.sshd).label}: left busy: a mount point"
    )
    assert left == ["busy"]  # the rest went; the other filesystem was not entered


# -- the environment ----------------------------------------------------------------------


async def test_environment_values_are_in_no_process_arguments(
    user_login: Login, marker: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    secret, passed = f"s3cret-{marker}", f"p4ssed-{marker}"
    monkeypatch.setenv("KUBE_TOKEN", passed)
    declared = CommandEnv(values={"TOKEN": secret}, pass_env=("KUBE_TOKEN",))
    async with SSHExecutor(target(user_login.sshd), kill_grace=0.3) as ex:
        workdir = await ex.prepare(None, {}, env=declared)
        seen: dict[str, str] = {}

        async def look_while_it_runs() -> None:
            assert await until(lambda: bool(processes_with(marker)), within=30)
            seen["root"] = every_command_line()
            read_all = "cat /proc/[0-9]*/cmdline /proc/[0-9]*/environ 2>/dev/null; ps -eo args"
            other = await anyio.run_process(
                ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--",
                 "sh", "-c", read_all],
                check=False,
                env={"PATH": os.environ["PATH"]},  # the readers' own: not the operator's
            )  # fmt: skip
            seen["nobody"] = other.stdout.decode(errors="replace")

        async with anyio.create_task_group() as tg:
            tg.start_soon(look_while_it_runs)
            observation = await ex.run_command(
                workdir, f'echo "$TOKEN $KUBE_TOKEN"; sleep {marker}', timeout=8, env=declared
            )
        await ex.cleanup(workdir)
    assert observation.stdout.text == f"{secret} {passed}\n"  # the command got them
    assert marker in seen["root"]  # the scan saw the command running
    for who, text in seen.items():
        assert secret not in text and passed not in text, who


# -- the login shell, and the network -------------------------------------------------------


async def test_a_hostile_login_shell_cannot_answer_for_the_launcher(
    root_login: Login, tmp_path: Path
) -> None:
    sourced = tmp_path / "sourced"
    bashrc = root_login.home / ".bashrc"
    kept = bashrc.read_text()
    # planted before the run: it reads the command string and pretends in every way it can
    bashrc.write_text(
        f'printf "%s" "$BASH_EXECUTION_STRING" > {sourced}\n'
        'echo "cmbs-0000000000000000=session-kill"; echo "sandbox: session-kill" >&2\n'
    )
    try:
        async with SSHExecutor(target(root_login.sshd)) as ex:
            workdir = await ex.prepare(None, {})
            containment = ex.containment_of(workdir)
            observation = await ex.run_command(workdir, "echo fine", timeout=30)
            await ex.cleanup(workdir)
    finally:
        bashrc.write_text(kept)
    said = sourced.read_text()
    assert "python3" in said  # bash did source it, with the channel's command
    # a generic bootstrap: no token, no nonce, nothing that says how commands are held
    assert re.search(r"[0-9a-f]{16}", said) is None and "sandbox" not in said
    assert containment.sandbox == "pidns" and containment.leaks == ()
    assert observation.stdout.text == "fine\n" and observation.stderr.text == ""


async def test_network_none_is_honoured_on_the_host(root_login: Login) -> None:
    reach = (
        'python3 -c \'import socket,sys; socket.create_connection(("127.0.0.1", '
        f'int(sys.argv[1])), 5); print("reached")\' {root_login.sshd.port}'
    )
    async with SSHExecutor(target(root_login.sshd)) as ex:
        cut = await ex.prepare(None, {}, env=CommandEnv(network="none"))
        refused = await ex.run_command(cut, reach, timeout=30)
        open_ = await ex.prepare(None, {})
        reached = await ex.run_command(open_, reach, timeout=30)
        assert ex.containment_of(cut).network == "none"
        for workdir in (cut, open_):
            await ex.cleanup(workdir)
    assert not refused.success and "reached" not in refused.stdout.text
    assert reached.stdout.text == "reached\n"


async def test_a_network_allow_list_is_refused_before_anything_runs() -> None:
    closed = SSHTarget(host="127.0.0.1", port=free_port())
    async with SSHExecutor(closed) as ex:
        with pytest.raises(ExecutorError) as refused:
            await ex.prepare(None, {}, env=CommandEnv(network=("example.com:443",)))
    assert not isinstance(refused.value, SSHUnreachable)  # no connection was tried
    assert str(refused.value).startswith("network allow-lists are enforced by the local sandbox")


# -- a jump host ---------------------------------------------------------------------------


async def test_a_jump_host_carries_the_connection(
    root_login: Login, elsewhere: LocalSshd, tmp_path: Path
) -> None:
    known = tmp_path / "known_hosts"
    merge(known, root_login.sshd.known_hosts, elsewhere.known_hosts)
    options = {
        "identities": (root_login.sshd.client_key, elsewhere.client_key),
        "known_hosts": str(known),
    }
    jumped = SSHTarget.parse(root_login.sshd.url, jump=elsewhere.url, **options)
    assert jumped.jump is not None and jumped.jump.port == elsewhere.port
    async with SSHExecutor(jumped) as ex:
        workdir = await ex.prepare(None, {})
        observation = await ex.run_command(workdir, "echo over the jump", timeout=30)
        await ex.cleanup(workdir)
    assert observation.stdout.text == "over the jump\n"
    log = read(elsewhere.dir / "sshd.log")
    assert "Accepted publickey" in log  # the connection went through the jump host

    nowhere = SSHTarget.parse(root_login.sshd.url, jump=f"ssh://u@127.0.0.1:{free_port()}")
    async with SSHExecutor(nowhere) as ex:
        with pytest.raises(SSHUnreachable, match="cannot reach u@127.0.0.1:"):
            await ex.prepare(None, {})
