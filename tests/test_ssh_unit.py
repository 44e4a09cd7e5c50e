"""SSH executor edge cases a real sshd cannot produce on demand: an in-process asyncssh
server that refuses channels (then runs the real launcher), the clear error under trio,
frames cut across reads, target validation, the launcher on Python 3.6, an install
without sniffio."""

from __future__ import annotations

import ast
import asyncio
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import asyncssh
import pytest

from cmbs_async import Outcome, ScenarioSpec, ScriptedAgent, run_scenario
from executors import ExecutorError
from executors.remote_launcher import MAX_FRAME, FrameReader, encode
from executors.ssh import SSHExecutor, SSHTarget, launcher_source

from .helpers import step

pytestmark = pytest.mark.anyio


async def _run_locally(
    stdin: asyncssh.SSHReader[bytes],
    stdout: asyncssh.SSHWriter[bytes],
    stderr: asyncssh.SSHWriter[bytes],
) -> None:
    """Run the session's command here with ``sh -c``, its streams the channel's."""
    command = stdin.channel.get_command() or ""
    local = await asyncio.create_subprocess_exec(
        "sh", "-c", command, stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert local.stdin and local.stdout and local.stderr
    sink = local.stdin

    async def feed() -> None:
        while data := await stdin.read(1 << 16):
            sink.write(data)
        sink.close()

    async def pump(source: asyncio.StreamReader, to: asyncssh.SSHWriter[bytes]) -> None:
        while data := await source.read(1 << 16):
            to.write(data)

    feeding = asyncio.ensure_future(feed())
    try:
        await asyncio.gather(pump(local.stdout, stdout), pump(local.stderr, stderr))
        stdout.channel.exit(await local.wait())
    finally:
        feeding.cancel()
        if local.returncode is None:
            local.kill()
            await local.wait()
        sink.close()


class _Refusing(asyncssh.SSHServer):
    """Refuses the first ``refusals`` session channels, as a busy sshd does, then runs
    what it is asked to (the real launcher) on this machine."""

    refusals = 0

    def begin_auth(self, username: str) -> bool:
        return False  # no authentication needed

    def session_requested(self) -> object:
        if _Refusing.refusals > 0:
            _Refusing.refusals -= 1
            raise asyncssh.ChannelOpenError(asyncssh.OPEN_RESOURCE_SHORTAGE, "busy")
        return _run_locally


@pytest.fixture
async def server() -> AsyncIterator[tuple[int, str]]:
    key = asyncssh.generate_private_key("ssh-ed25519")
    listener = await asyncssh.create_server(
        _Refusing, "127.0.0.1", 0, server_host_keys=[key], encoding=None
    )
    port = listener.sockets[0].getsockname()[1]
    try:
        yield port, key.export_public_key().decode()
    finally:
        listener.close()
        await listener.wait_closed()


@pytest.mark.skipif(os.geteuid() != 0, reason="the launcher's pidns sandbox needs root")
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_refused_channel_opens_are_retried(server: tuple[int, str]) -> None:
    port, public_key = server
    target = SSHTarget(host="127.0.0.1", port=port, user="u", host_key=public_key)
    _Refusing.refusals = 3
    async with SSHExecutor(target) as executor:
        workdir = await executor.prepare(None, {})
        observation = await executor.run_command(workdir, "echo ran", timeout=30)
        await executor.cleanup(workdir)
    assert observation.success and observation.stdout.text == "ran\n"
    assert _Refusing.refusals == 0
    assert executor.containment == "pidns"


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_channel_refusals_past_the_retries_are_a_clear_error(
    server: tuple[int, str],
) -> None:
    port, public_key = server
    target = SSHTarget(host="127.0.0.1", port=port, user="u", host_key=public_key)
    _Refusing.refusals = 100
    async with SSHExecutor(target, channel_retries=2) as executor:
        with pytest.raises(ExecutorError) as refused:
            await executor.prepare(None, {})
    _Refusing.refusals = 0
    assert str(refused.value) == f"cannot open a session on u@127.0.0.1:{port}: busy"


@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_the_ssh_executor_under_trio_is_a_clear_error() -> None:
    executor = SSHExecutor(SSHTarget(host="127.0.0.1", port=1))
    with pytest.raises(ExecutorError, match="needs the asyncio backend"):
        await executor.prepare(None, {})
    result = await run_scenario(
        ScenarioSpec(id="t", goal="g"), agent=ScriptedAgent([step("terminate")]), executor=executor
    )
    assert result.outcome is Outcome.EXECUTOR_ERROR
    assert "asyncssh does not run on trio" in (result.reason or "")


def test_targets_parse_and_say_what_is_wrong() -> None:
    target = SSHTarget.parse("ssh://alice@db.example:2222")
    assert (target.user, target.host, target.port, target.label) == (
        "alice",
        "db.example",
        2222,
        "alice@db.example:2222",
    )
    assert SSHTarget.parse("ssh://10.0.0.9").label == "10.0.0.9:22"
    assert SSHTarget.parse("ssh://[fe80::1]:2200").label == "[fe80::1]:2200"
    for bad in ("http://x", "ssh://", "ssh://h:99999", "ssh://h/path", "ssh://u:pw@h"):
        with pytest.raises(ValueError, match="ssh://"):
            SSHTarget.parse(bad)
    # what an SSH client would expand or read as an option: one line, before any connection
    for host in ("${x}", "%h", "a b", "-oProxyCommand=x", "h;id", "a..b", "x" * 64 + ".org"):
        with pytest.raises(ValueError) as refused:
            SSHTarget.parse(f"ssh://root@{host}")
        assert "is not a host name or an IP address" in str(refused.value)
        assert "\n" not in str(refused.value)
    with pytest.raises(ValueError, match="is not a user name"):
        SSHTarget.parse("ssh://%u@h")
    with pytest.raises(ValueError, match="is not a host name"):
        SSHTarget(host="${x}")
    jumped = SSHTarget.parse("ssh://a@h", jump="ssh://b@bastion:2200", identities=("k",))
    assert jumped.jump == SSHTarget(host="bastion", user="b", port=2200, identities=("k",))
    with pytest.raises(ValueError, match="'ssh://b@\\$\\{x\\}'"):
        SSHTarget.parse("ssh://a@h", jump="ssh://b@${x}")


def test_frames_survive_any_cut_and_refuse_a_giant() -> None:
    stream = encode({"op": "done", "id": 7}, b"out\n", b"", b"\x00\xff") + encode({"op": "x"})
    reader = FrameReader()
    frames = []
    for i in range(0, len(stream), 3):  # the channel may hand data over in any pieces
        frames += reader.feed(stream[i : i + 3])
    assert frames == [
        ({"op": "done", "id": 7, "blobs": [4, 0, 2]}, [b"out\n", b"", b"\x00\xff"]),
        ({"op": "x"}, []),
    ]
    with pytest.raises(ValueError, match="over the limit"):
        FrameReader().feed((MAX_FRAME + 1).to_bytes(4, "big"))


PYTHON_36 = "/root/.pyenv/versions/3.6.15/bin/python3.6"  # where pyenv puts one


def test_the_launcher_sent_is_python_3_6() -> None:
    """What the executor sends parses as Python 3.6 (RHEL 8's platform-python)."""
    ast.parse(launcher_source(), feature_version=(3, 6))


@pytest.mark.skipif(not os.path.exists(PYTHON_36), reason="no Python 3.6 here")
@pytest.mark.skipif(os.geteuid() != 0, reason="the pidns sandbox needs root")
def test_the_launcher_runs_on_python_3_6(tmp_path: Path) -> None:
    """The launcher as sent, run by Python 3.6 over pipes: a sandbox, its canary, a
    command, an artifact, a cleanup."""
    code = "CMBS_SYNC = 'ab'\n" + launcher_source()  # its __main__ guard starts it
    launcher = subprocess.Popen(
        [PYTHON_36, "-I", "-S", "-c", code],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        cwd=tmp_path,
    )
    assert launcher.stdin is not None and launcher.stdout is not None
    reader = FrameReader()
    assert os.read(launcher.stdout.fileno(), 1) == b"\xab"
    pending: list[tuple[dict[str, object], list[bytes]]] = []

    def ask(meta: dict[str, object], *blobs: bytes) -> tuple[dict[str, object], list[bytes]]:
        assert launcher.stdin is not None and launcher.stdout is not None
        launcher.stdin.write(encode(meta, *blobs))
        launcher.stdin.flush()
        while True:
            while not pending:
                pending.extend(reader.feed(os.read(launcher.stdout.fileno(), 1 << 16)))
            frame = pending.pop(0)
            if frame[0].get("id") == meta["id"]:
                return frame

    with launcher:
        hello = ask({"op": "open", "id": 1, "workdir": str(tmp_path / "w"), "make": True})
        assert hello[0]["op"] == "opened"
        built = ask({"op": "sandbox", "id": 2, "order": ["pidns"], "network": "all"})
        assert built[0].get("sandbox") == "pidns", built
        canary = ask({"op": "canary", "id": 3})
        assert canary[0]["op"] == "canary"
        assert all(check["held"] for check in canary[0]["checks"])  # type: ignore[attr-defined]
        written = ask({"op": "write", "id": 4, "parts": ["a", "b"]}, b"content")
        assert written[0]["code"] == "ok"
        ran = ask({"op": "run", "id": 5, "command": "cat a/b; echo $$", "cap": 100})
        assert ran[0]["code"] == 0 and ran[1][0] == b"content1\n"
        cleaned = ask({"op": "cleanup", "id": 6, "remove": True})
        assert cleaned[0]["left"] is None
        assert launcher.wait(10) == 0
    assert not (tmp_path / "w").exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="a mount namespace needs root")
def test_without_mount_setattr_every_mount_is_remounted_read_only(tmp_path: Path) -> None:
    """The pidns sandbox on kernels before 5.12: each mount of /proc/self/mountinfo is
    remounted read-only, keeping its other options."""
    code = (
        "import os, sys\n"
        "from executors import remote_launcher as r\n"
        "r.unshare(r.CLONE_NEWNS)\n"
        "r.mount(None, '/', None, r.MS_REC | r.MS_PRIVATE)\n"
        "r.read_only_by_remounting()\n"
        "for path in sys.argv[1:]:\n"
        "    try:\n"
        "        open(path, 'w').close()\n"
        "        print('written', path)\n"
        "    except OSError as exc:\n"
        "        print(exc.strerror, path)\n"
    )
    root = Path(__file__).resolve().parent.parent
    targets = [str(tmp_path / "f"), "/etc/cmbs-ro-probe", "/dev/shm/cmbs-ro-probe"]
    done = subprocess.run(
        [sys.executable, "-c", code, *targets], cwd=root, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [f"Read-only file system {path}" for path in targets]
    assert not any(os.path.exists(path) for path in targets)


def test_the_ssh_executor_needs_no_sniffio() -> None:
    """anyio 4.16 no longer installs sniffio: a plain ``pip install .`` has none."""
    code = (
        "import sys; sys.modules['sniffio'] = None\n"
        "import anyio\n"
        "from executors.ssh import SSHExecutor, SSHTarget\n"
        "async def main():\n"
        "    try:\n"
        "        await SSHExecutor(SSHTarget(host='127.0.0.1', port=1)).prepare(None, {})\n"
        "    except Exception as exc:\n"
        "        print(type(exc).__name__)\n"
        "anyio.run(main)\n"
    )
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "SSHUnreachable\n"
