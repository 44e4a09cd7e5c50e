"""The stdio agent: a program in any language, speaking JSON lines."""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from cmbs_async import Outcome, ScenarioSpec, StdioAgent, run_scenario
from cmbs_async.agents.stdio import AgentSandbox, Isolation
from executors import LocalExecutor, NullExecutor
from executors.sandbox import FRESH_UIDS, find_bwrap

from .helpers import EVALUATE, evaluated_files, live_pids, processes_with, unique_seconds

pytestmark = pytest.mark.anyio

SPEC = ScenarioSpec(id="stdio", goal="check", deadline_s=20, files=evaluated_files())

PYTHON_AGENT = r"""
import json, sys
for line in sys.stdin:
    turn = json.loads(line)
    masks = (turn["response"] or {}).get("masks") or {}
    evidence = masks.get("evidence", "none")
    if evidence != "successful":
        step = {"action": {"type": "check_status", "payload": {"command": "EVALUATE"}}}
    elif masks["posture_history"][-1:] != ["non_compliant"]:
        step = {"action": {"type": "declare_posture", "payload": {"posture": "non_compliant"}}}
    else:
        step = {"action": {"type": "terminate", "payload": {}}}
    posture = "non_compliant" if evidence == "successful" else "unknown"
    step["belief"] = {"posture": posture, "evidence": evidence}
    print(json.dumps(step), flush=True)
""".replace("EVALUATE", EVALUATE)

SHELL_AGENT = r"""
read turn
echo '{"belief": {}, "action": {"type": "check_status", "payload": {"command": "true"}}}'
read turn
echo 'this is not json'
read turn
"""


async def test_a_python_program_earns_termination(tmp_path: Path) -> None:
    script = tmp_path / "agent.py"
    script.write_text(PYTHON_AGENT)
    result = await run_scenario(
        SPEC, agent=StdioAgent([sys.executable, str(script)]), executor=LocalExecutor()
    )
    assert result.outcome is Outcome.TERMINATED and result.posture == "non_compliant"
    assert [t.action for t in result.trace] == ["check_status", "declare_posture", "terminate"]


async def test_a_shell_program_and_its_invalid_line(tmp_path: Path) -> None:
    script = tmp_path / "agent.sh"
    script.write_text(SHELL_AGENT)
    result = await run_scenario(SPEC, agent=StdioAgent(f"sh {script}"), executor=NullExecutor())
    assert result.outcome is Outcome.AGENT_FINISHED
    assert [t.verdict.value for t in result.trace] == ["ALLOW", "CONTINUE"]
    assert result.trace[1].message == "Invalid format. Re-emit."


async def test_a_crash_is_an_agent_error_with_its_stderr(tmp_path: Path) -> None:
    agent = StdioAgent("read turn; echo 'Traceback: model weights missing' >&2; exit 3")
    result = await run_scenario(SPEC, agent=agent, executor=NullExecutor())
    assert result.outcome is Outcome.AGENT_ERROR
    assert result.reason is not None
    assert "exited with status 3" in result.reason
    assert "Traceback: model weights missing" in result.reason


#: one step, then its input closed and gone before the runtime can write the next turn
STEP_THEN_CLOSE = (
    "read turn; exec 0<&-; "
    """echo '{"belief": {}, "action": {"type": "terminate", "payload": {}}}'; """
)


@pytest.mark.parametrize("isolate", ["group", "sandbox"])
@pytest.mark.parametrize(
    ("after", "outcome", "said"),
    [
        ("exit 0", Outcome.AGENT_FINISHED, None),
        ("exit 4", Outcome.AGENT_ERROR, "exited with status 4"),
        ("sleep 30", Outcome.AGENT_ERROR, "closed its input"),
    ],
    ids=["exits", "fails", "stays"],
)
async def test_a_program_that_closes_its_input_ends_as_its_exit_says(
    isolate: Isolation, after: str, outcome: Outcome, said: str | None
) -> None:
    """Whether the runtime writes the next turn before the program has gone or after, its
    end is the same: a good exit finishes the run, a bad one or a program still running
    that will not read is an error."""
    if isolate == "sandbox" and find_bwrap() is None:
        pytest.skip("bubblewrap is not installed")
    agent = StdioAgent(STEP_THEN_CLOSE + after, isolate=isolate)
    result = await run_scenario(SPEC, agent=agent, executor=NullExecutor())
    assert result.outcome is outcome and result.steps == 1
    assert result.reason is None if said is None else said in (result.reason or "")


CHATTY_CRASH = (
    "read turn; i=0; while [ $i -lt 3000 ]; do "
    'echo "log line $i, padded ..................................................." >&2; '
    "i=$((i+1)); done; echo 'Traceback: the end' >&2; exit 3"
)


@pytest.mark.parametrize("isolate", ["group", "sandbox"])
async def test_a_crash_keeps_the_last_64_kib_of_its_stderr_in_the_result(
    isolate: Isolation,
) -> None:
    """Some 250 KiB on stderr, then a crash: the result keeps the last 64 KiB as written
    (lines and all), the reason the end of it on one line."""
    if isolate == "sandbox" and find_bwrap() is None:
        pytest.skip("bubblewrap is not installed")
    result = await run_scenario(
        SPEC, agent=StdioAgent(CHATTY_CRASH, isolate=isolate), executor=NullExecutor()
    )
    assert result.outcome is Outcome.AGENT_ERROR and result.reason is not None
    kept = result.agent_stderr
    assert kept is not None and kept.endswith(
        "log line 2999, padded " + "." * 51 + "\nTraceback: the end\n"
    )
    assert 60_000 < len(kept.encode()) <= 64 << 10 and "log line 0," not in kept
    assert result.summary()["agent_stderr"] == kept and "agent_stderr" not in result.summary(
        output=False
    )
    assert "Traceback: the end" in result.reason and "\n" not in result.reason
    assert len(result.reason) < 2200


async def test_a_hang_is_an_agent_error_and_the_program_is_gone(tmp_path: Path) -> None:
    script = tmp_path / "agent.sh"
    script.write_text("echo 'thinking...' >&2\nwhile :; do sleep 1; done\n")
    agent = StdioAgent(f"sh {script}", step_timeout=0.5)
    with anyio.fail_after(10):
        result = await run_scenario(SPEC, agent=agent, executor=NullExecutor())
    assert result.outcome is Outcome.AGENT_ERROR
    assert result.reason is not None and "gave no step within 0.5 s" in result.reason
    assert "thinking..." in result.reason
    assert running(str(tmp_path)) == []


def running(marker: str) -> list[int]:
    """Pids of the live processes whose command line mentions ``marker``."""
    pids = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        if marker.encode() in cmdline:
            pids.append(int(entry))
    return live_pids(pids)


CHILD = """trap "" TERM
touch "{started}/$$"
while :; do sleep {mark}; done
"""

# Its children start, then it reports, as the command of its one step, the PID namespace it
# sees (the executor echoes it into the trace); then it holds on or leaves.
STUBBORN_AGENT = """trap "" TERM
read turn
mkdir -p {started}
{children}
while [ "$(ls {started} | wc -l)" -lt {count} ]; do sleep 0.05; done
ns=$(readlink /proc/self/ns/pid)
step='{{"belief": {{}}, "action": {{"type": "check_status", "payload": {{"command": "echo %s"}}}}}}'
printf "$step\\n" "$ns"
read turn
{ending}
"""

HOLDS_ON = "echo\nwhile :; do sleep 1; done"  # says it is done, then stays (TERM ignored)
LEAVES = "exit 0"  # leaves its children behind

# (their output goes elsewhere: a child holding the program's stdout would delay its end)
IN_GROUP = ["sh {child} >&2 &", "sh -c 'sh {child} &' >&2"]  # a child, an orphaned grandchild
SETSID = ["setsid sh {child} >&2 &"]  # a session (and process group) of its own


@pytest.mark.parametrize("ending", [HOLDS_ON, LEAVES], ids=["holds-on", "leaves"])
@pytest.mark.parametrize(
    ("isolate", "children"),
    [("auto", IN_GROUP + SETSID), ("group", IN_GROUP)],
    ids=["auto", "group"],
)
async def test_nothing_a_program_starts_outlives_it(
    tmp_path: Path, isolate: Isolation, children: list[str], ending: str
) -> None:
    """The program and its children ignore TERM; one child is orphaned, one calls setsid
    (which only a PID namespace contains)."""
    mark = unique_seconds()
    started = f"/tmp/started-{mark}"  # the sandbox's private /tmp, or the host's
    child = tmp_path / "child.sh"
    child.write_text(CHILD.format(started=started, mark=mark))
    script = tmp_path / "agent.sh"
    script.write_text(
        STUBBORN_AGENT.format(
            started=started,
            count=len(children),
            ending=ending,
            children="\n".join(children).format(child=child),
        )
    )
    agent = StdioAgent(
        ["sh", str(script)], isolate=isolate, sandbox=AgentSandbox(readable=(str(child),))
    )
    try:
        with anyio.fail_after(30):
            async with LocalExecutor() as executor:
                result = await run_scenario(SPEC, agent=agent, executor=executor)
        assert result.outcome is Outcome.AGENT_FINISHED
        assert [t.verdict.value for t in result.trace] == ["ALLOW"]  # its children started
        seen = (result.trace[0].stdout or "").strip()
        assert (seen != os.readlink("/proc/self/ns/pid")) is (isolate == "auto")  # bwrap here
        assert processes_with(str(mark)) == []
    finally:
        shutil.rmtree(started, ignore_errors=True)


SEES = """read turn
step='{"belief": {}, "action": {"type": "check_status", "payload": {"command": "echo %s"}}}'
printf "$step\\n" "$API_KEY $(pwd) $(cat note) $(id -u) ${SECRET:-unset}"
read turn
"""


async def test_in_its_sandbox_the_program_sees_what_it_is_given_and_no_more(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its environment is the allow-list and what it is given; its directory and files
    are shown read-only; it runs as a user of its own (cmbs runs as root here)."""
    monkeypatch.setenv("API_KEY", "sk-123")
    monkeypatch.setenv("SECRET", "operator-only")
    (tmp_path / "note").write_text("hello")
    agent = StdioAgent(
        SEES,
        isolate="sandbox",
        cwd=str(tmp_path),
        pass_env=["API_KEY"],
        sandbox=AgentSandbox(readable=(str(tmp_path / "note"),)),
    )
    async with LocalExecutor() as executor:
        result = await run_scenario(SPEC, agent=agent, executor=executor)
    assert result.outcome is Outcome.AGENT_FINISHED
    key, cwd, note, uid, secret = (result.trace[0].stdout or "").split()
    assert (key, cwd, note, secret) == ("sk-123", str(tmp_path), "hello", "unset")
    assert int(uid) in FRESH_UIDS  # a user of its own, not root, not the commands'
    assert result.containment is not None and result.containment.user is not None
    assert f"({uid})" not in result.containment.user  # the commands run as another


@pytest.fixture
def no_bwrap(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A machine where bubblewrap is not installed."""
    monkeypatch.setenv("CMBS_BWRAP", "/nonexistent/bwrap")
    find_bwrap.cache_clear()
    yield
    monkeypatch.undo()
    find_bwrap.cache_clear()


async def test_without_bwrap_auto_falls_back_to_a_group_and_sandbox_refuses(
    tmp_path: Path, no_bwrap: None
) -> None:
    command = f"read turn; readlink /proc/self/ns/pid > {tmp_path}/ns"
    env = {"PATH": os.defpath}
    fallback = StdioAgent(command, isolate="auto", env=env)
    result = await run_scenario(SPEC, agent=fallback, executor=NullExecutor())
    assert result.outcome is Outcome.AGENT_FINISHED
    assert (tmp_path / "ns").read_text().strip() == os.readlink("/proc/self/ns/pid")
    refused = StdioAgent(command, isolate="sandbox", env=env)
    result = await run_scenario(SPEC, agent=refused, executor=NullExecutor())
    assert result.outcome is Outcome.AGENT_ERROR
    assert result.reason is not None
    assert "isolate='sandbox' needs bubblewrap" in result.reason


def test_an_unknown_isolation_is_a_clear_error() -> None:
    with pytest.raises(
        ValueError, match="isolate must be 'auto', 'sandbox' or 'group', not 'none'"
    ):
        StdioAgent("true", isolate="none")  # type: ignore[arg-type]


LONG_LINES = r"""
import sys
n = int(sys.argv[1])
step = '{"belief": {}, "action": {"type": "check_status", "payload": {"command": "true"}}}'
for width in (n, n + 1):
    sys.stdin.readline()
    print(step.ljust(width), flush=True)
sys.stdin.readline()
"""


async def test_a_line_of_max_line_bytes_passes_and_one_more_byte_fails(tmp_path: Path) -> None:
    script = tmp_path / "agent.py"
    script.write_text(LONG_LINES)
    agent = StdioAgent([sys.executable, str(script), "300"], max_line_bytes=300)
    result = await run_scenario(SPEC, agent=agent, executor=NullExecutor())
    assert [t.verdict.value for t in result.trace] == ["ALLOW"]
    assert result.outcome is Outcome.AGENT_ERROR
    assert result.reason is not None and "sent a line over 300 bytes" in result.reason


FLOOD = """
import sys
sys.stdin.readline()
chunk = b"x" * (1 << 20)
for _ in range(200):
    sys.stdout.buffer.write(chunk)
"""


def _reset_peak_rss() -> None:
    """VmHWM starts again from the current RSS (Linux 4.0+)."""
    Path("/proc/self/clear_refs").write_text("5")


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(field)


async def test_200_mib_without_a_newline_is_an_agent_error_in_flat_memory(
    tmp_path: Path,
) -> None:
    script = tmp_path / "flood.py"
    script.write_text(FLOOD)
    _reset_peak_rss()
    before = _status_kib("VmRSS")
    with anyio.fail_after(30):
        result = await run_scenario(
            SPEC, agent=StdioAgent([sys.executable, str(script)]), executor=NullExecutor()
        )
    growth_mib = (_status_kib("VmHWM") - before) / 1024
    assert result.outcome is Outcome.AGENT_ERROR
    assert result.reason is not None and "sent a line over 1048576 bytes" in result.reason
    assert growth_mib < 50, f"peak RSS grew by {growth_mib:.0f} MiB"
    assert running(str(tmp_path)) == []
