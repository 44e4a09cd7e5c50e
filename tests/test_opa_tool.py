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


V0 = {
    "a rule body without if": (
        'package check\n\ndefault result = false\n\nresult {\n  input.x11_forwarding == "no"\n}\n',
        "policy.rego:5: rego_parse_error: `if` keyword is required before rule body",
    ),
    "a partial set without contains": (
        'package check\n\nresult[msg] {\n  msg := "x"\n}\n',
        "policy.rego:3: rego_parse_error: `contains` keyword is required for partial set rules",
    ),
}


@pytest.mark.parametrize("form", list(V0))
def test_rego_v0_is_refused_as_opa_1_refuses_it_unless_v0_compatible(
    tmp_path: Path, form: str
) -> None:
    module, message = V0[form]
    (tmp_path / "policy.rego").write_text(module)
    (tmp_path / "in.json").write_text('{"x11_forwarding": "no"}')
    query = ["-d", "policy.rego", "-i", "in.json", "--format", "raw", "data.check.result"]
    refused = opa(tmp_path, *query)
    assert refused.returncode == 1 and refused.stdout == ""
    assert refused.stderr == f"cmbs-opa: {message}\n"
    accepted = opa(tmp_path, *query, "--v0-compatible")
    assert accepted.returncode == 0 and accepted.stdout != "", accepted.stderr


def test_v1_forms_that_look_alike_are_accepted(tmp_path: Path) -> None:
    (tmp_path / "policy.rego").write_text(
        "package check\n\n"
        "# result { a comment }\n"
        'labels := {"a": 1}\n'
        'names := {n | some n in ["a", "b"]}\n'
        'deny contains msg if { msg := "{" }\n'
        "result := true if {\n  count(deny) == 1\n} else := false\n"
    )
    (tmp_path / "in.json").write_text("{}")
    done = opa(
        tmp_path, "-d", "policy.rego", "-i", "in.json", "--format", "raw", "data.check.result"
    )
    assert (done.returncode, done.stdout) == (0, "true\n"), done.stderr


@pytest.mark.parametrize("spelled", ["--input=--", "-i--", "-i=--"])
def test_an_input_argparse_would_drop_is_a_usage_error(tmp_path: Path, spelled: str) -> None:
    """argparse reads `--input=--` as no input at all: an evaluation with no input never
    runs in its place."""
    (tmp_path / "policy.rego").write_text(POLICY)
    (tmp_path / "--").write_text(json.dumps({"x11_forwarding": "yes"}))
    done = opa(tmp_path, "-d", "policy.rego", spelled, "--format", "raw", "data.check.result")
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.splitlines()[-1] == "cmbs-opa: error: --input needs a file"


@pytest.mark.parametrize(
    "body",
    ["every p in input.pods { not p.host_network }", "every x in [1, 2] { not x == 2 }"],
)
def test_not_inside_every_is_refused_rather_than_answered_wrongly(
    tmp_path: Path, body: str
) -> None:
    """regopy says true where OPA says false: no answer beats a wrong one."""
    (tmp_path / "policy.rego").write_text(
        f"package check\n\ndefault result := false\n\nresult if {{\n  {body}\n}}\n"
    )
    (tmp_path / "in.json").write_text('{"pods": [{"host_network": true}]}')
    done = opa(
        tmp_path, "-d", "policy.rego", "-i", "in.json", "--format", "raw", "data.check.result"
    )
    assert (done.returncode, done.stdout) == (1, "")
    assert "policy.rego:6: cmbs-opa cannot evaluate `not` inside `every`" in done.stderr


def test_the_way_around_it_gives_opas_answer(tmp_path: Path) -> None:
    (tmp_path / "policy.rego").write_text(
        "package check\n\ndefault result := false\n\n"
        "allowed(p) if not p.host_network\n\n"
        "result if {\n  every p in input.pods { allowed(p) }\n"
        '  not input.note == "every { not }"\n}\n'
    )
    for pods, printed in (('[{"host_network": true}]', "false\n"), ("[{}]", "true\n")):
        (tmp_path / "in.json").write_text(f'{{"pods": {pods}}}')
        done = opa(
            tmp_path, "-d", "policy.rego", "-i", "in.json", "--format", "raw", "data.check.result"
        )
        assert (done.returncode, done.stdout) == (0, printed), done.stderr
