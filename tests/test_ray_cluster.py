"""A batch on a real two-node Ray cluster on this machine (``ray.cluster_utils.Cluster``):
stdio and model agents across both nodes, one signed audit log on the driver verified
against its checkpoint, a node removed mid-batch and the driver killed, with no result
lost or doubled; what a worker lacks, and what a hostile worker forges, refused."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .helpers import CMBS, EVALUATE, SOLVE, evaluated_files, step
from .ray_helpers import run_on_cluster, scripted_jobs, scripted_plan
from .sshd import LocalSshd, sshd_available

pytestmark = [
    pytest.mark.ray,
    pytest.mark.skipif(
        importlib.util.find_spec("ray") is None and not os.environ.get("CI"),
        reason="install the ray extra: pip install -e '.[ray]'",
    ),
]

#: A stdio agent program: it says the lines of the steps file given, one per turn.
PROGRAM = """\
import sys
for line in open(sys.argv[1]):
    if not sys.stdin.readline():
        break
    print(line.strip(), flush=True)
"""


class TwoNodes:
    """A head node and a worker node, two CPUs each, with Ray's token authentication on
    (the session's token, set by conftest.py: every batch of the test, a child process,
    inherits it; no sandboxed command sees it)."""

    def __init__(self) -> None:
        from ray.cluster_utils import Cluster

        self.cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
        self.worker = self.cluster.add_node(num_cpus=2)
        self.cluster.wait_for_nodes()

    @property
    def address(self) -> str:
        return str(self.cluster.address)

    def close(self) -> None:
        self.cluster.shutdown()


@pytest.fixture(scope="module")
def two_nodes() -> Iterator[TwoNodes]:
    nodes = TwoNodes()
    try:
        yield nodes
    finally:
        nodes.close()


def scenarios(folder: Path, count: int, command: str = EVALUATE) -> Path:
    folder.mkdir()
    for i in range(count):
        spec = {"id": f"n{i}", "goal": "g", "deadline_s": 120, "files": evaluated_files()}
        (folder / f"s{i}.yaml").write_text(json.dumps(spec))
    return folder


def batch(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CMBS, "batch", *args, "--backend", "ray"],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def recorded(
    folder: Path, agent: str, tmp_path: Path, address: str
) -> tuple[subprocess.CompletedProcess[str], Path, Path, Path]:
    """A batch of ``agent`` recorded into an audit database with a checkpoint; the batch,
    its results file, the database and the checkpoint."""
    out, db, head = tmp_path / "r.jsonl", tmp_path / "audit.db", tmp_path / "head.json"
    done = batch(
        str(folder), "--agent", agent, "--out", str(out), "--audit-db", str(db),
        "--head-out", str(head), "--address", address,
    )  # fmt: skip
    return done, out, db, head


def results(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in out.read_text().splitlines() if line.endswith("}")]


def verified(db: Path, head: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CMBS, "audit", "verify", str(db), "--head", str(head)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def sessions_in(db: Path) -> set[str]:
    import sqlite3

    with sqlite3.connect(db) as conn:
        return {row[0] for row in conn.execute("SELECT session_id FROM sessions")}


def test_stdio_agents_on_two_nodes_are_one_signed_log(two_nodes: TwoNodes, tmp_path: Path) -> None:
    folder = scenarios(tmp_path / "pack", 8)
    steps, program = tmp_path / "steps.jsonl", tmp_path / "agent.py"
    steps.write_text("\n".join(SOLVE) + "\n")
    program.write_text(PROGRAM)
    agent = f"stdio:{sys.executable} {program} {steps}"
    done, out, db, head = recorded(folder, agent, tmp_path, two_nodes.address)
    assert done.returncode == 0, done.stderr[-3000:]
    runs = results(out)
    assert len(runs) == 8 and len({r["key"] for r in runs}) == 8
    assert {r["outcome"] for r in runs} == {"terminated"}
    assert len({r["node"] for r in runs}) == 2  # both nodes ran some
    assert {r["session_id"] for r in runs} == sessions_in(db)
    check = verified(db, head)
    assert check.returncode == 0, check.stdout + check.stderr


def test_a_command_on_a_worker_cannot_use_the_cluster(two_nodes: TwoNodes, tmp_path: Path) -> None:
    """Ray takes calls only with its token, which no sandbox holds: a command that finds
    the cluster's address (it can reach its ports) still cannot run code outside."""
    folder = tmp_path / "pack"
    folder.mkdir()
    (folder / "s.yaml").write_text(json.dumps({"id": "escape", "goal": "g", "deadline_s": 120}))
    escape = (
        f"{sys.executable} -c \"import ray; ray.init(address='{two_nodes.address}'); "
        "print('ESCAPED', ray.get(ray.remote(lambda: open('/etc/shadow').read()).remote()))\""
        " 2>&1 | grep -o -m1 -e ESCAPED -e InvalidAuthToken -e Unauthenticated"
    )
    script = tmp_path / "s.jsonl"
    script.write_text(step("check_status", {"command": escape}) + "\n" + SOLVE[-1] + "\n")
    out = tmp_path / "r.jsonl"
    done = batch(
        str(folder),
        "--agent",
        f"script:{script}",
        "--out",
        str(out),
        "--no-audit",
        "--address",
        two_nodes.address,
    )
    assert done.returncode == 3, done.stderr[-3000:]
    (run,) = results(out)
    seen = run["trace"][0]["observed"]
    assert "ESCAPED" not in seen
    assert "InvalidAuthToken" in seen or "Unauthenticated" in seen, seen


def test_a_node_lost_and_a_driver_killed_lose_and_double_nothing(tmp_path: Path) -> None:
    nodes = TwoNodes()
    try:
        folder = scenarios(tmp_path / "pack", 24)
        slow = [step("check_status", {"command": "sleep 1"}), *SOLVE]
        script = tmp_path / "slow.jsonl"
        script.write_text("\n".join(slow) + "\n")
        out, db, head = tmp_path / "r.jsonl", tmp_path / "audit.db", tmp_path / "head.json"
        args = [
            *CMBS,
            "batch",
            str(folder),
            "--agent",
            f"script:{script}",
            "--concurrency",
            "2",
            "--out",
            str(out),
            "--audit-db",
            str(db),
            "--head-out",
            str(head),
            "--backend",
            "ray",
            "--address",
            nodes.address,
        ]
        # a node removed while the batch runs
        first = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        wait_for_lines(out, 2, first)
        nodes.cluster.remove_node(nodes.worker)
        stdout, stderr = first.communicate(timeout=600)
        assert first.returncode == 0, stderr[-3000:]
        runs = results(out)
        assert len(runs) == 24 and len({r["key"] for r in runs}) == 24
        assert {r["outcome"] for r in runs} == {"terminated"}
        assert verified(db, head).returncode == 0

        # the driver killed mid-batch, then resumed
        nodes.cluster.add_node(num_cpus=2)
        out2 = tmp_path / "again.jsonl"
        again = [a if a != str(out) else str(out2) for a in args]
        killed = subprocess.Popen(again, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        wait_for_lines(out2, 3, killed)
        killed.send_signal(signal.SIGKILL)
        killed.communicate(timeout=60)
        resumed = subprocess.run([*again, "--resume"], capture_output=True, text=True, timeout=600)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        runs = results(out2)
        assert len(runs) == 24 and len({r["key"] for r in runs}) == 24
        assert "from before" in resumed.stdout
        assert {r["session_id"] for r in runs} <= sessions_in(db)
        check = verified(db, head)
        assert check.returncode == 0, check.stdout + check.stderr
    finally:
        nodes.close()


def wait_for_lines(out: Path, count: int, proc: subprocess.Popen[Any]) -> None:
    """Until ``out`` holds ``count`` result lines (the batch is under way)."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if out.exists() and out.read_bytes().count(b"\n") >= count:
            return
        assert proc.poll() is None, "the batch ended before it was under way"
        time.sleep(0.1)
    raise AssertionError(f"{out} did not reach {count} lines")


@pytest.mark.llm
def test_a_model_agent_on_two_nodes(two_nodes: TwoNodes, llama: Any, tmp_path: Path) -> None:
    folder = scenarios(tmp_path / "pack", 4)
    model = f"openai:smollm2@{llama.base_url}"
    done, out, db, head = recorded(folder, model, tmp_path, two_nodes.address)
    assert done.returncode in (0, 3), done.stderr[-3000:]
    runs = results(out)
    assert len(runs) == 4 and len({r["node"] for r in runs}) == 2
    assert not {r["outcome"] for r in runs} & {"agent_error", "runner_error", "executor_error"}
    assert all(r["steps"] >= 1 for r in runs)  # the model was asked, from both nodes
    assert {r["session_id"] for r in runs} == sessions_in(db)
    assert verified(db, head).returncode == 0


@pytest.mark.parametrize(
    ("agent", "said"),
    [
        ("stdio:no-such-agent-program --flag", "no program no-such-agent-program on PATH"),
        ("openai:m@http://127.0.0.1:1/v1", "cannot reach http://127.0.0.1:1/v1/models"),
    ],
)
def test_what_a_worker_lacks_stops_the_batch_in_one_line(
    two_nodes: TwoNodes, tmp_path: Path, agent: str, said: str
) -> None:
    folder = scenarios(tmp_path / "pack", 2)
    out = tmp_path / "r.jsonl"
    refused = batch(
        str(folder), "--agent", agent, "--out", str(out), "--address", two_nodes.address
    )
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert refused.stderr.count("\n") == 1 and said in refused.stderr
    assert refused.stderr.startswith("cmbs batch: error: Ray node ")
    assert not out.exists()  # nothing ran, nothing written


def test_a_key_that_cannot_be_carried_stops_the_batch(two_nodes: TwoNodes, tmp_path: Path) -> None:
    folder = tmp_path / "pack"
    folder.mkdir()
    spec = {"id": "far", "goal": "g", "host": "ssh://nobody@127.0.0.1:1"}
    (folder / "far.yaml").write_text(json.dumps(spec))
    key = tmp_path / "id_not_a_key"
    key.write_text("not a key\n")
    script = tmp_path / "s.jsonl"
    script.write_text(SOLVE[-1] + "\n")
    out = tmp_path / "r.jsonl"
    refused = batch(
        str(folder),
        "--agent",
        f"script:{script}",
        "--identity",
        str(key),
        "--insecure-no-host-key-check",
        "--out",
        str(out),
        "--address",
        two_nodes.address,
    )
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
    assert "not a usable private key" in refused.stderr and not out.exists()


def test_what_a_hostile_worker_forges_is_not_logged(two_nodes: TwoNodes, tmp_path: Path) -> None:

    from cmbs_async.audit import SQLiteAuditStore, load_or_create_key
    from cmbs_async.batch import Job
    from cmbs_async.batch.ray_worker import BatchWorker

    class Forger(BatchWorker):
        """Runs each job honestly, then changes what it hands back, as a job says."""

        async def run(self, planned: Job, session_id: str) -> dict[str, Any]:
            answer = await super().run(planned, session_id)
            record, audit = answer["record"], answer["audit"]
            forgery = planned.spec.id
            if forgery == "claims-success":
                record.update(outcome="terminated", posture="compliant")
            elif forgery == "allows-a-block":
                audit = [
                    (k, s, d | {"verdict": "ALLOW"} if k == "decision" else d) for k, s, d in audit
                ]
            elif forgery == "another-session":
                record["session_id"] = "0" * 32
            elif forgery == "another-profile":
                first = audit[0]
                lax = first[2]["profile"] | {"name": "lax"}
                audit = [(first[0], first[1], first[2] | {"profile": lax}), *audit[1:]]
            return {"record": record, "audit": audit}

    lie = [step("declare_posture", {"posture": "compliant"}, posture="compliant")]
    names = ["honest", "claims-success", "allows-a-block", "another-session", "another-profile"]
    jobs = scripted_jobs(names, "script:lie")
    plan = scripted_plan("script:lie", lie)
    store = SQLiteAuditStore(tmp_path / "a.db", key=load_or_create_key(tmp_path / "key"))
    found = run_on_cluster(
        two_nodes.address, jobs, plan=plan, concurrency=2, store=store, worker=Forger, workers=2
    )
    assert found["honest"]["outcome"] == "agent_finished"
    assert found["honest"]["session_id"] in store.session_ids()
    for name in names[1:]:
        assert found[name]["outcome"] == "runner_error", name
        assert "was not logged" in found[name]["reason"]
    assert "its result says outcome" in found["claims-success"]["reason"]
    assert "the gate judges it otherwise" in found["allows-a-block"]["reason"]
    assert "not its own" in found["another-session"]["reason"]
    assert "another profile" in found["another-profile"]["reason"]
    assert len(store.session_ids()) == 1  # nothing forged is in the log
    assert store.verify().intact
    store.close()


@pytest.mark.ssh
@pytest.mark.skipif(
    not sshd_available() and not os.environ.get("CI"), reason="OpenSSH sshd is not installed"
)
def test_a_scenarios_host_is_reached_from_the_workers_with_a_key_only_in_memory(
    two_nodes: TwoNodes, tmp_path: Path
) -> None:
    with LocalSshd() as sshd:
        folder = tmp_path / "pack"
        folder.mkdir()
        for i in range(4):  # over both nodes
            spec = f"id: far{i}\ngoal: g\nhost: {sshd.url}\nfiles: {{f: far}}\n"
            (folder / f"far{i}.yaml").write_text(spec)
        steps = tmp_path / "steps.jsonl"
        steps.write_text(step("check_status", {"command": "cat f"}) + "\n")
        out = tmp_path / "r.jsonl"
        logins = (sshd.dir / "sshd.log").read_text().count("Accepted publickey")
        done = batch(
            str(folder), "--agent", f"script:{steps}", "--out", str(out), "--no-audit",
            "--identity", sshd.client_key, "--known-hosts", sshd.known_hosts,
            "--address", two_nodes.address,
        )  # fmt: skip
        assert done.returncode == 3, done.stderr[-3000:]
        runs = results(out)
        assert {r["trace"][0]["observed"] for r in runs} == {"exit 0: far"}
        assert {r["executor"] for r in runs} == {sshd.url}
        assert len({r["node"] for r in runs}) == 2
        assert (sshd.dir / "sshd.log").read_text().count("Accepted publickey") > logins
        secret = Path(sshd.client_key).read_text().splitlines()[1]  # a line of the key
    assert not files_holding(Path("/tmp/ray"), secret.encode())


def files_holding(root: Path, needle: bytes) -> list[Path]:
    """The files under ``root`` (Ray's logs, sockets and spilled objects) holding ``needle``."""
    found = []
    for path in root.rglob("*"):
        try:
            if path.is_file() and not path.is_symlink() and needle in path.read_bytes():
                found.append(path)
        except OSError:  # a socket, a file removed meanwhile
            continue
    return found
