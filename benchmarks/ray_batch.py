"""``cmbs batch`` on a two-node Ray cluster on this machine against the same batch run
locally, and the cost of the audit on Ray.

Run: ``python benchmarks/ray_batch.py [--scenarios 1000]``. Every run is a ``stdio:``
agent program (Python, in its sandbox) that runs two real commands in the scenario's
sandboxed workdir (``grep`` over the scenario's file) and stops. Three batches, back to
back in one run, the same jobs each time:

- ``local``: one process, ``--concurrency 16``, recorded into an audit database;
- ``ray``: two Ray nodes of one CPU each (``ray.cluster_utils.Cluster``), one worker per
  node, ``--concurrency 8`` each, recorded into the driver's audit database;
- ``ray --no-audit``: the same without the audit.

Prints runs per second for each and the ratios: Ray to local, and Ray with the audit to
Ray without. Both nodes share this machine's two cores with the driver, so the ratio says
what the distribution costs, not what more machines would buy.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CMBS = [sys.executable, "-m", "cmbs_async"]

PROGRAM = """\
import sys
for line in open(sys.argv[1]):
    if not sys.stdin.readline():
        break
    print(line.strip(), flush=True)
sys.stdin.readline()  # the turn after its last step: it is done, and says so by leaving
"""


def step(action: str, payload: dict[str, object], posture: str, evidence: str) -> str:
    return json.dumps(
        {
            "belief": {"posture": posture, "evidence": evidence},
            "action": {"type": action, "payload": payload},
        }
    )


STEPS = [
    step("check_status", {"command": "grep -c X11Forwarding sshd_config"}, "unknown", "none"),
    step("check_status", {"command": "grep X11Forwarding sshd_config"}, "unknown", "none"),
]


def prepare(root: Path, count: int) -> tuple[Path, str]:
    pack = root / "pack"
    pack.mkdir()
    for i in range(count):
        spec = {
            "id": f"b{i}",
            "goal": "Is X11 forwarding off?",
            "deadline_s": 120,
            "files": {"sshd_config": f"Port 22\nX11Forwarding {'yes' if i % 2 else 'no'}\n"},
        }
        (pack / f"s{i}.yaml").write_text(json.dumps(spec))
    steps, program = root / "steps.jsonl", root / "agent.py"
    steps.write_text("\n".join(STEPS) + "\n")
    program.write_text(PROGRAM)
    return pack, f"stdio:{sys.executable} {program} {steps}"


def timed(args: list[str], out: Path) -> float:
    started = time.perf_counter()
    done = subprocess.run(
        [*CMBS, "batch", *args, "--out", str(out)], capture_output=True, text=True
    )
    elapsed = time.perf_counter() - started
    lines = out.read_text().splitlines()
    if done.returncode not in (0, 3) or not lines:
        sys.exit(f"batch failed ({done.returncode}): {done.stderr[-2000:]}")
    outcomes = {json.loads(line)["outcome"] for line in lines}
    if outcomes != {"agent_finished"}:  # it ran its commands and stopped, every time
        sys.exit(f"not every run ended as the agent's: {outcomes}: {done.stderr[-1000:]}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenarios", type=int, default=1000)
    count = parser.parse_args().scenarios
    os.environ["RAY_AUTH_MODE"] = "token"  # as cmbs batch's own local cluster has it
    os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))
    from ray.cluster_utils import Cluster

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        pack, agent = prepare(root, count)
        common = [str(pack), "--agent", agent, "--audit-db", str(root / "audit.db")]
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        try:
            ray = [*common, "--backend", "ray", "--address", str(cluster.address)]
            times = {
                "local": timed([*common, "--concurrency", "16"], root / "local.jsonl"),
                "ray": timed([*ray, "--concurrency", "8"], root / "ray.jsonl"),
                "ray --no-audit": timed(
                    [*ray, "--concurrency", "8", "--no-audit"], root / "ray-noaudit.jsonl"
                ),
            }
        finally:
            cluster.shutdown()
    print(f"{count} scenarios, a stdio agent running real commands in its sandbox")
    print(f"{'batch':<16} {'seconds':>8} {'runs/s':>8}")
    for name, seconds in times.items():
        print(f"{name:<16} {seconds:8.1f} {count / seconds:8.1f}")
    print(f"ray / local, runs per second: {times['local'] / times['ray']:.2f}")
    print(f"ray with audit / without, time: {times['ray'] / times['ray --no-audit']:.2f}")


if __name__ == "__main__":
    main()
