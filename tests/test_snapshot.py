"""The workdir file by file (``executors.snapshot``), on real files: what an action changed
(created, changed, renamed, linked, removed, by inode and content hash), which file an
argument names as the kernel resolves it, and which programs are out of the agent's
reach."""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

from executors.snapshot import diff, identify, locate, take


def sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def test_changes_say_what_happened_to_each_file(tmp_path: Path) -> None:
    (tmp_path / "a").write_text("agent\n")
    (tmp_path / "keep").write_text("k\n")
    (tmp_path / "edit").write_text("before\n")
    (tmp_path / "gone").write_text("x\n")
    before = take(str(tmp_path))
    os.rename(tmp_path / "a", tmp_path / "b-moved")  # the first new path with its inode
    os.link(tmp_path / "b-moved", tmp_path / "c-linked")
    (tmp_path / "copy").write_text("agent\n")
    (tmp_path / "edit").write_text("after\n")
    (tmp_path / "gone").unlink()
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "new").write_text("n\n")
    os.symlink("keep", tmp_path / "sym")
    after = take(str(tmp_path), before)
    said = {(c["path"], c["change"], c["source"]) for c in diff(before, after)}
    assert said == {
        ("b-moved", "renamed", "a"),
        ("c-linked", "linked", "b-moved"),
        ("copy", "created", None),
        ("edit", "changed", None),
        ("gone", "removed", None),
        ("sub/new", "created", None),
        ("sym", "created", None),
    }
    hashes = {c["path"]: c["sha256"] for c in diff(before, after)}
    assert hashes["b-moved"] == hashes["c-linked"] == hashes["copy"] == sha("agent\n")
    assert hashes["sym"] is None and diff(after, take(str(tmp_path), after)) == []


def test_an_unchanged_file_is_not_hashed_again(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x\n")
    first = take(str(tmp_path))
    first["f"][5] = "remembered"  # the hash a snapshot keeps while nothing changes
    assert take(str(tmp_path), first)["f"][5] == "remembered"
    (tmp_path / "f").write_text("y\n")
    assert take(str(tmp_path), first)["f"][5] == sha("y\n")


def test_an_argument_is_identified_as_the_kernel_resolves_it(tmp_path: Path) -> None:
    root = tmp_path / "w"
    (root / "d").mkdir(parents=True)
    (root / "d" / "f.json").write_text("{}\n")
    (root / " f.json").write_text("space\n")
    os.symlink("d/f.json", root / "rel")
    os.symlink(str(root / "d" / "f.json"), root / "abs")
    os.symlink("/etc/hostname", root / "out")
    os.symlink("../../etc/hostname", root / "d" / "up")
    os.symlink("loop", root / "loop")
    os.mkfifo(root / "fifo")
    w = str(root)
    assert identify(w, "rel")["path"] == "d/f.json"
    assert identify(w, "./d/../abs")["sha256"] == sha("{}\n")
    assert identify(w, f"{w}/d/f.json")["path"] == "d/f.json"
    assert identify(w, " f.json")["sha256"] == sha("space\n")
    assert identify(w, "d/up")["outside"] == "a path that leaves the workdir"
    assert identify(w, "out")["outside"] == "a link that leaves the workdir"
    assert identify(w, "/proc/self/cwd/rel")["outside"] == "an absolute path outside the workdir"
    assert identify(w, "../w/rel")["outside"] == "a path that leaves the workdir"
    assert identify(w, "loop")["outside"] == "too many links"
    assert identify(w, "fifo")["outside"] == "not a regular file"
    assert identify(w, "nope")["outside"] == "no such file"


def test_a_program_is_found_only_out_of_reach(tmp_path: Path) -> None:
    safe, writable, open_dir = tmp_path / "safe", tmp_path / "work", tmp_path / "open"
    for folder in (safe, writable, open_dir):
        folder.mkdir()
        program = folder / "tool"
        program.write_text("#!/bin/sh\n")
        program.chmod(0o755)
    open_dir.chmod(0o777)  # anybody may replace what is in it
    search = f"relative:{writable}:{safe}"
    assert locate("tool", search, [str(writable)], None) is None  # the first one is the agent's
    found = locate("tool", f"{safe}:{writable}", [str(writable)], None)
    assert found == {"name": "tool", "path": str(safe / "tool"), "sha256": sha("#!/bin/sh\n")}
    assert locate("tool", str(open_dir), [], None) is None
    assert locate("tool", str(safe), [], os.getuid()) is None  # owned by who commands run as
    assert locate("../safe/tool", str(writable), [], None) is None
    assert stat.S_IMODE(os.stat(safe).st_mode) & stat.S_IWOTH == 0
