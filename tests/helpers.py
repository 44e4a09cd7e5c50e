"""Small builders shared by the tests."""

from __future__ import annotations

import json
import logging
import os
import random
import re
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator, MutableMapping
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from anyio.abc import SocketAttribute, SocketStream

from cmbs_async import CallableAgent, ScenarioSpec, ScriptedAgent, Turn
from cmbs_async.review import ReviewRequest, ReviewVerdict

#: The command line, as the installed ``cmbs`` runs it.
CMBS = [sys.executable, "-m", "cmbs_async"]


#: A Rego policy for X11 forwarding (package ``check``, rule ``result``), as IT-Bench asks.
POLICY = 'package check\n\ndefault result := false\n\nresult if input.x11_forwarding == "no"\n'


def evaluated_files(x11_forwarding: str = "yes") -> dict[str, str]:
    """Starting files under which one plain command, :data:`EVALUATE` (cmbs-opa, an
    evaluator the CISO profile admits), is a real evaluation: it prints ``false`` for
    ``yes`` (the fault), ``true`` for ``no``."""
    return {
        "policy.rego": POLICY,
        "collected_data.json": json.dumps({"x11_forwarding": x11_forwarding}) + "\n",
    }


EVALUATE = (
    "cmbs-opa eval --data policy.rego --input collected_data.json --format raw data.check.result"
)


def evaluation_ran(command: str) -> dict[str, Any]:
    """The fields of an observation of ``command`` run as the evaluation it parses into
    (as the runtime runs it: the program resolved to a file, its input identified), for
    tests that hand the gate observations of their own making."""
    from cmbs_async.evaluators import plain_words
    from cmbs_async.protocol import InputFile, Program

    words = plain_words(command)
    assert words is not None
    program = Program(name=words[0], path=f"/usr/local/bin/{words[0]}", sha256="0" * 64)
    roles = {"-i": "input", "--input": "input", "-d": "file", "--data": "file"}
    inputs = tuple(
        InputFile(argument=word, role=roles[before], path=word, inode=7, sha256="c" * 64)  # type: ignore[arg-type]
        for before, word in zip(words, words[1:], strict=False)
        if before in roles
    )
    return {"argv": (program.path, *words[1:]), "program": program, "inputs": inputs}


def needs_ansible() -> None:
    """Skip a test that runs ansible-playbook where the ``ciso`` extra is not installed
    (``itbench run`` of a RHEL9 scenario starts only where its commands find it); in CI it
    must be there."""
    if not (Path(sys.executable).parent / "ansible-playbook").exists():
        if os.environ.get("CI"):
            pytest.fail("CI must have ansible-core")
        pytest.skip("needs ansible-core (the ciso extra)")


def needs_visible_venv() -> None:
    """Skip an SSH test whose remote commands (this machine's, in the launcher's sandbox)
    run this environment's programs, where the environment lives under ``/tmp``: the
    sandbox gives commands a private ``/tmp``, so they cannot see it there."""
    if Path(sys.executable).parent.resolve().is_relative_to("/tmp"):
        pytest.skip("this environment is under /tmp, which the remote sandbox makes private")


def demo_check() -> list[tuple[str, dict[str, Any]]]:
    """An honest check of the demo scenario as (action, payload) calls, the way its scripted
    agent makes it: a script of the agent's collects the setting into collected_data.json,
    a Rego policy decides it, evaluated by cmbs-opa (the evaluator the CISO profile admits);
    the last call prints ``false``."""
    from importlib import resources

    lines = (resources.files("cmbs_async.demo") / "steps.jsonl").read_text().splitlines()
    actions = [json.loads(lines[i])["action"] for i in (1, 5, 6, 9)]
    return [(a["type"], a["payload"]) for a in actions]


def step(
    action: str,
    payload: dict[str, Any] | None = None,
    *,
    posture: str = "unknown",
    evidence: str = "none",
    affordances: dict[str, str] | None = None,
) -> str:
    """One agent step as the raw JSON line an agent would send."""
    return json.dumps(
        {
            "belief": {"affordances": affordances or {}, "posture": posture, "evidence": evidence},
            "action": {"type": action, "payload": payload or {}},
        }
    )


#: An agent's steps that find the fault :data:`EVALUATE` reports and say so.
SOLVE = [
    step("check_status", {"command": EVALUATE}),
    step(
        "declare_posture",
        {"posture": "non_compliant"},
        posture="non_compliant",
        evidence="successful",
    ),
    step("terminate", posture="non_compliant", evidence="successful"),
]


@contextmanager
def captured_events(name: str = "cmbs_async") -> Iterator[list[dict[str, Any]]]:
    """The events the standard logger ``name`` gets while the block runs, debug and up,
    each as its fields (``event`` for the name) and ``log_level``."""
    events: list[dict[str, Any]] = []
    standard = {*vars(logging.makeLogRecord({})), "message", "asctime"}

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            fields = {k: v for k, v in vars(record).items() if k not in standard}
            events.append(fields | {"log_level": record.levelname.lower()})

    logger, handler = logging.getLogger(name), Keep()
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield events
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def live_group_members(pgid: int) -> list[int]:
    """Pids of running (non-zombie) processes in a process group."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(entry))
    return members


def live_pids(pids: list[int]) -> list[int]:
    """Those of ``pids`` that are still running (not zombies)."""
    alive = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as handle:
                state = handle.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            alive.append(pid)
    return alive


def processes_with(marker: str) -> list[int]:
    """Pids of running (non-zombie) processes with ``marker`` as one of their arguments.

    How a test finds what a command started, inside a sandbox whose pids mean nothing here.
    """
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as handle:
                argv = handle.read().split(b"\0")
            with open(f"/proc/{entry}/stat") as handle:
                state = handle.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if marker.encode() in argv and state != "Z":
            found.append(int(entry))
    return found


async def until(condition: Callable[[], bool], *, within: float = 10.0) -> bool:
    """Whether ``condition`` holds, asked every 50 ms for at most ``within`` seconds: for
    what nothing signals, such as a process elsewhere starting or being gone."""
    with anyio.move_on_after(within):
        while not condition():  # noqa: ASYNC110
            await anyio.sleep(0.05)
    return condition()


def unique_seconds() -> str:
    """A sleep duration no other process on the machine uses: a marker for processes_with."""
    return f"{random.randint(100_000, 999_999)}.{os.getpid() % 1000}"


def listing(directory: Path) -> list[str]:
    return sorted(os.listdir(directory))


def files_under(directory: str) -> dict[str, str]:
    """Name and content of every file below ``directory``, links not followed."""
    return {
        name: Path(root, name).read_text()
        for root, _, files in os.walk(directory)
        for name in files
    }


#: Swaps ``sub`` between a real directory and a link to ``argv[2]`` in a tight loop (a
#: shell loop forks too slowly to win the race often); if the executor re-made ``sub``
#: while it was away, the files are merged back, so nothing written inside is lost.
SWAPPER = """
import os, sys
os.chdir(sys.argv[1])
while True:
    try:
        os.rename("sub", "stash")
        os.symlink(sys.argv[2], "sub")
        os.unlink("sub")
    except OSError:
        pass
    try:
        os.rename("stash", "sub")
    except OSError:
        try:
            for name in os.listdir("stash"):
                os.rename(f"stash/{name}", f"sub/{name}")
            os.rmdir("stash")
        except OSError:
            pass
"""


@contextmanager
def swapping(workdir: str, out: Path) -> Iterator[int]:
    """A daemon swapping ``sub`` under ``workdir``; yields its process group, killed after."""
    os.mkdir(os.path.join(workdir, "sub"))
    daemon = subprocess.Popen(
        [sys.executable, "-c", SWAPPER, workdir, str(out)], start_new_session=True
    )
    try:
        yield daemon.pid
    finally:
        os.killpg(daemon.pid, signal.SIGKILL)
        daemon.wait()


def swap_the_workdir_run(outside: Path) -> tuple[ScenarioSpec, ScriptedAgent]:
    """A run whose command replaces its own workdir by a link to ``outside``, then writes."""
    agent = ScriptedAgent(
        [
            step("check_status", {"command": f'd=$PWD; cd /; rm -rf "$d"; ln -s {outside} "$d"'}),
            step("generate_script", {"path": "check.sh", "content": "echo pwned"}),
        ]
    )
    return ScenarioSpec(id="swap", goal="check it", files={"seed.txt": "x"}), agent


# -- chat-completions servers ------------------------------------------------------------


Answer = Callable[[dict[str, Any]], tuple[int, object]]


def completion(text: object) -> dict[str, object]:
    """A chat-completions reply whose one message says ``text``."""
    return {"choices": [{"message": {"role": "assistant", "content": text}}]}


class ChatApp:
    """An ASGI app that answers each POST with ``answer(body)`` (status, JSON or bytes) and
    remembers the bodies and headers it got."""

    def __init__(self, answer: Answer) -> None:
        self.answer = answer
        self.bodies: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []

    async def __call__(self, scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
        request = b""
        while True:
            message = await receive()
            request += message.get("body", b"")
            if not message.get("more_body"):
                break
        body = json.loads(request)
        self.bodies.append(body)
        self.headers.append({k.decode(): v.decode() for k, v in scope["headers"]})
        status, reply = self.answer(body)
        payload = reply if isinstance(reply, bytes) else json.dumps(reply).encode()
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": payload})

    @property
    def formats(self) -> list[str]:
        """The response format of each request, ``none`` where it had none."""
        return [b.get("response_format", {}).get("type", "none") for b in self.bodies]

    def client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=httpx.ASGITransport(app=self))


class ChatServer:
    """A real HTTP/1.1 server that answers each request with a chat completion saying
    ``answer`` (or ``answer(body)``), remembers the request bodies, and counts the
    connections clients opened and closed."""

    def __init__(self, answer: str | Callable[[dict[str, Any]], str]) -> None:
        self.answer = answer
        self.bodies: list[dict[str, Any]] = []
        self.port = 0
        self.opened = 0
        self.closed = 0
        self.requests = 0
        self._change = anyio.Event()

    async def serve(self, stream: SocketStream) -> None:
        self.opened += 1
        buffer = b""
        async with stream:
            try:
                while True:
                    while b"\r\n\r\n" not in buffer:
                        buffer += await stream.receive()
                    head, _, buffer = buffer.partition(b"\r\n\r\n")
                    length = re.search(rb"(?im)^content-length:\s*(\d+)", head)
                    assert length is not None
                    while len(buffer) < int(length.group(1)):
                        buffer += await stream.receive()
                    body, buffer = buffer[: int(length.group(1))], buffer[int(length.group(1)) :]
                    request = json.loads(body)
                    self.bodies.append(request)
                    text = self.answer if isinstance(self.answer, str) else self.answer(request)
                    reply = json.dumps(completion(text)).encode()
                    self.requests += 1
                    await stream.send(
                        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                        b"content-length: %d\r\n\r\n%s" % (len(reply), reply)
                    )
            except (anyio.EndOfStream, anyio.BrokenResourceError):
                self.closed += 1
                self._change.set()

    async def all_closed(self) -> None:
        """Returns once the clients closed every connection they opened."""
        while self.closed < self.opened:
            self._change = anyio.Event()
            await self._change.wait()


@asynccontextmanager
async def chat_server(answer: str | Callable[[dict[str, Any]], str]) -> AsyncIterator[ChatServer]:
    """A :class:`ChatServer` listening on 127.0.0.1 for the time of the block."""
    server = ChatServer(answer)
    async with (
        await anyio.create_tcp_listener(local_host="127.0.0.1") as listener,
        anyio.create_task_group() as tg,
    ):
        server.port = listener.extra(SocketAttribute.local_port)
        tg.start_soon(listener.serve, server.serve)
        yield server
        tg.cancel_scope.cancel()


# -- review ------------------------------------------------------------------------------


def assessed(action: str, payload: dict[str, str] | None = None, **assessment: object) -> str:
    """A step with a commitment and a self-assessment (``assessment`` overrides its fields)."""
    data = json.loads(step(action, payload))
    data["assessment"] = {"commitment_met": True, "confidence": 0.9} | assessment
    data["commitment"] = {"interpretation": "check the config", "assumptions": ["a"]}
    return json.dumps(data)


class ScriptedReviewer:
    """Answers with the given verdicts in turn and remembers what it was asked."""

    def __init__(self, *verdicts: ReviewVerdict, delay: float = 0.0) -> None:
        self.verdicts = list(verdicts)
        self.requests: list[ReviewRequest] = []
        self.delay = delay

    async def review(self, request: ReviewRequest) -> ReviewVerdict:
        self.requests.append(request)
        await anyio.sleep(self.delay)
        return self.verdicts.pop(0) if len(self.verdicts) > 1 else self.verdicts[0]


def replaying(*messages: str) -> tuple[CallableAgent, list[Turn]]:
    """An agent sending ``messages`` in turn, and the list of turns it was handed."""
    seen: list[Turn] = []

    async def agent(turn: Turn) -> str | None:
        seen.append(turn)
        return messages[turn.step - 1] if turn.step <= len(messages) else None

    return CallableAgent(agent), seen


def cmbs(*args: str | bytes, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``cmbs ARGS`` as a user runs it, stdin closed, its output captured as text."""
    return subprocess.run(
        [*CMBS, *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env=env,
        stdin=subprocess.DEVNULL,
    )


def one_line_exit_2(done: subprocess.CompletedProcess[str]) -> None:
    """A usage mistake: one line on stderr, exit status 2, no traceback."""
    assert "Traceback" not in done.stderr, done.stderr[-2000:]
    assert done.returncode == 2, done.stderr[-2000:]
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
