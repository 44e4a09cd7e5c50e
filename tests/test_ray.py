"""The Ray backend on a local Ray cluster started by the test (marker ``ray``): the same
batch gives the same results as the local backend."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
from pathlib import Path

import pytest

from .helpers import CMBS, SOLVE, evaluated_files, step

pytestmark = [
    pytest.mark.ray,
    pytest.mark.skipif(
        importlib.util.find_spec("ray") is None and not os.environ.get("CI"),
        reason="install the ray extra: pip install -e '.[ray]'",
    ),
]


def test_a_small_batch_on_ray_matches_the_local_backend(tmp_path: Path) -> None:
    folder = tmp_path / "scenarios"
    folder.mkdir()
    for i in range(3):
        spec = {"id": f"ray-{i}", "goal": "g", "deadline_s": 30, "files": evaluated_files()}
        (folder / f"s{i}.yaml").write_text(json.dumps(spec))
    good = tmp_path / "good.jsonl"
    good.write_text("\n".join(SOLVE) + "\n")
    liar = tmp_path / "liar.jsonl"
    liar.write_text(step("declare_posture", {"posture": "compliant"}, posture="compliant") + "\n")
    results = {}
    for backend in ("asyncio", "ray"):
        out = tmp_path / f"{backend}.jsonl"
        done = subprocess.run(
            [
                *CMBS,
                "batch",
                str(folder),
                "--agent",
                f"script:{good}",
                "--agent",
                f"script:{liar}",
                "--repeat",
                "2",
                "--out",
                str(out),
                "--backend",
                backend,
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 3, done.stderr[-2000:]
        records = [json.loads(line) for line in out.read_text().splitlines()]
        results[backend] = {
            r["key"]: (r["outcome"], r["posture"], [t["verdict"] for t in r["trace"]])
            for r in records
        }
    assert len(results["ray"]) == 12
    assert results["ray"] == results["asyncio"]
    assert sum(o == "terminated" for o, _, _ in results["ray"].values()) == 6
