"""Results a batch can trust, tried as a hostile user of a shared results file would: a
forged or edited line is never reused, an edited scenario runs again, duplicate ids and a
file that is no results file are refused (the file left byte for byte), and a scenario's
``host:`` is where its commands run. Real processes: the command line as a subprocess."""

from __future__ import annotations

import base64
import json
import os
import re
import sqlite3
import subprocess
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import Any

import pytest

from cmbs_async import CallableAgent, ScenarioSpec, Turn
from cmbs_async.audit import default_data_dir, load_or_create_key
from cmbs_async.audit.signing import public_key_text
from cmbs_async.batch import BatchError, Job, ResultLog, plan, run_batch, summarize
from cmbs_async.batch.results import signed_payload, untrusted_line
from cmbs_async.profile import load_profile
from executors import LocalExecutor

from .helpers import CMBS, one_line_exit_2, step
from .sshd import LocalSshd, sshd_available
from .test_batch_eval import LIE, SOLVE, results, scenarios, script

CISO = load_profile("ciso")


def cmbs(*args: str | bytes) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CMBS, "batch", *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        stdin=subprocess.DEVNULL,
    )


def notes(done: subprocess.CompletedProcess[str]) -> list[str]:
    return [line for line in done.stderr.splitlines() if line.startswith("cmbs batch: note:")]


def ran(done: subprocess.CompletedProcess[str]) -> list[str]:
    """The scenario ids of the runs a batch ran, from its progress lines."""
    return sorted(line.split()[1] for line in done.stderr.splitlines() if line.startswith("["))


def keys(folder: Path, agent: str) -> dict[str, str]:
    """Each scenario's job key, as ``cmbs batch`` keys it (what a forger can compute)."""
    return {job.spec.id: job.key for job in plan([str(folder)], [agent], 1)}


def append(path: Path, record: dict[str, Any]) -> None:
    with open(path, "a") as handle:
        handle.write(json.dumps(record) + "\n")


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_forged_terminated_lines_do_not_pass_on_resume(tmp_path: Path, backend: str) -> None:
    folder = scenarios(tmp_path / "pack", {"a": ("yes", None), "b": ("yes", None)})
    lie = script(tmp_path / "lie.jsonl", LIE)
    out = tmp_path / "r.jsonl"
    first = cmbs(str(folder), "--agent", lie, "--out", str(out), "-k", "a", "--backend", backend)
    assert first.returncode == 3, first.stderr
    (real,) = results(out)
    assert real["outcome"] == "agent_finished" and real["signature"]

    edited = real | {"outcome": "terminated"}  # its own signature kept
    by_b = real | {"key": keys(folder, lie)["b"], "scenario_id": "b", "outcome": "terminated"}
    by_b["scenario_file"] = str(folder / "b.yaml")  # a run that never happened
    mine = load_or_create_key(tmp_path / "forger.key")  # signed, with the forger's own key
    by_b_signed = by_b | {"signed_by": public_key_text(mine)}
    by_b_signed["signature"] = base64.b64encode(mine.sign(signed_payload(by_b_signed))).decode()
    for forged in (edited, by_b, by_b_signed):
        append(out, forged)
    operator = public_key_text(load_or_create_key(default_data_dir() / "signing_key"))
    why = [untrusted_line(line, operator) for line in (real, edited, by_b, by_b_signed)]
    assert why == [None, "broken", "broken", "other key"]  # as a reader with the public key

    again = cmbs(str(folder), "--agent", lie, "--out", str(out), "--resume", "--backend", backend)
    assert again.returncode == 3, again.stderr  # not 0: no run earned its termination
    assert notes(again) == [
        f"cmbs batch: note: 3 result lines of {out} cannot be trusted and are not reused "
        "(2 changed after signing, 1 signed by another key): 1 run they stand for runs again"
    ]
    assert ran(again) == ["b"]  # b really runs; a keeps its real result
    assert "2 of 2 runs have results" in again.stdout and "(1 from before)" in again.stdout
    assert not re.search(r"\bterminated \d", again.stdout)  # no forged outcome counted
    lines = results(out)
    assert len(lines) == 5 and lines[-1]["scenario_id"] == "b"
    assert lines[-1]["outcome"] == "agent_finished"


def test_an_edited_scenario_or_agent_runs_again_and_an_expected_posture_does_not(
    tmp_path: Path,
) -> None:
    folder = scenarios(tmp_path / "pack", {"a": ("yes", "non_compliant")})
    solve = script(tmp_path / "solve.jsonl", SOLVE)
    out = tmp_path / "r.jsonl"
    batch = [str(folder), "--agent", solve, "--out", str(out), "--no-audit"]
    first = cmbs(*batch)
    assert first.returncode == 0, first.stderr  # the solver finds the fault

    scenarios(folder, {"a": ("no", "non_compliant")})  # the fault is fixed
    fixed = cmbs(*batch, "--resume")
    assert notes(fixed) == [
        "cmbs batch: note: 1 result from before is stale (their scenario changed): run again"
    ]
    assert ran(fixed) == ["a"] and fixed.returncode == 3  # its claim no longer holds
    assert "1 of 1 runs have results" in fixed.stdout and "from before" not in fixed.stdout
    assert [r["outcome"] for r in results(out)] == ["terminated", "agent_finished"]

    script(tmp_path / "solve.jsonl", LIE)  # the same agent spec, another script
    lied = cmbs(*batch, "--resume")
    assert "(their agent changed)" in notes(lied)[0] and ran(lied) == ["a"]

    scenarios(folder, {"a": ("no", "compliant")})  # only the right answer: nothing runs
    judged = cmbs(*batch, "--resume")
    assert not notes(judged) and ran(judged) == [] and "(1 from before)" in judged.stdout
    assert len(results(out)) == 3


def test_a_line_signed_with_another_key_or_none_is_not_trusted(tmp_path: Path) -> None:
    folder = scenarios(tmp_path / "pack", {"a": ("yes", None)})
    lie = script(tmp_path / "lie.jsonl", LIE)
    out = tmp_path / "r.jsonl"
    batch = [str(folder), "--agent", lie, "--out", str(out), "--no-audit"]
    ours, theirs = str(tmp_path / "ours.key"), str(tmp_path / "theirs.key")
    assert cmbs(*batch, "--signing-key", ours).returncode == 3

    other = cmbs(*batch, "--signing-key", theirs, "--resume")
    assert notes(other) == [
        f"cmbs batch: note: 1 result line of {out} cannot be trusted and is not reused "
        "(1 signed by another key): 1 run they stand for runs again"
    ]
    assert ran(other) == ["a"]
    back = cmbs(*batch, "--signing-key", ours, "--resume")  # its own line is still good
    assert ran(back) == [] and "(1 from before)" in back.stdout
    assert notes(back) == [
        f"cmbs batch: note: 1 result line of {out} cannot be trusted and is not reused "
        "(1 signed by another key)"
    ]

    older = tmp_path / "older.jsonl"  # as cmbs wrote it before lines were signed
    line = {k: v for k, v in results(out)[0].items() if k not in ("signature", "signed_by")}
    line["key"] = f"{folder / 'a.yaml'}|{lie}|0"
    append(older, line)
    legacy = cmbs(*batch, "--signing-key", ours, "--out", str(older), "--resume")
    assert "(1 unsigned (by an older cmbs, or by hand)): 1 run they stand for" in legacy.stderr
    assert ran(legacy) == ["a"] and len(results(older)) == 2


def test_a_result_whose_audit_session_is_gone_or_edited_runs_again(tmp_path: Path) -> None:
    folder = scenarios(tmp_path / "pack", {"a": ("yes", None), "b": ("yes", None)})
    lie = script(tmp_path / "lie.jsonl", LIE)
    out, db = tmp_path / "r.jsonl", tmp_path / "audit.db"
    batch = [str(folder), "--agent", lie, "--out", str(out)]
    assert cmbs(*batch, "--audit-db", str(db)).returncode == 3
    sessions = {r["scenario_id"]: r["session_id"] for r in results(out)}
    assert all(r["audit_db"] == str(db.resolve()) for r in results(out))
    with sqlite3.connect(db) as connection:  # one session gone, another edited
        connection.execute("DELETE FROM records WHERE session_id = ?", (sessions["a"],))
        connection.execute("DELETE FROM sessions WHERE session_id = ?", (sessions["a"],))
        connection.execute(
            "UPDATE records SET body = replace(body, 'agent_finished', 'terminated') "
            "WHERE session_id = ?",
            (sessions["b"],),
        )
    connection.close()

    elsewhere = cmbs(*batch, "--audit-db", str(tmp_path / "other.db"), "--resume")
    assert ran(elsewhere) == [] and not notes(elsewhere)  # recorded elsewhere: signed lines
    again = cmbs(*batch, "--audit-db", str(db), "--resume")
    assert notes(again) == [
        f"cmbs batch: note: 2 result lines of {out} cannot be trusted and are not reused "
        "(2 whose audit session is missing or does not verify): 2 runs they stand for run "
        "again"
    ]
    assert ran(again) == ["a", "b"] and "2 of 2 runs have results" in again.stdout


def test_two_files_with_one_scenario_id_are_refused(tmp_path: Path) -> None:
    folder = scenarios(tmp_path / "pack", {"a": ("yes", None)})
    (folder / "copy.yaml").write_text((folder / "a.yaml").read_text())
    out = tmp_path / "r.jsonl"
    done = cmbs(str(folder), "--agent", "script:nothing", "--out", str(out))
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr == (
        f"cmbs batch: error: scenario id 'a' is given by both {folder / 'a.yaml'} and "
        f"{folder / 'copy.yaml'}: each scenario of a batch needs an id of its own\n"
    )
    assert not out.exists()


def test_the_summary_never_merges_two_files_of_one_id() -> None:
    records = [
        {"scenario_id": "a", "scenario_file": f"/p/{name}.yaml", "agent": "x", "outcome": o}
        for name, o in (("one", "terminated"), ("two", "agent_finished"))
    ]
    rows = summarize(records, profiles=dict.fromkeys(("/p/one.yaml", "/p/two.yaml"), CISO))
    assert [(r["scenario"], r["runs"], r["earned"]) for r in rows] == [
        ("a (/p/one.yaml)", 1, 1),
        ("a (/p/two.yaml)", 1, 0),
    ]


@pytest.fixture
def results_file(tmp_path: Path) -> tuple[Path, list[str]]:
    """A real results file of one run, and the batch that continues it."""
    folder = scenarios(tmp_path / "pack", {"a": ("yes", None), "b": ("yes", None)})
    lie = script(tmp_path / "lie.jsonl", LIE)
    out = tmp_path / "r.jsonl"
    batch = [str(folder), "--agent", lie, "--out", str(out), "--no-audit"]
    assert cmbs(*batch, "-k", "a").returncode == 3
    return out, batch


NOT_RESULTS = {
    "text without a last newline": b"my notes\nkeep them",
    "JSON lines of something else": b'{"a": 1}\n{"b": 2}',
    "binary": bytes(range(256)) * 4,
    "a results line, then junk without a newline": None,
    "a results line, then one without its fields": None,
    "a results line, then a JSON array": None,
}


@pytest.mark.parametrize("kind", NOT_RESULTS)
def test_a_file_that_is_no_results_file_is_refused_and_left_byte_for_byte(
    results_file: tuple[Path, list[str]], kind: str
) -> None:
    out, batch = results_file
    real = out.read_bytes()
    content = (
        NOT_RESULTS[kind]
        or real
        + {
            "a results line, then junk without a newline": b"junk",
            "a results line, then one without its fields": b'{"key": "x", "outcome": "y"}\n',
            "a results line, then a JSON array": b"[1, 2]\n",
        }[kind]
    )
    out.write_bytes(content)
    done = cmbs(*batch, "--resume")
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "not a results file, left as it is" in done.stderr and "Traceback" not in done.stderr
    assert out.read_bytes() == content


def test_a_line_cut_by_a_kill_is_dropped_and_a_whole_one_kept(
    results_file: tuple[Path, list[str]],
) -> None:
    out, batch = results_file
    real = out.read_bytes()
    out.write_bytes(real + real[: len(real) // 2])  # a second line cut off mid-write
    cut = cmbs(*batch, "--resume")
    assert cut.returncode == 3 and ran(cut) == ["b"], cut.stderr
    lines = out.read_bytes().splitlines(keepends=True)
    assert lines[0] == real and len(lines) == 2 and json.loads(lines[1])["scenario_id"] == "b"

    out.write_bytes(real.rstrip(b"\n"))  # whole, but its newline lost
    whole = cmbs(*batch, "--resume")
    assert ran(whole) == ["b"] and "(1 from before)" in whole.stdout
    assert out.read_bytes().startswith(real) and len(results(out)) == 2


def test_job_keys_are_what_runs(tmp_path: Path) -> None:
    folder = tmp_path / "pack"
    folder.mkdir()
    (folder / "s.yaml").write_text("id: s\ngoal: g\nprofile: ./p.yaml\n")
    ciso = (resources.files("cmbs_async") / "profiles" / "ciso.yaml").read_text()
    (folder / "p.yaml").write_text(ciso)
    steps = tmp_path / "steps.jsonl"
    steps.write_text("\n".join(LIE) + "\n")
    agent = f"script:{steps}"

    def key(**options: Any) -> str:
        (job,) = plan([str(folder / "s.yaml")], [agent], 1, **options)
        return job.key

    before = key()
    assert key() == before
    jobs = plan([str(folder / "s.yaml")], [agent], 2)
    assert jobs[0].key != jobs[1].key and jobs[0].key.endswith("#0")
    moved = tmp_path / "moved"
    folder.rename(moved)
    assert plan([str(moved / "s.yaml")], [agent], 1)[0].key == before  # by content, not path
    moved.rename(folder)
    assert key(executor="ssh://u@h") != before
    (folder / "s.yaml").write_text("id: s\ngoal: g\nprofile: ./p.yaml\nexpected: compliant\n")
    assert key() == before  # no run sees the right answer
    (folder / "p.yaml").write_text(ciso.replace("description:", "description: edited", 1))
    assert key() != before
    (folder / "p.yaml").write_text(ciso)
    steps.write_text("\n".join(SOLVE) + "\n")
    assert key() != before
    steps.unlink()
    with pytest.raises(BatchError, match=re.escape(f"--agent {agent}: {steps}: cannot read")):
        key()


# -- what a line can hold; one batch a file; --out a file of its own ---------------------
# (red team, round 23)


@pytest.mark.parametrize("where", ["scenario folder", "scenario file", "agent script"])
def test_a_name_that_is_not_utf8_is_refused_before_anything_runs(
    tmp_path: Path, where: str
) -> None:
    """A scenario path or ``--agent`` spec that is not UTF-8 (a file name may be any
    bytes) cannot be in a signed result line: the batch ran its runs, then died in an
    ExceptionGroup traceback with the results file empty (a non-UTF-8 ``--agent``: a
    traceback while planning). Now one line names it, with escapes."""
    folder = tmp_path / ("pack" if where != "scenario folder" else os.fsdecode(b"pack\xff"))
    folder.mkdir()
    name = "a.yaml" if where != "scenario file" else os.fsdecode(b"a\xff.yaml")
    (folder / name).write_text(json.dumps({"id": "a", "goal": "g", "deadline_s": 60}))
    steps = os.fsdecode(b"lie\xff.jsonl") if where == "agent script" else "lie.jsonl"
    lie = script(tmp_path / steps, LIE)
    out, db = tmp_path / "r.jsonl", tmp_path / "audit.db"
    done = cmbs(
        os.fsencode(folder), "--agent", os.fsencode(lie), "--out", str(out),
        "--audit-db", str(db), "--signing-key", str(tmp_path / "key"),
    )  # fmt: skip
    one_line_exit_2(done)
    assert "is not UTF-8 text, which a result line cannot hold" in done.stderr
    assert "\\xff" in done.stderr and not ran(done)
    assert not out.exists() and not db.exists()


@pytest.mark.anyio
async def test_a_result_that_cannot_be_signed_is_a_runner_error_line_never_a_crash(
    tmp_path: Path,
) -> None:
    """The library used directly, with a job whose file name is not UTF-8: its result
    cannot be signed; a failing ``append`` used to escape the runner as an exception
    group. A ``runner_error`` line stands for it, signed, and says why."""

    async def done(turn: Turn) -> str | None:
        return None

    key = load_or_create_key(tmp_path / "key")
    spec = ScenarioSpec(id="a", goal="g", deadline_s=60)
    job = Job(os.fsdecode(b"pack\xff/a.yaml"), spec, "callable", 0)
    out = tmp_path / "r.jsonl"
    with ResultLog(out, resume=False, key=key) as log:
        async with LocalExecutor() as executor:
            report = await run_batch(
                [job],
                agents=lambda spec: lambda: CallableAgent(done),
                executor=executor,
                concurrency=1,
                log=log,
            )
        assert len(log.replaced) == 1 and not log.lost
    (line,) = results(out)
    assert line["outcome"] == "runner_error" and line["key"] == job.key
    assert line["scenario_file"] == "pack\\xff/a.yaml"
    assert "could not be written as it was" in line["reason"]
    assert untrusted_line(line, public_key_text(key)) is None
    assert [r["outcome"] for r in report.records] == ["runner_error"]


def test_a_results_line_holding_a_lone_surrogate_is_broken_not_a_traceback(
    results_file: tuple[Path, list[str]],
) -> None:
    """A hostile user of the shared file appends a copy of a real signed line with one
    field more, ``"\\ud800"`` (valid JSON): checking its signature encoded it as UTF-8,
    which raised, and ``--resume`` died in a traceback for every user of the file."""
    out, batch = results_file
    (line,) = results(out)
    forged = line | {"note": "\ud800"}
    append(out, forged)  # json.dumps: "\ud800" as an escape
    assert untrusted_line(forged, line["signed_by"]) == "broken"
    again = cmbs(*batch, "--resume")
    assert "Traceback" not in again.stderr, again.stderr[-1500:]
    assert again.returncode == 3, again.stderr
    assert "(1 changed after signing)" in again.stderr and ran(again) == ["b"]


def _record(key: str) -> dict[str, Any]:
    return {"key": key, "scenario_file": "f", "agent": "a", "repeat": 0, "outcome": "terminated"}


def _keys(out: Path) -> list[str]:
    return [json.loads(line)["key"] for line in out.read_text().splitlines() if line.strip()]


def test_a_second_batch_on_one_results_file_is_refused_and_no_line_is_lost(
    tmp_path: Path,
) -> None:
    """A batch killed mid-line, resumed twice at once (``-k a`` and ``-k b`` to go
    faster): each dropped the cut line at the offset it had read, so the second one's
    first write truncated away every line the first one wrote meanwhile. The first
    resume now holds the file; the second is refused until it is done."""
    out = tmp_path / "r.jsonl"
    key = load_or_create_key(tmp_path / "key")
    with ResultLog(out, resume=False, key=key) as before:
        before.append(_record("k0"))
    with open(out, "a") as handle:
        handle.write('{"key": "k1", "scenario_file": "f", "ag')  # the kill
    with ResultLog(out, resume=True, key=key) as first:
        for resume in (True, False):
            with pytest.raises(BatchError, match=f"^{re.escape(str(out))} is in use by another"):
                ResultLog(out, resume=resume, key=key)
        first.append(_record("ka"))
    with ResultLog(out, resume=True, key=key) as second:
        assert second.done == {"k0", "ka"}
        second.append(_record("kb"))
    assert _keys(out) == ["k0", "ka", "kb"]


def test_a_batch_on_a_results_file_another_batch_holds_is_one_line_exit_2(
    results_file: tuple[Path, list[str]],
) -> None:
    out, batch = results_file
    before = out.read_bytes()
    with ResultLog(out, resume=True):
        done = cmbs(*batch, "--resume")
    one_line_exit_2(done)
    assert f"{out} is in use by another cmbs batch" in done.stderr
    assert out.read_bytes() == before


def test_a_cut_line_is_never_dropped_once_the_file_changed(tmp_path: Path) -> None:
    """A writer that takes no lock finishes the cut line after the batch read it: the
    batch's first result no longer drops it (that would cut the line away)."""
    out = tmp_path / "r.jsonl"
    with ResultLog(out, resume=False) as before:
        before.append(_record("k0"))
    with open(out, "a") as handle:
        handle.write('{"key": "k1", "scenario_file": "f", "ag')
    with ResultLog(out, resume=True) as log:
        with open(out, "a") as handle:
            handle.write('ent": "a", "repeat": 0, "outcome": "terminated"}')
        log.append(_record("k2"))
    assert _keys(out) == ["k0", "k1", "k2"]


def test_a_results_file_made_for_nothing_is_removed(tmp_path: Path) -> None:
    """The file is made, and locked, as the batch starts: one that ends with no result
    written leaves none (a retry would be refused: "exists"), nor the folders made."""
    ResultLog(tmp_path / "new" / "dir" / "r.jsonl", resume=False).close()
    assert sorted(tmp_path.iterdir()) == []


@pytest.mark.parametrize("same", ["audit db", "its wal", "signing key", "head-out", "a link"])
def test_out_that_is_the_audit_db_the_key_or_head_out_is_refused(tmp_path: Path, same: str) -> None:
    """``--out`` and ``--audit-db`` naming one new file: SQLite made the database, the
    result lines were appended into it and lost at its checkpoint; ``--out`` and
    ``--head-out`` naming one file: the checkpoint replaced every result. Refused before
    anything runs, however spelt."""
    folder = scenarios(tmp_path / "pack", {"a": ("yes", None)})
    lie = script(tmp_path / "lie.jsonl", LIE)
    db, key, head = tmp_path / "audit.db", tmp_path / "key", tmp_path / "head.json"
    (tmp_path / "link").symlink_to(db)  # to a database not made yet
    out = {
        "audit db": db,
        "its wal": Path(f"{db}-wal"),
        "signing key": key,
        "head-out": head,
        "a link": tmp_path / "link",
    }[same]
    done = cmbs(
        str(folder), "--agent", lie, "--out", str(out), "--audit-db", str(db),
        "--signing-key", str(key), "--head-out", str(head),
    )  # fmt: skip
    one_line_exit_2(done)
    assert "the results need a file of their own" in done.stderr and not ran(done)
    assert not db.exists() and not key.exists() and not head.exists()


def test_the_forger_cannot_sign_for_the_operator() -> None:
    """Held (a control): a line for a run that never happened, signed with a key of the
    forger's own but claiming the operator's ``signed_by``, is broken, not reused."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    operator, forger = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    line = _record("never#0") | {"signed_by": public_key_text(operator)}
    line["signature"] = base64.b64encode(forger.sign(signed_payload(line))).decode()
    assert untrusted_line(line, public_key_text(operator)) == "broken"


# -- host: where a scenario's commands run ----------------------------------------------


def test_an_unreachable_host_is_an_executor_error_never_a_local_run(tmp_path: Path) -> None:
    folder = tmp_path / "pack"
    folder.mkdir()
    (folder / "far.yaml").write_text("id: far\ngoal: g\nhost: ssh://nobody@127.0.0.1:1\n")
    (folder / "near.yaml").write_text("id: near\ngoal: g\n")
    lie = script(tmp_path / "lie.jsonl", LIE)
    out = tmp_path / "r.jsonl"
    done = cmbs(str(folder), "--agent", lie, "--out", str(out), "--no-audit")
    assert done.returncode == 3, done.stderr
    found = {r["scenario_id"]: r for r in results(out)}
    assert found["far"]["outcome"] == "executor_error"
    assert found["far"]["executor"] == "ssh://nobody@127.0.0.1:1"
    assert found["near"]["outcome"] == "agent_finished" and found["near"]["executor"] == "local"

    other = tmp_path / "trio.jsonl"
    refused = cmbs(str(folder), "--agent", lie, "--out", str(other), "--backend", "trio")
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
    assert "the SSH executor needs --backend asyncio" in refused.stderr and not other.exists()


@pytest.fixture(scope="module")
def sshd() -> Iterator[LocalSshd]:
    with LocalSshd() as server:
        yield server


@pytest.mark.ssh
@pytest.mark.skipif(
    not sshd_available() and not os.environ.get("CI"), reason="OpenSSH sshd is not installed"
)
def test_a_scenarios_host_is_where_its_commands_run(sshd: LocalSshd, tmp_path: Path) -> None:
    folder = tmp_path / "pack"
    folder.mkdir()
    (folder / "far.yaml").write_text(f"id: far\ngoal: g\nhost: {sshd.url}\nfiles: {{f: far}}\n")
    (folder / "near.yaml").write_text("id: near\ngoal: g\nfiles: {f: near}\n")
    steps = tmp_path / "steps.jsonl"
    steps.write_text(step("check_status", {"command": "cat f"}) + "\n")
    out = tmp_path / "r.jsonl"
    logins = (sshd.dir / "sshd.log").read_text().count("Accepted publickey")
    done = cmbs(
        str(folder), "--agent", f"script:{steps}", "--out", str(out), "--no-audit",
        "--identity", sshd.client_key, "--known-hosts", sshd.known_hosts,
    )  # fmt: skip
    assert done.returncode == 3, done.stderr
    found = {r["scenario_id"]: r for r in results(out)}
    assert found["far"]["trace"][0]["observed"] == "exit 0: far"
    assert found["near"]["trace"][0]["observed"] == "exit 0: near"
    assert (found["far"]["executor"], found["near"]["executor"]) == (sshd.url, "local")
    assert (sshd.dir / "sshd.log").read_text().count("Accepted publickey") > logins
