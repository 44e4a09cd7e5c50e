"""The local executor: confinement, output capping, and killing whole process groups."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest

from executors import LocalExecutor, PathRefused, confine

from .helpers import processes_with, unique_seconds, until

pytestmark = pytest.mark.anyio


@pytest.fixture
async def executor(tmp_path: Path) -> AsyncIterator[LocalExecutor]:
    """Workdirs under ``tmp_path``: the executor refuses any elsewhere."""
    async with LocalExecutor(workdir_root=str(tmp_path), kill_grace=0.3) as executor:
        yield executor


@pytest.mark.parametrize(
    ("path", "reason"),
    [
        ("/etc/passwd", "absolute"),
        ("../outside.txt", "'..'"),
        ("a/../../outside.txt", "'..'"),
        ("~/x", "absolute"),
        ("", "empty"),
        (".", "names no file"),
    ],
)
async def test_artifact_paths_that_escape_are_refused(
    executor: LocalExecutor, tmp_path: Path, path: str, reason: str
) -> None:
    workdir = await executor.prepare(str(tmp_path / "work"), {})
    observation = await executor.write_artifact(workdir, path, "x")
    assert not observation.success
    assert observation.error is not None and reason in observation.error
    assert not (tmp_path / "outside.txt").exists()


async def test_symlinks_leading_outside_are_refused(
    executor: LocalExecutor, tmp_path: Path
) -> None:
    workdir, outside = (
        Path(await executor.prepare(str(tmp_path / "work"), {})),
        tmp_path / "outside",
    )
    outside.mkdir()
    (workdir / "out").symlink_to(outside)
    (workdir / "victim").symlink_to(outside / "victim.txt")
    via_dir = await executor.write_artifact(str(workdir), "out/sub/p.yaml", "x")
    via_file = await executor.write_artifact(str(workdir), "victim", "x")
    assert not via_dir.success and "outside the workdir" in (via_dir.error or "")
    assert not via_file.success and "symbolic link" in (via_file.error or "")
    assert list(outside.iterdir()) == []


async def test_artifacts_are_written_inside_with_parents(
    executor: LocalExecutor, tmp_path: Path
) -> None:
    workdir = await executor.prepare(str(tmp_path / "work"), {})
    observation = await executor.write_artifact(workdir, "policies/p.yaml", "kind: X\n")
    assert observation.success
    assert (tmp_path / "work" / "policies" / "p.yaml").read_text() == "kind: X\n"
    assert confine("a/b.txt").parts == ("a", "b.txt")
    with pytest.raises(PathRefused):
        confine("/abs")


async def test_command_runs_in_the_workdir(executor: LocalExecutor) -> None:
    workdir = await executor.prepare(None, {})
    observation = await executor.run_command(workdir, "pwd; echo err >&2; exit 3", timeout=10)
    assert observation.exit_status == 3 and not observation.success
    assert observation.program_found is True
    assert observation.stdout.text.strip() == workdir
    assert observation.stderr.text.strip() == "err"


async def test_output_is_capped_head_and_tail(tmp_path: Path) -> None:
    async with LocalExecutor(output_cap=1000, workdir_root=str(tmp_path)) as executor:
        observation = await executor.run_command(
            await executor.prepare(None, {}),
            "echo BEGIN; head -c 200000 /dev/zero | tr '\\0' x; echo; echo END",
            timeout=10,
        )
    out = observation.stdout
    assert out.truncated and out.total_bytes > 200000
    assert out.head.startswith("BEGIN") and out.tail.endswith("END\n")
    assert len(out.head) + len(out.tail) <= 1000


@pytest.fixture(params=["bwrap", "none"])
async def contained(
    request: pytest.FixtureRequest, tmp_path: Path
) -> AsyncIterator[tuple[LocalExecutor, str]]:
    """The executor in the sandbox and without it, with a prepared workdir: both kill all
    a command started."""
    async with LocalExecutor(
        sandbox=request.param, workdir_root=str(tmp_path), kill_grace=0.3
    ) as executor:
        yield executor, await executor.prepare(None, {})


async def test_timeout_kills_the_whole_group(contained: tuple[LocalExecutor, str]) -> None:
    executor, workdir = contained
    mark = unique_seconds()
    command = f"sh -c 'sleep {mark}' & sleep {mark}"
    with anyio.fail_after(10):
        observation = await executor.run_command(workdir, command, timeout=0.5)
    assert observation.timed_out and not observation.success
    assert observation.error == "command timed out after 0.5 s"
    assert processes_with(mark) == []


async def test_a_grandchild_holding_the_pipe_does_not_block(
    contained: tuple[LocalExecutor, str],
) -> None:
    executor, workdir = contained
    mark = unique_seconds()
    with anyio.fail_after(5):
        observation = await executor.run_command(workdir, f"sleep {mark} & echo done", timeout=30)
    assert observation.success and observation.stdout.text == "done\n"
    assert processes_with(mark) == []


@pytest.mark.parametrize("sandbox", ["bwrap", "none"])
async def test_no_output_is_lost_when_reading_stops_at_the_end(
    sandbox: str, tmp_path: Path
) -> None:
    mark = unique_seconds()  # its grandchild holds the pipes: no end of file to wait for
    command = f"sleep {mark} & for i in 1 2 3 4 5; do head -c 20000 /dev/zero; done"
    async with LocalExecutor(
        sandbox=sandbox, workdir_root=str(tmp_path), kill_grace=0.3, drain_grace=0
    ) as executor:
        workdir = await executor.prepare(None, {})
        for _ in range(5):
            observation = await executor.run_command(workdir, command, timeout=30)
            assert observation.success and observation.stdout.total_bytes == 100_000
    assert processes_with(mark) == []


async def test_cancellation_kills_the_whole_group(contained: tuple[LocalExecutor, str]) -> None:
    executor, workdir = contained
    mark = unique_seconds()
    command = f"sh -c 'trap \"\" TERM; exec sleep {mark}' & wait"
    with anyio.move_on_after(0.5):
        await executor.run_command(workdir, command, timeout=None)
    # a cancelled command is KILLed at once; its caller, gone, does not wait for its end
    assert await until(lambda: processes_with(mark) == [])


async def test_prepare_creates_workdir_and_seeds_files(
    executor: LocalExecutor, tmp_path: Path
) -> None:
    workdir = await executor.prepare(None, {"etc/sshd_config": "X11Forwarding yes\n"})
    assert Path(workdir).parent == tmp_path  # under the root
    try:
        seeded = anyio.Path(workdir, "etc", "sshd_config")
        assert await seeded.read_text() == "X11Forwarding yes\n"
    finally:
        await executor.cleanup(workdir)
    assert not await anyio.Path(workdir).exists()
    named = tmp_path / "a" / "b"
    assert await executor.prepare(str(named), {}) == str(named)
    assert named.is_dir()
    assert await executor.prepare("c/d", {}) == str(tmp_path / "c" / "d")  # under the root
