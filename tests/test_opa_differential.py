"""``cmbs-opa eval`` against the real ``opa eval`` (OPA v1.22.3, built by
``tools/k8s/build.sh``; marker ``k8s``): the same policy, input and query given to both,
as IT-Bench's evaluation calls them (``eval --data policy.rego --input collected_data.json
data.check.result --format raw``).

Each case says what both answer when they agree, or what each answers and why they
differ, so that a change in either program shows up here. The differences:

- any refusal exits 2 from ``opa`` and 1 from ``cmbs-opa`` (its 2 is a usage error);
  IT-Bench only sees that the command failed;
- ``not`` inside ``every`` is refused by ``cmbs-opa`` on purpose (its engine, regopy,
  answers it wrongly; see cmbs_async/tools/rego_syntax.py);
- ``--format raw``: a number written ``2.0`` stays ``2.0`` in ``opa``, ``2`` in
  ``cmbs-opa``;
- ``opa`` reads a YAML input, ``cmbs-opa`` JSON only;
- the words of a refusal (regopy's or cmbs-opa's own, OPA's own); an evaluation error
  (conflicting values) is only "could not be evaluated" in ``cmbs-opa``: regopy names
  no reason.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from .k8s_plane import k8s_tools

pytestmark = pytest.mark.k8s

CMBS_OPA = str(Path(sys.executable).parent / "cmbs-opa")


@dataclass(frozen=True)
class Answer:
    """What one program did: exit status, stdout (exactly, or a pattern it matches) and a
    piece of stderr (``""``: stderr is empty)."""

    status: int
    stdout: str | re.Pattern[str]
    stderr: str = ""

    def check(self, done: subprocess.CompletedProcess[str]) -> None:
        assert done.returncode == self.status, done.stderr
        if isinstance(self.stdout, str):
            assert done.stdout == self.stdout
        else:
            assert self.stdout.match(done.stdout), done.stdout
        if self.stderr:
            assert self.stderr in done.stderr
        else:
            assert done.stderr == ""


@dataclass(frozen=True)
class Case:
    policy: str
    input: str
    opa: Answer
    cmbs_opa: Answer | None = None  # None: the same as opa's
    why: str = ""  # why they differ; required exactly when they do
    query: str = "data.check.result"
    options: tuple[str, ...] = ()
    input_name: str = "collected_data.json"


def refused(policy: str, input: str, message: str, **differs: str) -> Case:
    """Both refuse, nothing on stdout, opa's ``message`` on stderr (and cmbs-opa's too,
    unless ``cmbs_message`` says otherwise, ``why``); the exit status differs."""
    cmbs_message = differs.get("cmbs_message", message)
    return Case(
        policy,
        input,
        opa=Answer(2, "", message),
        cmbs_opa=Answer(1, "", cmbs_message),
        why=differs.get("why", "a refusal exits 2 from opa, 1 from cmbs-opa"),
    )


X11 = 'package check\n\ndefault result := false\n\nresult if input.x11_forwarding == "no"\n'
V0 = 'package check\n\ndefault result = false\n\nresult {\n  input.x11_forwarding == "no"\n}\n'
#: IT-Bench's kubectl-opa shape: package check, result over the items of `kubectl get -o json`
HOST_NETWORK = """package check

default result := false

result if count(host_network) == 0

host_network contains pod.metadata.name if {
    some pod in input.items
    pod.spec.hostNetwork
}
"""
EVERY_NOT = """package check

default result := false

result if {
    every pod in input.items {
        not pod.spec.hostNetwork
    }
}
"""
EVERY_RULE = """package check

default result := false

result if {
    every pod in input.items {
        isolated(pod)
    }
}

isolated(pod) if not pod.spec.hostNetwork
"""
VALUES = """package check

text := "café \\"q\\""
object := {"b": 1, "a": [1, 2.5, "x"]}
number := 2.0
"""


def pods(*host_network: bool) -> str:
    """A Pod list as ``kubectl get pods -o json`` prints it (the fields a policy reads)."""
    listed = [
        {"kind": "Pod", "metadata": {"name": f"nginx-{i}"}, "spec": {"hostNetwork": h}}
        for i, h in enumerate(host_network)
    ]
    return json.dumps({"apiVersion": "v1", "kind": "List", "items": listed})


CASES = {
    "v1 policy, fault present": Case(X11, '{"x11_forwarding": "yes"}', Answer(0, "false\n")),
    "v1 policy, fault absent": Case(X11, '{"x11_forwarding": "no"}', Answer(0, "true\n")),
    "kubectl-opa shape, a host-network pod": Case(HOST_NETWORK, pods(True), Answer(0, "false\n")),
    "kubectl-opa shape, no host-network pod": Case(
        HOST_NETWORK, pods(False, False), Answer(0, "true\n")
    ),
    "v0 syntax": refused(
        V0,
        '{"x11_forwarding": "no"}',
        "policy.rego:5: rego_parse_error: `if` keyword is required before rule body",
    ),
    "v0 syntax with --v0-compatible": Case(
        V0, '{"x11_forwarding": "no"}', Answer(0, "true\n"), options=("--v0-compatible",)
    ),
    "syntax error": Case(
        "package check\nthis is not rego\n",
        "{}",
        opa=Answer(2, "", "policy.rego:2: rego_parse_error: var cannot be used for rule name"),
        cmbs_opa=Answer(1, "", "cmbs-opa: rego error:"),
        why="a refusal exits 2 from opa, 1 from cmbs-opa; each says it in its own words",
    ),
    "undefined result": Case(
        "package check\n\nresult if input.x == 1\n", '{"x": 2}', Answer(0, "")
    ),
    "undefined rule": Case(X11, "{}", Answer(0, ""), query="data.check.nope"),
    "not inside every": Case(
        EVERY_NOT,
        pods(True, False),
        opa=Answer(0, "false\n"),
        cmbs_opa=Answer(1, "", "cmbs-opa cannot evaluate `not` inside `every`"),
        why="intended: cmbs-opa refuses what regopy answers wrongly (rego_syntax.py)",
    ),
    "every calling a rule (the way round it)": Case(
        EVERY_RULE, pods(True, False), Answer(0, "false\n")
    ),
    "raw string": Case(VALUES, "{}", Answer(0, 'café "q"\n'), query="data.check.text"),
    "raw object": Case(
        VALUES, "{}", Answer(0, '{"a":[1,2.5,"x"],"b":1}\n'), query="data.check.object"
    ),
    "raw number 2.0": Case(
        VALUES,
        "{}",
        opa=Answer(0, "2.0\n"),
        cmbs_opa=Answer(0, "2\n"),
        why="opa keeps the number as written",
        query="data.check.number",
    ),
    "conflicting values": refused(
        "package check\n\nresult := x if { some x in input.items }\n",
        '{"items": [1, 2]}',
        "eval_conflict_error: rule data.check.result produced conflicting values",
        cmbs_message="cmbs-opa: rego error: the query could not be evaluated",
        why="a refusal exits 2 from opa, 1 from cmbs-opa; regopy names no reason",
    ),
    "YAML input": Case(
        X11,
        'x11_forwarding: "no"\n',
        opa=Answer(0, "true\n"),
        cmbs_opa=Answer(1, "", "cmbs-opa: input is not JSON"),
        why="opa reads YAML input; cmbs-opa JSON only",
        input_name="collected_data.yaml",
    ),
}


@pytest.fixture(scope="module")
def opa() -> str:
    return str(k8s_tools("opa") / "opa")


def evaluate(program: str, case: Case, folder: Path) -> subprocess.CompletedProcess[str]:
    """``PROGRAM eval`` as IT-Bench's evaluate.yml calls it, in ``folder``."""
    return subprocess.run(
        [program, "eval", "--data", "policy.rego", "--input", case.input_name, case.query]
        + ["--format", "raw", *case.options],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=folder,
        stdin=subprocess.DEVNULL,
    )


@pytest.mark.parametrize("name", list(CASES))
def test_opa_and_cmbs_opa_agree_or_differ_as_documented(
    opa: str, tmp_path: Path, name: str
) -> None:
    case = CASES[name]
    differs = case.cmbs_opa is not None and case.cmbs_opa != case.opa
    assert differs == bool(case.why), "a difference must say why, and only a difference"
    (tmp_path / "policy.rego").write_text(case.policy)
    (tmp_path / case.input_name).write_text(case.input)
    case.opa.check(evaluate(opa, case, tmp_path))
    (case.cmbs_opa or case.opa).check(evaluate(CMBS_OPA, case, tmp_path))


def test_json_format_gives_the_same_value(opa: str, tmp_path: Path) -> None:
    """The default format: the same value; opa adds each expression's location."""
    (tmp_path / "policy.rego").write_text(HOST_NETWORK)
    (tmp_path / "collected_data.json").write_text(pods(True))
    answers = []
    for program in (opa, CMBS_OPA):
        done = subprocess.run(
            [program, "eval", "-d", "policy.rego", "-i", "collected_data.json", "data.check"],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=tmp_path,
        )
        assert done.returncode == 0, done.stderr
        answers.append(json.loads(done.stdout)["result"][0]["expressions"][0])
    from_opa, from_cmbs_opa = answers
    assert (
        from_opa["value"]
        == from_cmbs_opa["value"]
        == {
            "result": False,
            "host_network": ["nginx-0"],
        }
    )
    assert from_opa.pop("location") == {"row": 1, "col": 1}
    assert from_opa == from_cmbs_opa
