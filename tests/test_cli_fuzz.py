"""The command line driven with generated arguments, scenario files and step files: no
exception ever escapes (which a user would see as a traceback), every exit status is one
docs/reference/cli.md lists, and a failed start leaves no workdir and no results file behind."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cmbs_async.cli.main import main

from .helpers import step

FIELDS = ["id", "goal", "vars", "deadline_s", "max_steps", "files", "env", "pass_env"]
FIELDS += ["network", "readable", "profile", "command_timeout_s", "workdir", "nonsense"]

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=30),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=30,
)


def _nested(depth: int) -> list[Any]:
    value: list[Any] = []
    for _ in range(depth):
        value = [value]
    return value


deep = st.integers(1, 2000).map(_nested)
weird_text = st.text(max_size=40) | st.just("a\x00b") | st.just("x" * 100_000)
field_values = json_values | deep | weird_text | st.sampled_from(["demo", "ciso", "none"])


@st.composite
def scenario_files(draw: Any) -> bytes:
    kind = draw(st.sampled_from(["mapping", "mapping", "mapping", "bytes", "yaml"]))
    if kind == "bytes":
        return bytes(draw(st.binary(max_size=300)))
    if kind == "yaml":
        return str(draw(weird_text)).encode("utf-8", "surrogatepass")
    data = {"id": "fuzz", "goal": "g"}
    for name in draw(st.lists(st.sampled_from(FIELDS), max_size=4, unique=True)):
        if name != "workdir":  # a generated workdir would be a real directory somewhere
            data[name] = draw(field_values)
    try:
        return json.dumps(data).encode()  # JSON is YAML
    except RecursionError:  # deeper than json.dumps goes: write the nesting by hand
        return b'{"id": "fuzz", "goal": "g", "vars": ' + b"[" * 5000 + b"]" * 5000 + b"}"


commands = st.sampled_from(["true", "echo hi", "printf 'a\\0b'", "exit 3", "cat nope"])
step_lines = (
    commands.map(lambda c: step("check_status", {"command": c}))
    | st.just(step("generate_script", {"path": "/".join(["d"] * 1500), "content": "x"}))
    | json_values.map(lambda v: json.dumps(v))
    | st.text(max_size=50).map(lambda t: t.replace("\n", " "))
)
options = st.lists(
    st.sampled_from(
        [["--json"], ["--no-audit"], ["--sandbox", "none"], ["--backend", "trio"]]
        + [["--var", "x=1"], ["--var", "=="], ["--deadline", "-1"], ["--max-steps", "zero"]]
        + [["--max-steps", "2"], ["--log-level", "debug"], ["--human", "console"]]
        + [["--executor", "ftp://x"], ["--agent", "nope:"], ["--config", "/nonexistent"]]
    ),
    max_size=4,
)


def _workdirs() -> set[str]:
    return {p for p in os.listdir(tempfile.gettempdir()) if p.startswith("cmbs-")}


@pytest.fixture(autouse=True, scope="module")
def _private_tmp() -> Iterator[None]:
    """Temporary workdirs go to a folder of this module's own: what other processes put
    in /tmp meanwhile is no leak of this test's."""
    saved, tempfile.tempdir = tempfile.tempdir, tempfile.mkdtemp(prefix="fuzz-tmp-")
    try:
        yield
    finally:
        shutil.rmtree(tempfile.tempdir)
        tempfile.tempdir = saved


@pytest.mark.filterwarnings("ignore:Generating overly large repr")  # huge inputs, on purpose
@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    command=st.sampled_from(["run", "batch"]),
    scenario=scenario_files(),
    lines=st.lists(step_lines, max_size=4),
    chosen=options,
)
def test_no_input_gets_a_traceback(
    command: str, scenario: bytes, lines: list[str], chosen: list[list[str]]
) -> None:
    where = Path(tempfile.mkdtemp(prefix="fuzz-"))
    try:
        (where / "s.yaml").write_bytes(scenario)
        (where / "steps.jsonl").write_text("\n".join(lines), "utf-8", "surrogatepass")
        out = where / "results.jsonl"
        argv = [command, str(where / "s.yaml"), "--agent", f"script:{where / 'steps.jsonl'}"]
        for option in chosen:
            if command == "batch" and option[0] in ("--json", "--no-audit", "--var", "--human"):
                continue  # run's options: argparse's one-line refusal is tested elsewhere
            argv += option
        argv += ["--out", str(out)] if command == "batch" else ["--audit-db", str(where / "db")]
        argv += ["--deadline", "30"] if command == "run" else []
        before = _workdirs()
        stdout, stderr = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            try:
                status = main(argv)
            except SystemExit as exc:  # argparse's refusal of the arguments themselves
                status = exc.code
        assert status in (0, 2, 3), (status, stderr.getvalue())
        if status == 2:
            assert stderr.getvalue().count("\n") == 1, stderr.getvalue()
            assert not out.exists()
        assert _workdirs() <= before
    finally:
        shutil.rmtree(where)
