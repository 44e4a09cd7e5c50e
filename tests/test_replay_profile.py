"""A recorded run judged again under another profile: the recorded observations fed to the
new gate, nothing run again, each changed verdict listed (``cmbs replay --profile``)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import yaml

from cmbs_async import SQLiteAuditStore, load_profile, replay

from .helpers import CMBS


def cmbs(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CMBS, *args], capture_output=True, text=True, timeout=120)


def recorded_demo(tmp_path: Path) -> tuple[Path, str]:
    db = tmp_path / "audit.db"
    done = cmbs("demo", "--audit-db", str(db), "--signing-key", str(tmp_path / "k"))
    assert done.returncode == 0, done.stderr
    store = SQLiteAuditStore(db, read_only=True)
    try:
        [session] = store.session_ids()
    finally:
        store.close()
    return db, session


def test_a_stricter_profile_changes_the_verdicts_it_would_have_given(tmp_path: Path) -> None:
    db, session = recorded_demo(tmp_path)
    stricter = load_profile("ciso").model_dump(mode="json")
    stricter["stability_window"] = 3  # one more agreeing claim before termination
    profile = tmp_path / "stricter.yaml"
    profile.write_text(yaml.safe_dump(stricter))

    same = cmbs("replay", str(db), session)
    assert same.returncode == 0 and same.stdout.rstrip().endswith("identical")

    judged = cmbs("replay", str(db), session, "--profile", str(profile))
    assert judged.returncode == 1, judged.stderr
    assert "DIFFERENT: step 12: recorded TERMINATE" in judged.stdout
    assert "replayed BLOCK 'Termination blocked; belief incomplete.'" in judged.stdout
    assert "under profile ciso: 1 difference(s)" in judged.stdout

    store = SQLiteAuditStore(db, read_only=True)
    try:
        report = replay(store, session, profile=load_profile(str(profile)))
    finally:
        store.close()
    last = report.steps[-1]
    assert (last.step, last.verdict.value) == (12, "BLOCK")
    assert last.masks.posture_admissible == {"compliant": False, "non_compliant": True}
    assert not last.masks.termination_allowed


def test_a_profile_that_cannot_be_read_is_one_line(tmp_path: Path) -> None:
    db, session = recorded_demo(tmp_path)
    missing = cmbs("replay", str(db), session, "--profile", str(tmp_path / "nope.yaml"))
    assert missing.returncode == 2 and "Traceback" not in missing.stderr
    assert len(missing.stderr.strip().splitlines()) == 1
