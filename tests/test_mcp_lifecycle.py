"""``cmbs mcp`` ends with its session or its client, whatever the pipes do: a client that
closes stdin without reading what is owed to it, one that closes stdout, a session that
ends with stdin still open, and SIGTERM. Each leaves nothing running and the session
recorded. Real processes on real pipes, spoken to as raw JSON-RPC lines."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import struct
import subprocess
import termios
import time
from importlib import resources
from pathlib import Path
from typing import IO, Any

import pytest

from cmbs_async.audit import SQLiteAuditStore

from .helpers import CMBS, demo_check, live_pids, processes_with, unique_seconds

pytestmark = pytest.mark.parametrize("backend", ["asyncio", "trio"])

#: how long a server may take to end once it should (a loaded 2-core machine)
ENDS_WITHIN = 30


class _Server:
    """``cmbs mcp`` on pipes: stdin and stdout are the test's, stderr goes to a file."""

    def __init__(self, tmp_path: Path, scenario: Path, backend: str) -> None:
        self.db = tmp_path / "audit.db"
        self._stderr = tmp_path / "stderr"
        with self._stderr.open("wb") as stderr:
            self.process = subprocess.Popen(
                [*CMBS, "mcp", str(scenario), "--backend", backend, "--audit-db", str(self.db)]
                + ["--signing-key", str(tmp_path / "key")],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=stderr,
            )
        self._ids = 0
        self.markers: list[str] = []

    @property
    def stdin(self) -> IO[bytes]:
        assert self.process.stdin is not None
        return self.process.stdin

    @property
    def stdout(self) -> IO[bytes]:
        assert self.process.stdout is not None
        return self.process.stdout

    def send(self, method: str, params: dict[str, Any] | None = None) -> int:
        """Send a request (its id returned), not waiting for the answer."""
        self._ids += 1
        self._write({"jsonrpc": "2.0", "id": self._ids, "method": method, "params": params or {}})
        return self._ids

    def call(self, tool: str, arguments: dict[str, Any]) -> int:
        return self.send("tools/call", {"name": tool, "arguments": arguments})

    def answer(self, request: int) -> dict[str, Any]:
        """The answer to ``request``, read from stdout."""
        while True:
            line = self.stdout.readline()
            assert line, f"stdout ended before the answer to {request}: {self.stderr()}"
            message: dict[str, Any] = json.loads(line)
            if message.get("id") == request:
                return message

    def open_session(self) -> None:
        """The MCP handshake."""
        initialize = self.send(
            "initialize",
            {
                "protocolVersion": "2025-06-18",
                "capabilities": {},
                "clientInfo": {"name": "test", "version": "1"},
            },
        )
        assert "result" in self.answer(initialize)
        self._write({"jsonrpc": "2.0", "method": "notifications/initialized"})

    def _write(self, message: dict[str, Any]) -> None:
        self.stdin.write(json.dumps(message).encode() + b"\n")
        self.stdin.flush()

    def start_sleep(self) -> list[int]:
        """Call a tool that sleeps; its process and every process of the server's (pids)
        once it runs."""
        marker = unique_seconds()
        self.markers.append(marker)
        self.call("check_status", {"command": f"sleep {marker}"})
        give_up = time.monotonic() + 60
        while not processes_with(marker):
            assert self.process.poll() is None, self.stderr()
            assert time.monotonic() < give_up, "the sleep did not start"
            time.sleep(0.05)
        return _descendants(self.process.pid)

    def ended(self) -> int:
        """The exit status, once the server has ended by itself (it is given
        :data:`ENDS_WITHIN`)."""
        try:
            return self.process.wait(timeout=ENDS_WITHIN)
        except subprocess.TimeoutExpired:
            pytest.fail(f"cmbs mcp still runs {ENDS_WITHIN} s on: {self.stderr()}")

    def stderr(self) -> str:
        return self._stderr.read_text()

    def outcomes(self) -> list[str | None]:
        """Each recorded session's outcome (None: no end record), once the chain verifies."""
        store = SQLiteAuditStore(self.db, read_only=True)
        try:
            assert store.verify().intact
            return [session["outcome"] for session in store.sessions()]
        finally:
            store.close()

    def kill(self) -> None:
        """Whatever happened, leave nothing behind."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        for pipe in (self.process.stdin, self.process.stdout):
            if pipe is not None and not pipe.closed:
                try:
                    pipe.close()
                except BrokenPipeError:
                    pass
        for marker in self.markers:
            for pid in processes_with(marker):
                os.kill(pid, signal.SIGKILL)


def _descendants(pid: int) -> list[int]:
    """The pids of every process below ``pid``."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        below = children.get(todo.pop(), [])
        found += below
        todo += below
    return found


def _unread(pipe: IO[bytes]) -> int:
    """How many bytes wait in ``pipe`` for its reader."""
    return int(struct.unpack("i", fcntl.ioctl(pipe, termios.FIONREAD, b"\0" * 4))[0])


def _scenario(tmp_path: Path) -> Path:
    scenario = tmp_path / "slow.yaml"
    scenario.write_text("id: slow\ngoal: wait\ndeadline_s: 600\n")
    return scenario


def _ended_quietly(server: _Server) -> None:
    """No traceback, and the session's result line last on stderr."""
    stderr = server.stderr()
    assert "Traceback" not in stderr, stderr
    assert stderr.splitlines()[-1].startswith("cmbs mcp: session "), stderr


def test_a_client_that_leaves_owed_output_unread_ends_the_server(
    tmp_path: Path, backend: str
) -> None:
    server = _Server(tmp_path, _scenario(tmp_path), backend)
    try:
        server.open_session()
        listed = server.send("tools/list")
        size = len(json.dumps(server.answer(listed)))
        capacity = fcntl.fcntl(server.stdout, fcntl.F_GETPIPE_SZ)
        server.call("check_status", {"command": "seq 1 200000"})  # lots of output
        many = 4 * 2**20 // size + 1  # answers beyond the pipe and what the server buffers
        for _ in range(many):
            server.send("tools/list")
        running = server.start_sleep()
        give_up = time.monotonic() + 60
        while _unread(server.stdout) < capacity // 2:  # the pipe fills: output waits
            assert server.process.poll() is None, server.stderr()
            assert time.monotonic() < give_up, f"{_unread(server.stdout)} of {capacity} bytes"
            time.sleep(0.05)
        server.stdin.close()  # and stdout is never read while the server runs
        status = server.ended()
        left = live_pids(running) + processes_with(server.markers[0])
        delivered = server.stdout.read().count(b"\n")
    finally:
        server.kill()
    assert status == 3, server.stderr()
    assert left == []
    assert delivered < many  # it had more to say than the client took: it left it unsaid
    _ended_quietly(server)
    assert server.outcomes() == ["cancelled"]


def test_a_client_that_closes_stdout_ends_the_server_quietly(tmp_path: Path, backend: str) -> None:
    server = _Server(tmp_path, _scenario(tmp_path), backend)
    try:
        server.open_session()
        running = server.start_sleep()
        server.stdout.close()
        server.send("tools/list")  # its answer meets a closed pipe; stdin stays open
        status = server.ended()
        left = live_pids(running) + processes_with(server.markers[0])
    finally:
        server.kill()
    assert status == 3, server.stderr()
    assert left == []
    _ended_quietly(server)
    assert server.outcomes() == ["cancelled"]


def test_a_session_that_ends_ends_the_server_with_stdin_open(tmp_path: Path, backend: str) -> None:
    scenario = tmp_path / "demo.yaml"
    scenario.write_text((resources.files("cmbs_async.demo") / "scenario.yaml").read_text())
    server = _Server(tmp_path, scenario, backend)
    try:
        server.open_session()
        for action, payload in demo_check():
            assert not server.answer(server.call(action, payload))["result"]["isError"]
        declared = server.answer(server.call("declare_posture", {"posture": "non_compliant"}))
        assert not declared["result"]["isError"]
        done = server.answer(server.call("terminate", {}))
        assert json.loads(done["result"]["content"][0]["text"])["outcome"] == "terminated"
        status = server.ended()  # stdin still open
        rest = server.stdout.read()
    finally:
        server.kill()
    assert status == 0, server.stderr()
    assert rest == b""
    _ended_quietly(server)
    assert "terminated after" in server.stderr().splitlines()[-1]
    assert server.outcomes() == ["terminated"]


def test_sigterm_ends_the_server_while_the_client_is_silent(tmp_path: Path, backend: str) -> None:
    server = _Server(tmp_path, _scenario(tmp_path), backend)
    try:
        server.open_session()
        running = server.start_sleep()
        server.process.send_signal(signal.SIGTERM)
        status = server.ended()  # stdin open, nothing sent
        left = live_pids(running) + processes_with(server.markers[0])
    finally:
        server.kill()
    assert status == 143, server.stderr()
    assert left == []
    assert server.stderr().splitlines()[-1] == "cmbs mcp: interrupted"
    assert "Traceback" not in server.stderr()
    assert server.outcomes() == ["cancelled"]


def test_files_as_stdin_and_stdout_end_the_server_at_their_end(
    tmp_path: Path, backend: str
) -> None:
    requests = tmp_path / "requests.jsonl"
    requests.write_text(
        json.dumps({"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {}}) + "\n"
    )
    with requests.open("rb") as stdin, (tmp_path / "out").open("wb") as stdout:
        done = subprocess.run(
            [*CMBS, "mcp", str(_scenario(tmp_path)), "--backend", backend]
            + ["--audit-db", str(tmp_path / "audit.db"), "--signing-key", str(tmp_path / "key")],
            stdin=stdin,
            stdout=stdout,
            stderr=subprocess.PIPE,
            text=True,
            timeout=ENDS_WITHIN,
        )
    assert done.returncode == 3, done.stderr
    assert "Traceback" not in done.stderr
    assert done.stderr.splitlines()[-1].startswith("cmbs mcp: session ")
