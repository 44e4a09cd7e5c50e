"""The gate on its own, inside your own async agent loop: no actors, no CLI.

Run it: ``python examples/library_gate.py``. Your loop proposes steps, the gate judges
each one, you execute what it allows (here with the local executor) and feed back what
really happened.
"""

from __future__ import annotations

import json
import tempfile

import anyio

from cmbs_async import CommandPayload, Gate, Verdict, load_profile
from executors import LocalExecutor


def proposal(action: str, payload: dict[str, str], posture: str, evidence: str) -> str:
    belief = {"posture": posture, "evidence": evidence}
    return json.dumps({"belief": belief, "action": {"type": action, "payload": payload}})


PLAN = [
    proposal("declare_posture", {"posture": "compliant"}, "compliant", "none"),
    proposal("check_status", {"command": "grep -c PermitRootLogin sshd_config"}, "unknown", "none"),
    proposal(
        "check_status",
        {"command": "grep -q 'PermitRootLogin no' sshd_config && echo true"},
        "unknown",
        "successful",
    ),
    proposal("declare_posture", {"posture": "compliant"}, "compliant", "successful"),
    proposal("terminate", {}, "compliant", "successful"),
]


async def main() -> None:
    gate = Gate(load_profile("ciso"))
    executor = LocalExecutor()
    with tempfile.TemporaryDirectory() as workdir:
        await executor.write_artifact(workdir, "sshd_config", "PermitRootLogin no\n")
        for raw in PLAN:
            decision = gate.decide(raw)
            print(f"{decision.action_type:16} {decision.verdict:9} {decision.message}")
            if isinstance(decision.payload, CommandPayload) and decision.needs_execution:
                command = decision.payload.command
                gate.observe(await executor.run_command(workdir, command, timeout=10))
            if decision.verdict is Verdict.TERMINATE:
                print("earned posture:", gate.final_posture)


if __name__ == "__main__":
    anyio.run(main)
