"""Artifact writes stay in the prepared workdir whatever a hostile command does to it.

Each attack is what an agent's own commands did to the earlier executor: a hard link to
a file outside, the workdir swapped for a symbolic link, and a daemon swapping a
subdirectory for a link while artifacts are written.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest

from cmbs_async import Outcome, ScenarioSpec, ScriptedAgent, run_scenario
from executors import ExecutorError, LocalExecutor
from executors.workdir import MAX_DEPTH

from .helpers import files_under, listing, live_group_members, step, swap_the_workdir_run, swapping

pytestmark = pytest.mark.anyio


@pytest.fixture
async def executor(tmp_path: Path) -> AsyncIterator[LocalExecutor]:
    """Commands see the real filesystem, as an unsandboxed agent's do; workdirs lie under
    ``tmp_path``."""
    async with LocalExecutor(sandbox="none", workdir_root=str(tmp_path), kill_grace=0.3) as ex:
        yield ex


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A directory outside every workdir; it holds one file the attacks must not touch."""
    directory = tmp_path / "outside"
    directory.mkdir()
    (directory / "keep").write_text("keep")
    return directory


@pytest.fixture
def temporaries(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Where temporary directories go (the default workdir root among them): a directory
    of this test's own."""
    directory = tmp_path / "tmp"
    directory.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(directory))
    return directory


async def run(executor: LocalExecutor, workdir: str, command: str) -> None:
    observation = await executor.run_command(workdir, command, timeout=30)
    assert observation.success, observation.stderr.text


async def test_a_hard_link_to_a_file_outside_is_replaced_not_written_through(
    executor: LocalExecutor, tmp_path: Path
) -> None:
    victim = tmp_path / "victim"
    victim.write_text("secret")
    workdir = await executor.prepare(str(tmp_path / "work"), {})
    await run(executor, workdir, f"ln {victim} hl")
    assert victim.stat().st_nlink == 2

    observation = await executor.write_artifact(workdir, "hl", "new")

    assert observation.success
    assert victim.read_text() == "secret" and victim.stat().st_nlink == 1
    written = Path(workdir) / "hl"
    assert written.read_text() == "new" and written.stat().st_nlink == 1
    assert listing(Path(workdir)) == ["hl"]  # no temporary file left behind


async def test_rewriting_a_file_keeps_its_permission_bits(
    executor: LocalExecutor, tmp_path: Path
) -> None:
    workdir = await executor.prepare(str(tmp_path / "work"), {"check.sh": "echo old"})
    await run(executor, workdir, "chmod 750 check.sh")
    assert (await executor.write_artifact(workdir, "check.sh", "echo new")).success
    script = tmp_path / "work" / "check.sh"
    assert stat.S_IMODE(script.stat().st_mode) == 0o750 and script.read_text() == "echo new"


@pytest.mark.parametrize("target", ["keep", "absent"])
async def test_a_symbolic_link_at_the_final_name_is_refused(
    executor: LocalExecutor, tmp_path: Path, outside: Path, target: str
) -> None:
    workdir = await executor.prepare(str(tmp_path / "work"), {})
    await run(executor, workdir, f"ln -s {outside / target} link")

    observation = await executor.write_artifact(workdir, "link", "x")

    assert not observation.success
    assert observation.error == "artifact path 'link' is a symbolic link"
    assert listing(outside) == ["keep"] and (outside / "keep").read_text() == "keep"


@pytest.mark.parametrize("link_to", ["outside", "inside"])
async def test_a_symbolic_link_in_the_path_is_never_followed(
    executor: LocalExecutor, tmp_path: Path, outside: Path, link_to: str
) -> None:
    workdir = await executor.prepare(str(tmp_path / "work"), {"v2/keep": "v2"})
    target = outside if link_to == "outside" else Path(workdir) / "v2"
    await run(executor, workdir, f"ln -s {target} latest")

    observation = await executor.write_artifact(workdir, "latest/sub/p.yaml", "x")

    assert not observation.success
    assert observation.error == (
        "artifact path 'latest/sub/p.yaml' could lead outside the workdir: "
        "'latest' is a symbolic link"
    )
    assert listing(outside) == ["keep"] and listing(Path(workdir) / "v2") == ["keep"]


@pytest.mark.parametrize(
    "attack",
    ['ln -s {outside} "$d"', "true"],
    ids=["swapped-for-a-link", "deleted"],
)
async def test_a_workdir_deleted_or_replaced_ends_the_executor(
    executor: LocalExecutor, tmp_path: Path, outside: Path, attack: str
) -> None:
    workdir = await executor.prepare(str(tmp_path / "work"), {"seed.txt": "x"})
    await run(executor, workdir, 'd=$PWD; cd /; rm -rf "$d"; ' + attack.format(outside=outside))

    with pytest.raises(ExecutorError) as raised:
        await executor.write_artifact(workdir, "policy.yaml", "x")

    assert str(raised.value) == f"workdir {workdir} was deleted or replaced during the run"
    assert listing(outside) == ["keep"]
    await executor.cleanup(workdir)  # never through the link
    assert listing(outside) == ["keep"] and (outside / "keep").read_text() == "keep"


async def test_a_workdir_moved_away_for_another_one_is_neither_written_nor_removed(
    executor: LocalExecutor, tmp_path: Path
) -> None:
    workdir = await executor.prepare(str(tmp_path / "work"), {"seed.txt": "x"})
    await run(executor, workdir, 'd=$PWD; cd /; mv "$d" "$d.moved"; mkdir "$d"; touch "$d/new"')

    with pytest.raises(ExecutorError, match="was deleted or replaced during the run"):
        await executor.write_artifact(workdir, "policy.yaml", "x")

    await executor.cleanup(workdir)
    assert listing(Path(workdir)) == ["new"]  # the newcomer is not the workdir prepared
    assert listing(tmp_path / "work.moved") == []  # the one prepared is emptied where it is


async def test_a_run_whose_workdir_is_swapped_for_a_link_ends_in_executor_error(
    outside: Path, temporaries: Path
) -> None:
    spec, agent = swap_the_workdir_run(outside)

    async with LocalExecutor(sandbox="none", workdir_root=str(temporaries)) as executor:
        result = await run_scenario(spec, agent=agent, executor=executor)

    assert result.outcome is Outcome.EXECUTOR_ERROR
    assert result.reason is not None
    assert re.fullmatch(r"workdir \S+ was deleted or replaced during the run", result.reason)
    assert listing(outside) == ["keep"]  # not written to, nor removed by the cleanup
    [left] = os.listdir(temporaries)  # the agent's link; the workdir it replaced is gone
    assert os.readlink(temporaries / left) == str(outside)


async def test_a_daemon_swapping_a_directory_for_a_link_gets_nothing_outside(
    executor: LocalExecutor, tmp_path: Path, outside: Path
) -> None:
    """Whatever the race did (how often the daemon won depends on the machine's load,
    and is not asserted): nothing lands outside, each write is either done or refused
    with a reason naming it, and what was said written is in the workdir."""
    workdir = await executor.prepare(str(tmp_path / "work"), {})
    written, refused = set(), set()
    with swapping(workdir, outside) as group:
        for i in range(2000):
            observation = await executor.write_artifact(workdir, f"sub/f{i}", str(i))
            if observation.success:
                written.add(i)
            else:
                assert observation.error is not None and f"'sub/f{i}'" in observation.error
                refused.add(i)
    assert live_group_members(group) == []

    assert listing(outside) == ["keep"] and (outside / "keep").read_text() == "keep"
    assert written | refused == set(range(2000))
    assert files_under(workdir) == {f"f{i}": str(i) for i in written}


@pytest.mark.parametrize(
    ("path", "content", "reason"),
    [
        ("a/" * 1000 + "f", "x", "artifact path has 1001 components; at most 64"),
        ("a\x00b", "x", "artifact path is empty or contains a NUL byte"),
        ("a.txt", "\ud800", "cannot write 'a.txt': not valid UTF-8"),
    ],
)
async def test_unwritable_artifacts_are_refused_cleanly(
    executor: LocalExecutor, tmp_path: Path, path: str, content: str, reason: str
) -> None:
    workdir = await executor.prepare(str(tmp_path / "work"), {})
    observation = await executor.write_artifact(workdir, path, content)
    assert not observation.success and observation.error == reason
    assert os.listdir(workdir) == []


async def test_paths_up_to_the_depth_limit_are_written(
    executor: LocalExecutor, tmp_path: Path
) -> None:
    path = "/".join(["d"] * (MAX_DEPTH - 1) + ["f"])
    workdir = await executor.prepare(str(tmp_path / "work"), {})
    assert (await executor.write_artifact(workdir, path, "deep")).success
    assert (tmp_path / "work" / path).read_text() == "deep"


def open_fds() -> dict[int, str]:
    """This process's open descriptors and what they point to."""
    fds = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            fds[int(name)] = os.readlink(f"/proc/self/fd/{name}")
        except FileNotFoundError:  # the descriptor that listed the directory
            continue
    return fds


async def test_a_thousand_runs_leave_no_descriptor_and_no_workdir_behind(
    temporaries: Path,
) -> None:
    agent_steps = [step("generate_policy", {"path": "p/policy.yaml", "content": "kind: X"})]
    spec = ScenarioSpec(id="fds", goal="write it", files={"seed/a.txt": "x"})
    before = open_fds()
    async with LocalExecutor(sandbox="none") as executor:  # its workdir root: temporary
        for _ in range(1000):
            result = await run_scenario(spec, agent=ScriptedAgent(agent_steps), executor=executor)
            assert [entry.observed for entry in result.trace] == ["wrote p/policy.yaml"]
        assert os.listdir(executor.workdir_root) == []
    assert open_fds() == before
    assert os.listdir(temporaries) == []  # the temporary root went with the executor


async def test_named_and_kept_workdirs_are_let_go_and_kept(tmp_path: Path) -> None:
    executor = LocalExecutor(sandbox="none", workdir_root=str(tmp_path))
    agent_steps = [step("generate_policy", {"path": "policy.yaml", "content": "kind: X"})]
    before = open_fds()
    for index in range(50):
        named = ScenarioSpec(id="named", goal="g", workdir=str(tmp_path / f"run{index}"))
        result = await run_scenario(named, agent=ScriptedAgent(agent_steps), executor=executor)
        assert result.workdir == str(tmp_path / f"run{index}")
        kept = await run_scenario(
            ScenarioSpec(id="kept", goal="g"),
            agent=ScriptedAgent(agent_steps),
            executor=executor,
            keep_workdir=True,
        )
        assert kept.workdir is not None
        assert await anyio.Path(kept.workdir, "policy.yaml").read_text() == "kind: X"
        await anyio.to_thread.run_sync(shutil.rmtree, kept.workdir)
    assert open_fds() == before
    assert len([p async for p in anyio.Path(tmp_path).glob("run*/policy.yaml")]) == 50


async def test_a_failed_seed_releases_its_workdir(tmp_path: Path) -> None:
    root = tmp_path / "root"
    executor = LocalExecutor(sandbox="none", workdir_root=str(root))
    before = open_fds()
    for workdir in (None, str(root / "kept")):
        with pytest.raises(ExecutorError, match="cannot seed scenario file"):
            await executor.prepare(workdir, {"ok.txt": "x", "../escape.txt": "x"})
    assert open_fds() == before
    assert os.listdir(root) == ["kept"]  # the temporary workdir is removed
    assert os.listdir(root / "kept") == ["ok.txt"]  # the operator's is kept as it is
    assert not (root / "escape.txt").exists() and not (tmp_path / "escape.txt").exists()


async def test_one_workdir_prepared_again_and_again_is_held_once(tmp_path: Path) -> None:
    executor = LocalExecutor(sandbox="none", workdir_root=str(tmp_path))
    workdir = str(tmp_path / "work")
    before = open_fds()
    for _ in range(100):
        assert await executor.prepare(workdir, {"a.txt": "x"}) == workdir
    held = set(open_fds().items()) - set(before.items())
    assert [target for _, target in held] == [workdir]
    for _ in range(99):
        await executor.cleanup(workdir)
    assert listing(Path(workdir)) == ["a.txt"]  # still prepared once: kept
    await executor.cleanup(workdir)
    assert listing(tmp_path) == []  # removed with the last release
    assert open_fds() == before


async def test_a_workdir_given_through_a_link_is_prepared_at_its_real_path(
    executor: LocalExecutor, tmp_path: Path
) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    workdir = await executor.prepare(str(tmp_path / "link"), {"a.txt": "x"})
    assert workdir == str(tmp_path / "real")
    assert (tmp_path / "real" / "a.txt").read_text() == "x"
    await executor.cleanup(workdir)
    assert (tmp_path / "link").is_symlink() and not (tmp_path / "real").exists()


async def test_a_file_in_the_path_is_refused_as_not_a_directory(
    executor: LocalExecutor, tmp_path: Path
) -> None:
    workdir = await executor.prepare(str(tmp_path / "work"), {"a.txt": "x"})
    observation = await executor.write_artifact(workdir, "a.txt/b.txt", "y")
    assert not observation.success
    assert observation.error == "cannot write 'a.txt/b.txt': 'a.txt' is not a directory"
    assert (tmp_path / "work" / "a.txt").read_text() == "x"
