"""SSH executor edge cases a real sshd cannot produce on demand: an in-process asyncssh
server that refuses channels, the clear error under trio, a marker cut across reads,
and an install without sniffio."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import asyncssh
import pytest

from cmbs_async import Outcome, ScenarioSpec, ScriptedAgent, run_scenario
from executors import ExecutorError
from executors.ssh import SSHExecutor, SSHTarget, _Session

from .helpers import step

pytestmark = pytest.mark.anyio


class _Echo(asyncssh.SSHServerSession[bytes]):
    """Answers any exec request with its command text and exit status 0."""

    def __init__(self) -> None:
        self._chan: asyncssh.SSHServerChannel[bytes] | None = None
        self._command = b""

    def connection_made(self, chan: asyncssh.SSHServerChannel[bytes]) -> None:  # type: ignore[override]
        self._chan = chan

    def exec_requested(self, command: str) -> bool:
        self._command = command.encode()
        return True

    def session_started(self) -> None:
        assert self._chan is not None
        self._chan.write(b"ran\n")
        self._chan.exit(0)


class _Refusing(asyncssh.SSHServer):
    """Refuses the first ``refusals`` session channels, as a busy sshd does."""

    refusals = 0

    def begin_auth(self, username: str) -> bool:
        return False  # no authentication needed

    def session_requested(self) -> asyncssh.SSHServerSession[bytes] | bool:
        if _Refusing.refusals > 0:
            _Refusing.refusals -= 1
            raise asyncssh.ChannelOpenError(asyncssh.OPEN_RESOURCE_SHORTAGE, "busy")
        return _Echo()


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


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_refused_channel_opens_are_retried(server: tuple[int, str]) -> None:
    port, public_key = server
    target = SSHTarget(host="127.0.0.1", port=port, user="u", host_key=public_key)
    _Refusing.refusals = 3
    async with SSHExecutor(target) as executor:
        observation = await executor.run_command("/", "anything", timeout=10)
    assert observation.success and observation.stdout.text == "ran\n"
    assert _Refusing.refusals == 0
    assert executor.containment == "session-kill"  # no shell answered the probe: the weakest


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_channel_refusals_past_the_retries_are_an_observation(
    server: tuple[int, str],
) -> None:
    port, public_key = server
    target = SSHTarget(host="127.0.0.1", port=port, user="u", host_key=public_key)
    _Refusing.refusals = 100
    async with SSHExecutor(target, channel_retries=2) as executor:
        observation = await executor.run_command("/", "anything", timeout=10)
    _Refusing.refusals = 0
    assert not observation.success
    assert observation.error == f"could not start the command on u@127.0.0.1:{port}: busy"


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
    for bad in ("http://x", "ssh://", "ssh://h:99999", "ssh://h/path"):
        with pytest.raises(ValueError, match="ssh://"):
            SSHTarget.parse(bad)


def test_the_marker_is_found_when_cut_across_reads_and_cut_out() -> None:
    session = _Session(1 << 20, "0123abcd")
    stream = b"motd\n" + b"x" * 200 + b"cmbs-0123abcd=4242\nerr\n"
    for i in range(0, len(stream), 7):  # sshd may hand stderr over in any pieces
        session.data_received(stream[i : i + 7], asyncssh.EXTENDED_DATA_STDERR)
    session.finish()
    assert session.pgid == 4242
    assert session.stderr.output().text == "motd\n" + "x" * 200 + "err\n"


def test_an_other_nonce_is_not_the_marker() -> None:
    session = _Session(1 << 20, "0123abcd")
    session.data_received(b"cmbs-ffffffff=1\n", asyncssh.EXTENDED_DATA_STDERR)
    session.finish()
    assert session.pgid is None and session.stderr.output().text == "cmbs-ffffffff=1\n"


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
