"""Your own async agent under the full runtime: an async function becomes an agent.

Run it: ``python examples/async_agent.py``. The function sees each turn (goal, the
supervisor's last response with the masks and what was observed) and returns its next
step; the runtime runs it against the gate and the local executor under the deadline.
"""

from __future__ import annotations

import json
import logging

import anyio

from cmbs_async import CallableAgent, ScenarioSpec, Turn, run_scenario

SPEC = ScenarioSpec(
    id="root-login",
    goal="Is root login over SSH disabled? The host's setting is in collected_data.json.",
    files={"collected_data.json": '{"permit_root_login": "yes"}\n'},
    deadline_s=20,
)
POLICY = 'package check\n\ndefault result := false\n\nresult if input.permit_root_login == "no"\n'
EVALUATE = "cmbs-opa eval -d policy.rego -i collected_data.json --format raw data.check.result"


async def agent(turn: Turn) -> str | None:
    """A tiny agent that reads the masks it is shown and never claims beyond them."""
    masks = turn.response.masks if turn.response else None
    belief = {"evidence": masks.evidence if masks else "none", "posture": "unknown"}
    if masks is None or masks.evidence == "none":
        action = {"type": "generate_policy", "payload": {"path": "policy.rego", "content": POLICY}}
    elif masks.evidence != "successful":
        action = {"type": "execute_opa", "payload": {"command": EVALUATE}}
    else:
        admissible = [p for p, ok in masks.posture_admissible.items() if ok]
        belief["posture"] = admissible[0]
        done = masks.posture_history[-1:] == (admissible[0],)
        action = (
            {"type": "terminate", "payload": {}}
            if done
            else {"type": "declare_posture", "payload": {"posture": admissible[0]}}
        )
    return json.dumps({"belief": belief, "action": action})


async def main() -> None:
    # The library configures no logging; an application picks what it wants to see. Its
    # events go to the standard logger "cmbs_async"; this shows warnings and up.
    logging.basicConfig(level=logging.WARNING)
    result = await run_scenario(SPEC, agent=CallableAgent(agent))
    for entry in result.trace:
        print(entry.step, entry.action, entry.verdict.value, entry.observed or "")
    print(result.outcome.value, result.posture)


if __name__ == "__main__":
    anyio.run(main)
