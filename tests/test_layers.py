"""Imports go one way: ``cmbs_async`` builds on ``executors``, never the reverse; the audit
trail is storage that knows nothing of the gate or the review layer; and no module of the
package hides an import inside a function."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent


def test_executors_stand_on_their_own() -> None:
    probe = (
        "import sys, executors, executors.ssh, executors.sandbox, executors.workdir;"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'cmbs_async'))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    )
    assert done.stdout.strip() == "[]"


def test_the_audit_trail_loads_without_the_gate_the_review_layer_or_httpx() -> None:
    probe = (
        "import sys, cmbs_async.audit;"
        "print(sorted(m for m in sys.modules if m == 'httpx'"
        " or m.startswith(('cmbs_async.gate', 'cmbs_async.review'))))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    )
    assert done.stdout.strip() == "[]"


def test_no_import_of_the_package_inside_a_function() -> None:
    hidden = []
    for path in [*ROOT.glob("cmbs_async/**/*.py"), *ROOT.glob("executors/*.py")]:
        tree = ast.parse(path.read_text(), str(path))
        for function in ast.walk(tree):
            if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for node in ast.walk(function):
                if isinstance(node, ast.ImportFrom) and (
                    node.level > 0
                    or (node.module or "").split(".")[0] in ("cmbs_async", "executors")
                ):  # only optional third-party extras (ray, regopy) are imported late
                    hidden.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert hidden == []
