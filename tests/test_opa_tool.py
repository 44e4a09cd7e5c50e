"""``cmbs-opa eval`` on the real Rego engine (regopy), as the CISO scenarios call it."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("regopy") is None and not os.environ.get("CI"),
    reason="install the ciso extra (regopy)",
)

POLICY = """package check

import rego.v1

default result := false

result if input.x11_forwarding == "no"
"""


def opa(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cmbs_async.tools.opa", "eval", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )


@pytest.mark.parametrize(("value", "printed"), [("yes", "false\n"), ("no", "true\n")])
def test_raw_answers_are_bare_booleans(tmp_path: Path, value: str, printed: str) -> None:
    (tmp_path / "policy.rego").write_text(POLICY)
    (tmp_path / "in.json").write_text(json.dumps({"x11_forwarding": value}))
    done = opa(
        tmp_path, "-d", "policy.rego", "-i", "in.json", "--format", "raw", "data.check.result"
    )
    assert (done.returncode, done.stdout) == (0, printed)


def test_json_format_and_undefined(tmp_path: Path) -> None:
    (tmp_path / "policy.rego").write_text(POLICY)
    (tmp_path / "in.json").write_text('{"x11_forwarding": "no"}')
    done = opa(tmp_path, "-d", "policy.rego", "-i", "in.json", "data.check.result")
    assert json.loads(done.stdout)["result"][0]["expressions"][0]["value"] is True
    missing = opa(
        tmp_path, "-d", "policy.rego", "-i", "in.json", "--format", "raw", "data.check.nope"
    )
    assert (missing.returncode, missing.stdout) == (0, "")


def test_errors_are_one_line_and_exit_1(tmp_path: Path) -> None:
    (tmp_path / "bad.rego").write_text("package check\nthis is not rego\n")
    (tmp_path / "in.json").write_text("{}")
    done = opa(tmp_path, "-d", "bad.rego", "-i", "in.json", "--format", "raw", "data.check.result")
    assert done.returncode == 1 and "cmbs-opa: rego error" in done.stderr
    missing = opa(tmp_path, "-d", "none.rego", "data.check.result")
    assert missing.returncode == 1 and "no such file: none.rego" in missing.stderr
