"""CI: the plain install (``pip install .``, no extras) runs the demo and a run over SSH,
and ``cmbs mcp`` says in one line which extra it needs.

Usage: ``python .ci/plain_install.py PATH/TO/cmbs`` with that venv's ``cmbs``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.sshd import LocalSshd  # noqa: E402 - a real sshd, as the SSH tests start it

STEP = {
    "belief": {"affordances": {}, "posture": "unknown", "evidence": "none"},
    "action": {"type": "check_status", "payload": {"command": "echo hello over ssh"}},
}


def main() -> None:
    cmbs = sys.argv[1]
    demo = subprocess.run([cmbs, "demo", "--no-audit"], capture_output=True, text=True)
    assert demo.returncode == 0, demo.stdout + demo.stderr
    with LocalSshd() as sshd, tempfile.TemporaryDirectory() as folder:
        scenario, steps = Path(folder) / "s.yaml", Path(folder) / "steps.jsonl"
        scenario.write_text("id: plain\ngoal: g\n")
        steps.write_text(json.dumps(STEP) + "\n")
        run = subprocess.run(
            [cmbs, "run", str(scenario), "--agent", f"script:{steps}", "--no-audit", "--json"]
            + ["--executor", sshd.url, "--identity", sshd.client_key]
            + ["--known-hosts", sshd.known_hosts],
            capture_output=True,
            text=True,
        )
        assert run.returncode == 3, run.stdout + run.stderr
        observed = json.loads(run.stdout)["trace"][0]
        assert observed["stdout"] == "hello over ssh\n", observed
        served = subprocess.run(
            [cmbs, "mcp", str(scenario)], capture_output=True, text=True, stdin=subprocess.DEVNULL
        )
        assert served.returncode == 2 and "pip install 'cmbs-async[mcp]'" in served.stderr, served
    print("plain install: demo and an SSH run work; cmbs mcp says what it needs")


if __name__ == "__main__":
    main()
