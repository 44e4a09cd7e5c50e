"""Small builders shared by the tests."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

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
