"""The gate on its own, inside your own async agent loop: no actors, no CLI.

Run it: ``python examples/library_gate.py``. Your loop proposes steps, the gate judges
each one, you execute what it allows (here with the local executor) and feed back what
really happened. The posture moves only on an evaluation the profile declares (cmbs-opa
here), run exactly as the gate judged it: ``run_evaluation`` runs ``decision.evaluation``
as its argument vector, by a program resolved outside the agent's reach, over input the
agent did not write.
"""

from __future__ import annotations

import json

import anyio

from cmbs_async import (
    ArtifactPayload,
    CommandPayload,
    Gate,
    Programs,
    Verdict,
    load_profile,
    run_evaluation,
)
from executors import LocalExecutor


def proposal(action: str, payload: dict[str, str], posture: str, evidence: str) -> str:
    belief = {"posture": posture, "evidence": evidence}
    return json.dumps({"belief": belief, "action": {"type": action, "payload": payload}})


POLICY = 'package check\n\ndefault result := false\n\nresult if input.permit_root_login == "no"\n'
EVALUATE = "cmbs-opa eval -d policy.rego -i collected.json --format raw data.check.result"
PLAN = [
    proposal("declare_posture", {"posture": "compliant"}, "compliant", "none"),
    proposal("generate_policy", {"path": "policy.rego", "content": POLICY}, "unknown", "none"),
    proposal("execute_opa", {"command": EVALUATE}, "unknown", "successful"),  # not yet true
    proposal("execute_opa", {"command": EVALUATE}, "unknown", "attempted"),
    proposal("declare_posture", {"posture": "compliant"}, "compliant", "successful"),
    proposal("terminate", {}, "compliant", "successful"),
]


async def main() -> None:
    gate = Gate(load_profile("ciso"))
    async with LocalExecutor() as executor:
        # what was collected before the agent's turn: not the agent's to write
        workdir = await executor.prepare(None, {"collected.json": '{"permit_root_login": "no"}'})
        programs = Programs(executor, workdir)  # each evaluator resolved once, then kept
        for raw in PLAN:
            decision = gate.decide(raw)
            print(f"{decision.action_type:16} {decision.verdict:9} {decision.message}")
            if not decision.needs_execution:
                pass
            elif decision.evaluation is not None:  # exactly what the gate judged, no shell
                evaluation = decision.evaluation
                observed = await run_evaluation(executor, workdir, evaluation, programs, timeout=10)
                gate.observe(observed)
            elif isinstance(decision.payload, ArtifactPayload):
                payload = decision.payload
                gate.observe(await executor.write_artifact(workdir, payload.path, payload.content))
            elif isinstance(decision.payload, CommandPayload):
                command = decision.payload.command
                gate.observe(await executor.run_command(workdir, command, timeout=10))
            if decision.verdict is Verdict.TERMINATE:
                print("earned posture:", gate.final_posture)
        await executor.cleanup(workdir)


if __name__ == "__main__":
    anyio.run(main)
