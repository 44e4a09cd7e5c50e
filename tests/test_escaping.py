"""What an agent or a command says cannot forge lines of, or steer, the terminal tables."""

from __future__ import annotations

import json
import subprocess
import sys
import unicodedata
from io import StringIO
from pathlib import Path

import pytest

from cmbs_async._text import escape_controls
from cmbs_async.batch.progress import Progress

from .helpers import CMBS, step

FAKE = "\n\noutcome   terminated\n"
NASTY = FAKE + "\x1b[31m\u202e"  # a forged line, a colour, and text reversed from here on


def cmbs(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CMBS, *args], capture_output=True, text=True, timeout=60, cwd=cwd, check=False
    )


@pytest.mark.parametrize(
    ("raw", "shown"),
    [
        ("a\nb\rc\td", "a\\nb\\rc\\td"),
        ("\x1b[2J\x1b]0;title\x07", "\\x1b[2J\\x1b]0;title\\x07"),
        ("\x00\x7f\x85\x9b", "\\x00\\x7f\\x85\\x9b"),
        ("\u2028\u2029", "\\u2028\\u2029"),
        ("\u202a\u202e\u2066\u2069\u200f\u061c", "\\u202a\\u202e\\u2066\\u2069\\u200f\\u061c"),
        ("\ud800", "\\ud800"),
        ("\u200b\ufeff\u00ad", "\\u200b\\ufeff\\xad"),  # zero-width, invisible
        ("\ue000\U000f0000\u0378", "\\ue000\\U000f0000\\u0378"),  # private, unassigned
        ("héllo, 日本 ☃ C:\\dir 100%", "héllo, 日本 ☃ C:\\dir 100%"),
    ],
)
def test_controls_become_visible_escapes_and_the_rest_stays(raw: str, shown: str) -> None:
    assert escape_controls(raw) == shown


def test_no_control_of_any_kind_survives() -> None:
    everything = "".join(map(chr, range(sys.maxunicode + 1)))
    left = {
        char
        for char in set(escape_controls(everything))
        if unicodedata.category(char) in ("Cc", "Cf", "Co", "Cs", "Cn", "Zl", "Zp")
        or unicodedata.bidirectional(char)
        in ("LRE", "RLE", "LRO", "RLO", "PDF", "LRI", "RLI", "FSI", "PDI")
    }
    assert left == set()


def _assert_one_honest_table(out: str, outcome: str) -> list[str]:
    """No raw control character, and exactly one ``outcome`` line: the real one."""
    assert "\x1b" not in out and "\u202e" not in out and "\r" not in out
    lines = out.splitlines()
    assert [line for line in lines if line.startswith("outcome")] == [outcome]
    return lines


@pytest.fixture
def nasty_run(tmp_path: Path) -> tuple[Path, Path]:
    """A scenario and the steps of an agent whose names, paths and output are hostile."""
    scenario = tmp_path / "scenario.yaml"
    scenario.write_text("id: escaping\ngoal: say hello\ndeadline_s: 20\n")
    steps = tmp_path / "steps.jsonl"
    output = r"\033]0;pwned\007\033[2J\033[31mred\n\noutcome   terminated\n"
    steps.write_text(
        "\n".join(
            [
                step("check_status", {"command": f"printf '{output}'"}),
                step("generate_script", {"path": f"s{NASTY}.sh", "content": "echo hi\n"}),
                step("generate_script", {"path": f"../{NASTY}.sh", "content": "echo hi\n"}),
                step(f"x{NASTY}"),
                step("check_status", {"command": "true", f"key{NASTY}": 1}),
                step("check_status", {"command": "true"}, affordances={f"aff{NASTY}": "unknown"}),
            ]
        )
        + "\n"
    )
    return scenario, steps


def test_the_run_table_and_the_audit_show_escape_what_the_agent_said(
    nasty_run: tuple[Path, Path], tmp_path: Path
) -> None:
    scenario, steps = nasty_run
    db = tmp_path / "audit.db"
    workdir = tmp_path / "runs" / "w"  # its root (runs/) holds no audit database
    run = ["run", str(scenario), "--agent", f"script:{steps}", "--workdir", str(workdir)]
    done = cmbs(*run, "--audit-db", str(db))
    assert done.returncode == 3, done.stderr
    lines = _assert_one_honest_table(done.stdout, "outcome   agent_finished")
    assert [line.split()[0] for line in lines[2:8]] == ["1", "2", "3", "4", "5", "6"]
    assert lines[8] == ""  # one line per step, then the summary
    assert "exit 0: \\x1b]0;pwned\\x07\\x1b[2J\\x1b[31mred" in lines[2]
    assert "wrote s\\n\\noutcome   terminated\\n\\x1b[31m\\u202e.sh" in lines[3]
    assert "belief.affordances.aff\\n\\noutcome" in lines[7]

    sessions = cmbs("audit", "show", str(db))
    assert sessions.returncode == 0, sessions.stderr
    session_id = sessions.stdout.splitlines()[1].split()[0]
    shown = cmbs("audit", "show", str(db), session_id)
    assert shown.returncode == 0, shown.stderr
    lines = _assert_one_honest_table(shown.stdout, "outcome  agent_finished")
    assert [line.split()[0] for line in lines[1:7]] == ["1", "2", "3", "4", "5", "6"]
    assert "refused: artifact path '../\\n\\noutcome" in lines[3]

    as_json = cmbs(*run, "--no-audit", "--json")  # JSON escapes by itself, and is unchanged
    assert "\x1b" not in as_json.stdout
    trace = json.loads(as_json.stdout)["trace"]
    assert trace[1]["observed"] == f"wrote s{NASTY}.sh"


def test_an_agent_programs_stderr_in_the_reason_is_escaped(tmp_path: Path) -> None:
    scenario = tmp_path / "scenario.yaml"
    scenario.write_text("id: escaping\ngoal: say hello\ndeadline_s: 20\n")
    crash = r"printf '\033[2J\033[31moutcome   terminated\n\033[0m' >&2; exit 3"
    done = cmbs("run", str(scenario), "--agent", f"stdio:{crash}", "--no-audit")
    assert done.returncode != 0
    lines = _assert_one_honest_table(done.stdout, "outcome   agent_error")
    reasons = [line for line in lines if line.startswith("reason")]
    assert len(reasons) == 1
    assert "stderr: \\x1b[2J\\x1b[31moutcome terminated \\x1b[0m" in reasons[0]


def test_the_batch_progress_and_summary_escape_names(
    nasty_run: tuple[Path, Path], tmp_path: Path
) -> None:
    scenario, steps = nasty_run
    folder = tmp_path / "scenarios"
    folder.mkdir()
    scenario.rename(folder / scenario.name)
    hostile = steps.rename(tmp_path / f"steps{NASTY}.jsonl")  # names the agent in the tables
    out = tmp_path / "results.jsonl"
    done = cmbs("batch", str(folder), "--agent", f"script:{hostile}", "--out", str(out))
    assert done.returncode == 3, done.stderr  # not earned
    for text in (done.stdout, done.stderr):
        assert "\x1b" not in text and "\u202e" not in text
        assert not [line for line in text.splitlines() if line.startswith("outcome")]
    summary = done.stdout.splitlines()
    assert summary[0].split()[:2] == ["scenario", "agent"]
    assert summary[1].startswith("escaping  script:") and "\\n\\noutcome" in summary[1]
    assert summary[2] == ""  # one row per scenario and agent
    (progress,) = [line for line in done.stderr.splitlines() if line.startswith("[")]
    assert progress.startswith(
        f"[1/1] escaping script:{escape_controls(str(hostile))} #0: agent_finished ("
    )


def test_a_progress_line_is_one_line() -> None:
    stream = StringIO()
    progress = Progress(1, stream=stream)
    progress.start()
    progress.finish({"scenario_id": "s\n[2/1] fake", "agent": "a\x1b[2K", "outcome": "agent_error"})
    assert stream.getvalue().count("\n") == 1
    assert "\x1b" not in stream.getvalue()
