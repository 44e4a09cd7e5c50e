"""``cmbs batch`` for evaluating agents: expected postures with accuracy and a confusion
table, ``--retry-errors``, ``-k``, ``--maxfail``, failures by reason, the audit default of
``cmbs run``, and files that are no scenarios skipped with a note. Real processes: the
command line as a subprocess, scripted and stdio agents."""

from __future__ import annotations

import json
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest

from cmbs_async import CallableAgent, Turn
from cmbs_async.audit import default_data_dir, load_or_create_key
from cmbs_async.batch import (
    BatchError,
    Job,
    ResultLog,
    failures,
    keyword_filter,
    render_evaluation,
    run_batch,
)
from cmbs_async.demo import demo_scenario
from executors import LocalExecutor

from .helpers import CMBS, SOLVE, evaluated_files, step

LIE = [step("declare_posture", {"posture": "compliant"}, posture="compliant")]

#: A stdio agent (any language; Python here) that answers every turn with the next line
#: of SOLVE, and fails at its first turn, as an endpoint outage would, while FLAG exists
#: (having read the turn: one reason, however loaded the machine).
AGENT = """\
import os, sys
steps, flag = sys.argv[1], sys.argv[2]
for line in open(steps):
    if not sys.stdin.readline():
        break
    if os.path.exists(flag):
        sys.stderr.write("endpoint unreachable\\n")
        sys.exit(3)
    print(line.strip(), flush=True)
"""


def cmbs(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CMBS, "batch", *args], capture_output=True, text=True, timeout=300, cwd=cwd
    )


def scenarios(folder: Path, specs: dict[str, tuple[str, str | None]]) -> Path:
    """One scenario file per name: the X11 setting its data holds, the posture expected."""
    folder.mkdir(exist_ok=True)
    for name, (x11, expected) in specs.items():
        spec: dict[str, Any] = {
            "id": name,
            "goal": "Is X11 forwarding off?",
            "deadline_s": 60,
            "files": evaluated_files(x11),
        }
        if expected is not None:
            spec["expected"] = expected
        (folder / f"{name}.yaml").write_text(json.dumps(spec))
    return folder


def script(path: Path, lines: list[str]) -> str:
    path.write_text("\n".join(lines) + "\n")
    return f"script:{path}"


def results(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def block(stdout: str, title: str) -> list[str]:
    """The lines of the summary's section that starts with ``title``, up to a blank line."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(title))
    end = next((i for i in range(start, len(lines)) if not lines[i]), len(lines))
    return lines[start:end]


def test_accuracy_and_a_confusion_table_for_a_solver_and_a_liar(tmp_path: Path) -> None:
    folder = scenarios(
        tmp_path / "pack",
        {
            "on-1": ("yes", "non_compliant"),
            "on-2": ("yes", "non_compliant"),
            "off": ("no", "compliant"),
            "mislabelled": ("yes", "compliant"),  # the label is wrong: the run is not
            "unlabelled": ("yes", None),
        },
    )
    solve = script(tmp_path / "solve.jsonl", SOLVE)
    lie = script(tmp_path / "lie.jsonl", LIE)
    out = tmp_path / "r.jsonl"
    done = cmbs(str(folder), "--agent", solve, "--agent", lie, "--out", str(out), "--no-audit")
    assert done.returncode == 3, done.stderr  # not all earned

    lines = {(r["scenario_id"], r["agent"]): r for r in results(out)}
    assert len(lines) == 10
    got = {key: (r["expected"], r["correct"]) for key, r in lines.items()}
    assert got[("on-1", solve)] == ("non_compliant", True)
    assert got[("off", solve)] == ("compliant", False)  # blocked: it said non_compliant
    assert got[("mislabelled", solve)] == ("compliant", False)
    assert got[("unlabelled", solve)] == (None, None)
    assert got[("on-1", lie)] == ("non_compliant", False)

    table = block(done.stdout, "scenario")
    assert table[0].split()[:5] == ["scenario", "agent", "runs", "earned", "accuracy"]
    row = next(line for line in table if line.startswith("on-1") and "solve" in line)
    assert row.split()[2:5] == ["1", "1", "1.00"]
    row = next(line for line in table if line.startswith("unlabelled") and "solve" in line)
    assert row.split()[4] == "-"

    agents = block(done.stdout, "agent ")
    assert agents[0].split() == ["agent", "runs", "earned", "accuracy"]
    by_agent = {line.split()[0]: line.split()[1:] for line in agents[1:]}
    # accuracy: terminated with the expected posture / runs whose scenario expects one
    assert by_agent[solve] == ["5", "0.80", "(4/5)", "0.50", "(2/4)"]
    assert by_agent[lie] == ["5", "0.00", "(0/5)", "0.00", "(0/4)"]

    solver = block(done.stdout, f"confusion, {solve}")
    assert solver[1].split() == ["expected", "compliant", "non_compliant", "no", "posture"]
    assert solver[2].split() == ["compliant", "0", "1", "1"]
    assert solver[3].split() == ["non_compliant", "0", "2", "0"]
    liar = block(done.stdout, f"confusion, {lie}")
    assert liar[2].split() == ["compliant", "0", "0", "2"]
    assert liar[3].split() == ["non_compliant", "0", "0", "2"]

    failed = block(done.stdout, "failures by reason")
    assert failed[0] == "failures by reason (7 runs)"
    assert failed[1] == (
        "  agent_finished (5 runs): last step declare_posture: BLOCK, "
        "Posture declaration not permitted without successful execution."
    )
    assert failed[2] == "      scenarios: mislabelled, off, on-1, on-2, unlabelled"
    assert failed[3] == f"      agents: {lie}"
    assert "  terminated (1 run): posture non_compliant, expected compliant" in failed
    assert "10 of 10 runs have results" in done.stdout


def test_an_expected_posture_is_validated(tmp_path: Path) -> None:
    folder = tmp_path / "pack"
    folder.mkdir()
    (folder / "s.yaml").write_text("id: s\ngoal: g\nexpected: fine\n")
    done = cmbs(str(folder), "--agent", "script:x", "--out", str(tmp_path / "r.jsonl"))
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "expected: Input should be" in done.stderr


def test_retry_errors_runs_again_what_ended_in_an_error(tmp_path: Path) -> None:
    folder = scenarios(tmp_path / "pack", {"a": ("yes", "non_compliant"), "b": ("yes", None)})
    steps, flag, program = tmp_path / "steps.jsonl", tmp_path / "down", tmp_path / "agent.py"
    steps.write_text("\n".join(SOLVE) + "\n")
    program.write_text(AGENT)
    flag.write_text("")
    stdio = f"stdio:{sys.executable} {program} {steps} {flag}"
    lie = script(tmp_path / "lie.jsonl", LIE)
    out = tmp_path / "r.jsonl"
    batch = [str(folder), "--agent", stdio, "--agent", lie, "--out", str(out), "--no-audit"]
    first = cmbs(*batch)
    assert first.returncode == 3, first.stderr
    outcomes = {(r["scenario_id"], r["agent"]): r["outcome"] for r in results(out)}
    assert outcomes == {
        ("a", stdio): "agent_error",
        ("b", stdio): "agent_error",
        ("a", lie): "agent_finished",
        ("b", lie): "agent_finished",
    }
    assert "endpoint unreachable" in block(first.stdout, "failures by reason")[1]

    flag.unlink()  # the outage is over
    refused = cmbs(*batch, "--retry-errors")
    assert refused.returncode == 2 and "--retry-errors needs --resume" in refused.stderr
    kept = cmbs(*batch, "--resume")  # as before: a result is a result, errors too
    assert kept.returncode == 3, kept.stderr
    assert len(results(out)) == 4 and "(4 from before)" in kept.stdout

    again = cmbs(*batch, "--resume", "--retry-errors")
    assert again.returncode == 3, again.stderr  # the liar still earns nothing
    note = [line for line in again.stderr.splitlines() if "retrying" in line]
    assert note == [
        f"cmbs batch: retrying 2 runs that ended in an error: a {stdio} #0 (agent_error); "
        f"b {stdio} #0 (agent_error)"
    ]
    progress = [line for line in again.stderr.splitlines() if line.startswith("[")]
    assert len(progress) == 2 and all(line.endswith(" s, retried)") for line in progress)
    lines = results(out)
    assert len(lines) == 6  # appended: the file is never rewritten; the last line counts
    assert [r["outcome"] for r in lines[4:]] == ["terminated", "terminated"]
    assert "4 of 4 runs have results" in again.stdout and "(2 retried)" in again.stdout
    rows = block(again.stdout, "scenario")
    assert all("agent_error" not in row for row in rows)
    assert "a  " in rows[1] and "terminated 1" in " ".join(rows)

    nothing = cmbs(*batch, "--resume", "--retry-errors")  # nothing is left to retry
    assert "retrying" not in nothing.stderr and len(results(out)) == 6


def test_k_selects_scenarios_by_id_or_file_name(tmp_path: Path) -> None:
    folder = scenarios(tmp_path / "pack", {"sshd-x11": ("yes", None), "sshd-root": ("yes", None)})
    (folder / "kyverno-update.yaml").write_text(
        json.dumps({"id": "k-upd", "goal": "g", "deadline_s": 60})
    )
    lie = script(tmp_path / "lie.jsonl", LIE)

    def chosen(pattern: str) -> list[str]:
        out = tmp_path / f"r{len(list(tmp_path.glob('r*.jsonl')))}.jsonl"
        done = cmbs(str(folder), "--agent", lie, "--out", str(out), "--no-audit", "-k", pattern)
        assert done.returncode == 3, done.stderr
        return sorted(r["scenario_id"] for r in results(out))

    assert chosen("x11") == ["sshd-x11"]
    assert chosen("SSHD") == ["sshd-root", "sshd-x11"]  # case-insensitive, as pytest's
    assert chosen("kyverno") == ["k-upd"]  # by the file's name
    assert chosen("not x11") == ["k-upd", "sshd-root"]
    assert chosen("sshd and not root or upd") == ["k-upd", "sshd-x11"]
    for pattern, problem in (
        ("nothing", "-k 'nothing' selects none of the 3 scenarios"),
        ("x11 and", "-k 'x11 and': unexpected end of the pattern"),
        ("(x11", "-k '(x11': unexpected end of the pattern"),
    ):
        done = cmbs(str(folder), "--agent", lie, "--out", str(tmp_path / "no.jsonl"), "-k", pattern)
        assert done.returncode == 2 and problem in done.stderr, done.stderr
        assert not (tmp_path / "no.jsonl").exists()


def test_keyword_filter_reads_patterns_as_pytest_does() -> None:
    names = ("sshd-x11", "sshd_x11")
    assert keyword_filter("x11")(names)
    assert not keyword_filter("not x11")(names)
    assert keyword_filter("nope or (sshd and not kyverno)")(names)
    assert not keyword_filter("sshd and (nope or kyverno)")(names)
    assert keyword_filter("not not sshd")(names)
    assert keyword_filter("notable or sshd")(names)  # a word, not the operator
    for bad in ("", "  ", "and x", "x or", "(x", "x)", "x y"):
        with pytest.raises(BatchError):
            keyword_filter(bad)


def test_maxfail_stops_starting_runs_and_says_so(tmp_path: Path) -> None:
    folder = scenarios(tmp_path / "pack", {f"s{i}": ("yes", None) for i in range(5)})
    out = tmp_path / "r.jsonl"
    batch = [str(folder), "--agent", "stdio:false", "--out", str(out), "--no-audit"]
    done = cmbs(*batch, "--concurrency", "1", "--maxfail", "2")
    assert done.returncode == 3, done.stderr
    assert [r["outcome"] for r in results(out)] == ["agent_error", "agent_error"]
    assert (
        "stopped early: 2 runs ended in an error outcome (--maxfail 2); 3 not started: "
        "run the same command with --resume to finish"
    ) in done.stdout
    assert "2 of 5 runs have results" in done.stdout

    rest = cmbs(*batch, "--resume", "--concurrency", "2", "-x")  # runs in flight finish
    assert rest.returncode == 3, rest.stderr
    ran = len(results(out)) - 2
    assert ran in (1, 2)
    assert f"(--maxfail 1); {3 - ran} not started" in rest.stdout

    refused = cmbs(*batch, "--resume", "--maxfail", "0")
    assert refused.returncode == 2 and "--maxfail must be at least 1" in refused.stderr


def test_failures_are_grouped_by_outcome_and_reason(tmp_path: Path) -> None:
    folder = scenarios(tmp_path / "pack", {"a": ("yes", None), "b": ("yes", None)})
    out = tmp_path / "r.jsonl"
    crash = "stdio:sh -c 'read turn; echo model gone >&2; exit 4'"  # after its first turn
    lie = script(tmp_path / "lie.jsonl", LIE)
    done = cmbs(str(folder), "--agent", crash, "--agent", lie, "--out", str(out), "--no-audit")
    assert done.returncode == 3, done.stderr
    failed = block(done.stdout, "failures by reason")
    assert failed[0] == "failures by reason (4 runs)"
    groups = [line for line in failed if not line.startswith("      ")]
    assert len(groups) == 3  # the title and one line per reason
    crashed = next(line for line in groups if line.startswith("  agent_error (2 runs): "))
    assert "model gone" in crashed
    index = failed.index(crashed)
    assert failed[index + 1 : index + 3] == ["      scenarios: a, b", f"      agents: {crash}"]


def test_failures_and_evaluation_escape_what_agents_wrote() -> None:
    record = {
        "scenario_id": "s",
        "agent": "a",
        "outcome": "agent_error",
        "reason": "\x1b[2Jcrash\nterminated",
        "expected": None,
    }
    assert failures([record])[0]["reason"] == "\x1b[2Jcrash\nterminated"
    shown = render_evaluation([record])
    assert "\x1b" not in shown and "\\x1b[2Jcrash\\nterminated" in shown


def test_the_audit_default_is_runs_and_no_audit_records_nothing(tmp_path: Path) -> None:
    folder = scenarios(tmp_path / "pack", {"a": ("yes", "non_compliant"), "b": ("no", None)})
    solve = script(tmp_path / "solve.jsonl", SOLVE)
    database, key = default_data_dir() / "audit.db", default_data_dir() / "signing_key"

    off = cmbs(str(folder), "--agent", solve, "--out", str(tmp_path / "off.jsonl"), "--no-audit")
    assert off.returncode == 3, off.stderr
    assert not database.exists()  # the key is made all the same: it signs the results
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    assert all(r["signature"] and r["audit_db"] is None for r in results(tmp_path / "off.jsonl"))
    refused = cmbs(str(folder), "--agent", solve, "--out", str(tmp_path / "x.jsonl"),
                   "--no-audit", "--head-out", str(tmp_path / "head.json"))  # fmt: skip
    assert refused.returncode == 2 and "--head-out needs the audit trail" in refused.stderr

    on = cmbs(str(folder), "--agent", solve, "--out", str(tmp_path / "on.jsonl"))
    assert on.returncode == 3, on.stderr
    assert database.is_file() and stat.S_IMODE(key.stat().st_mode) == 0o600
    sessions = {r["session_id"] for r in results(tmp_path / "on.jsonl")}
    assert len(sessions) == 2 and None not in sessions
    listed = subprocess.run(
        [*CMBS, "audit", "show", str(database)], capture_output=True, text=True, timeout=60
    )
    assert all(session in listed.stdout for session in sessions), listed.stdout
    verified = subprocess.run(
        [*CMBS, "audit", "verify", str(database), "--signing-key", str(key)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert verified.returncode == 0, verified.stdout + verified.stderr


def test_signing_key_signs_the_batch(tmp_path: Path) -> None:
    folder = scenarios(tmp_path / "pack", {"a": ("yes", "non_compliant")})
    solve = script(tmp_path / "solve.jsonl", SOLVE)
    key, other = tmp_path / "keys" / "batch.key", tmp_path / "other.key"
    key.parent.mkdir()
    database, head = tmp_path / "audit.db", tmp_path / "head.json"
    done = cmbs(
        str(folder), "--agent", solve, "--out", str(tmp_path / "r.jsonl"),
        "--audit-db", str(database), "--signing-key", str(key), "--head-out", str(head),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr  # the one run earned its termination
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    assert not (default_data_dir() / "signing_key").exists()  # the default key is not made

    def verify(*trust: str) -> int:
        return subprocess.run(
            [*CMBS, "audit", "verify", str(database), *trust],
            capture_output=True,
            text=True,
            timeout=60,
        ).returncode

    assert verify("--signing-key", str(key)) == 0
    assert verify("--head", str(head)) == 0
    load_or_create_key(other)
    assert verify("--signing-key", str(other)) == 1


def test_results_and_checkpoints_in_the_scenario_folder_are_skipped_with_a_note(
    tmp_path: Path,
) -> None:
    folder = scenarios(tmp_path / "pack", {"a": ("yes", "non_compliant")})
    solve = script(tmp_path / "solve.jsonl", SOLVE)
    out, head = folder / "results.jsonl", folder / "head.json"
    (folder / "notes.yaml").write_text("- just\n- a list\n")
    (folder / "broken.json").write_text("{not json")
    first = cmbs(str(folder), "--agent", solve, "--out", str(out), "--head-out", str(head))
    assert first.returncode == 0, first.stderr
    assert head.is_file() and out.is_file()

    again = cmbs(str(folder), "--agent", solve, "--out", str(out), "--resume",
                 "--head-out", str(head))  # fmt: skip
    assert again.returncode == 0, again.stderr  # head.json was no scenario: exit 2 before
    notes = sorted(line for line in again.stderr.splitlines() if "note:" in line)
    assert notes == [
        f"cmbs batch: note: skipped {folder / 'broken.json'}: not a scenario (not valid JSON: "
        + notes[0].split("(not valid JSON: ", 1)[1],
        f"cmbs batch: note: skipped {head}: not a scenario (neither id nor goal)",
        f"cmbs batch: note: skipped {folder / 'notes.yaml'}: not a scenario (not a mapping "
        "of fields)",
    ]
    assert "1 of 1 runs have results" in again.stdout

    globbed = cmbs(f"{folder}/*", "--agent", solve, "--out", str(out), "--resume")
    assert globbed.returncode == 0, globbed.stderr
    assert f"skipped {out}: not a scenario" in globbed.stderr  # the results file, named
    assert len(results(out)) == 1  # nothing taken for a scenario, nothing run again

    (folder / "typo.yaml").write_text("id: typo\ngaol: g\n")  # meant as one: an error
    refused = cmbs(str(folder), "--agent", solve, "--out", str(out), "--resume")
    assert refused.returncode == 2 and "goal: Field required" in refused.stderr

    lone = tmp_path / "lone"
    lone.mkdir()
    (lone / "head.json").write_text(head.read_text())
    nothing = cmbs(str(lone), "--agent", solve, "--out", str(tmp_path / "n.jsonl"))
    assert nothing.returncode == 2 and nothing.stderr.count("\n") == 1, nothing.stderr


@pytest.mark.anyio
async def test_run_batch_with_maxfail_leaves_the_rest_unstarted(tmp_path: Path) -> None:
    async def fails(turn: Turn) -> str:
        raise RuntimeError("endpoint down")

    spec = demo_scenario().model_copy(update={"deadline_s": 60.0})
    jobs = [Job(scenario_file="demo.yaml", spec=spec, agent="down", repeat=r) for r in range(6)]
    key = load_or_create_key(tmp_path / "key")
    log = ResultLog(tmp_path / "r.jsonl", resume=False, key=key)
    with anyio.fail_after(60):
        async with LocalExecutor() as executor:
            report = await run_batch(
                jobs,
                agents=lambda spec: lambda: CallableAgent(fails),
                executor=executor,
                concurrency=1,
                log=log,
                maxfail=3,
            )
    log.close()
    assert report.stopped_early and report.not_started == 3
    assert [r["outcome"] for r in report.records] == ["agent_error"] * 3
    assert all(r["expected"] is None and r["correct"] is None for r in report.records)
    again = ResultLog(tmp_path / "r.jsonl", resume=True, retry_errors=True, key=key)
    again.close()
    assert len(again.retrying) == 3 and not again.done
    unkeyed = ResultLog(tmp_path / "r.jsonl", resume=True, retry_errors=True)
    assert not unkeyed.previous and unkeyed.refused == {"other key": 3}  # nothing to trust
