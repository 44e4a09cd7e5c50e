"""Small builders shared by the tests."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from cmbs_async import ScenarioSpec, ScriptedAgent

#: The command line, as the installed ``cmbs`` runs it.
CMBS = [sys.executable, "-m", "cmbs_async"]


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
