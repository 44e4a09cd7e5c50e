"""Attacks on ``cmbs batch --backend ray`` by a hostile agent (its commands) and hostile
agent programs, and answers from a faulty worker; each test asserts the safe behaviour.

- a command that finds a Ray cluster taking calls without a token could join it and run
  a task outside every sandbox: ``--address`` is refused without token authentication,
  and the batch's own throwaway cluster takes no call without its token;
- a worker node without bubblewrap runs nothing bare: the driver's containment is the
  workers';
- a worker's answer of the wrong shape, a record after the end, NaN in the records, an
  answer that never comes: none ends the batch, none is logged, no deadline stretched;
- a job that kills its worker costs the jobs beside it nothing;
- SIGTERM and SIGHUP end a Ray batch as they end a local one.

A worker *process* that is compromised is out of scope: Ray nodes are one trust domain
(see the trust model in docs/guides/batch.md).
"""

from __future__ import annotations

import base64
import importlib.util
import json
import os
import re
import secrets
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .helpers import CMBS, evaluated_files, step
from .ray_helpers import run_on_cluster, scripted_jobs, scripted_plan

pytestmark = [
    pytest.mark.ray,
    pytest.mark.skipif(
        importlib.util.find_spec("ray") is None and not os.environ.get("CI"),
        reason="install the ray extra: pip install -e '.[ray]'",
    ),
]

PYTHON = sys.executable
RAY = str(Path(sys.executable).parent / "ray")

#: Holds a one-node Ray cluster in a process of its own (its authentication and its
#: environment are the caller's) until its stdin closes; prints the cluster's address.
HOLDER = """\
import sys
from ray.cluster_utils import Cluster
cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
cluster.wait_for_nodes()
print(cluster.address, flush=True)
sys.stdin.read()
cluster.shutdown()
"""

#: A command's script: join the cluster at ADDR as a node of its own (Ray's own CLI, run
#: in the sandbox), then run a task on another node, which reads KEY as Ray's user does.
ESCAPE = """\
export RAY_AUTH_MODE=disabled HOME=/tmp/home
mkdir -p /tmp/r
{ray} start --address=ADDR --num-cpus=0 --object-store-memory=80000000 \\
    --plasma-directory=/tmp --temp-dir=/tmp/r --node-ip-address=127.0.0.1 \\
    --disable-usage-stats >/dev/null 2>&1
{python} - <<'PY'
import hashlib, ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy as On
ray.init(address="ADDR", _node_ip_address="127.0.0.1", logging_level="ERROR")
mine = ray.get_runtime_context().get_node_id()
@ray.remote(num_cpus=0)
def outside(path):
    import os
    return os.getuid(), hashlib.sha256(open(path, "rb").read()).hexdigest()
for node in [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeID"] != mine]:
    there = outside.options(scheduling_strategy=On(node, soft=False))
    print("ESCAPED uid=%s key=%s" % ray.get(there.remote("KEY")))
PY
"""

#: A command's script: every TCP port listening on this host, each asked (at once, a few
#: seconds each) as a Ray GCS, without a token, for its jobs; "OPEN" for a cluster that
#: answers and runs the batch whose scenarios lie under MARKER (no other cluster is told).
SCAN = """\
import subprocess, sys
ports = set()
for table in ("/proc/net/tcp", "/proc/net/tcp6"):
    for line in open(table).read().splitlines()[1:]:
        fields = line.split()
        if fields[3] == "0A":
            ports.add(int(fields[1].rsplit(":", 1)[1], 16))
ask = (
    "import sys; from ray._raylet import GcsClient as G; "
    "jobs = G(address=sys.argv[1]).get_all_job_info(timeout=3); "
    "print(any(sys.argv[2] in j.entrypoint for j in jobs.values()))"
)
asked = {
    port: subprocess.Popen(
        [sys.executable, "-c", ask, f"127.0.0.1:{port}", "MARKER"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={"RAY_AUTH_MODE": "disabled", "PATH": "/usr/bin:/bin"},
    )
    for port in sorted(ports)
}
refused = 0
for port, probe in asked.items():
    try:
        out, err = probe.communicate(timeout=15)
    except subprocess.TimeoutExpired:
        probe.kill()
        continue
    refused += "Unauthenticated" in err or "InvalidAuthToken" in err
    if out.strip() == "True":
        print("OPEN", port)
print("SCANNED", len(asked), "ports;", refused, "refused without a token")
"""


def sh(script: str) -> str:
    """``script`` as one command line for a step (no quoting to get wrong)."""
    return f"echo {base64.b64encode(script.encode()).decode()} | base64 -d | sh"


def py(script: str) -> str:
    return f"echo {base64.b64encode(script.encode()).decode()} | base64 -d | {PYTHON} -"


def needs_visible_venv() -> None:
    if Path(sys.executable).parent.resolve().is_relative_to("/tmp"):
        pytest.skip("this environment is under /tmp, which the sandbox makes private")


def held_cluster(env: dict[str, str], log: Path) -> tuple[subprocess.Popen[str], str]:
    with log.open("w") as errors:
        holder = subprocess.Popen(
            [PYTHON, "-c", HOLDER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=errors,
            text=True,
            env=env,
        )
    assert holder.stdout is not None
    address = holder.stdout.readline().strip()
    assert address, f"the Ray cluster did not start: {log.read_text()[-2000:]}"
    return holder, address


def release(holder: subprocess.Popen[str]) -> None:
    assert holder.stdin is not None and holder.stdout is not None
    holder.stdin.close()
    try:
        holder.wait(timeout=60)
    except subprocess.TimeoutExpired:
        holder.kill()
        holder.wait()
    holder.stdout.close()


def pack(folder: Path, count: int, deadline: float = 200) -> Path:
    folder.mkdir()
    for i in range(count):
        spec = {"id": f"n{i}", "goal": "g", "deadline_s": deadline, "files": evaluated_files()}
        (folder / f"s{i}.yaml").write_text(json.dumps(spec))
    return folder


def script(path: Path, *commands: str) -> str:
    lines = [step("check_status", {"command": c}) for c in commands]
    lines.append(step("terminate", posture="non_compliant", evidence="successful"))
    path.write_text("\n".join(lines) + "\n")
    return f"script:{path}"


def observed(db: Path) -> list[str]:
    """Every command's stdout and stderr in ``db``, as recorded."""
    with sqlite3.connect(db) as conn:
        bodies = [b for (b,) in conn.execute("SELECT body FROM records WHERE kind='observation'")]
    out = []
    for body in bodies:
        data = json.loads(body)["data"]
        out.append(data["stdout"]["head"] + data["stdout"]["tail"] + data["stderr"]["head"])
    return out


def cmbs_batch(*args: str, env: dict[str, str] | None = None, timeout: float = 600) -> Any:
    return subprocess.run(
        [*CMBS, "batch", *args, "--backend", "ray"],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


# -- a command on a worker, and the cluster it runs on ------------------------------------


def test_a_command_cannot_use_an_open_cluster_to_leave_its_sandbox(tmp_path: Path) -> None:
    """A cluster named with --address that takes calls without a token: a scenario's
    command (the agent chose it) joins it as a node and reads the signing key through a
    task on the head node. Safe: the batch refuses such a cluster, or the escape fails."""
    needs_visible_venv()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["RAY_AUTH_MODE"] = "disabled"
    holder, address = held_cluster(env, tmp_path / "cluster.log")
    try:
        key = tmp_path / "signing_key"
        escape = ESCAPE.format(ray=RAY, python=PYTHON)
        escape = escape.replace("ADDR", address).replace("KEY", str(key))
        agent = script(tmp_path / "s.jsonl", sh(escape))
        out, db = tmp_path / "r.jsonl", tmp_path / "audit.db"
        done = cmbs_batch(
            str(pack(tmp_path / "pack", 1)),
            "--agent", agent,
            "--out", str(out),
            "--audit-db", str(db),
            "--signing-key", str(key),
            "--address", address,
            env=env,
        )  # fmt: skip
        if done.returncode == 2:  # refused before anything ran: safe
            assert not out.exists()
            return
        seen = "\n".join(observed(db))
        assert "ESCAPED" not in seen, seen  # uid=0 and the key's SHA-256, from a sandbox
    finally:
        release(holder)


def test_the_batchs_own_cluster_takes_no_call_without_its_token(tmp_path: Path) -> None:
    """Without --address: every port this host listens on, asked from a sandboxed command
    as a GCS without a token; the batch's own cluster (found by its job's command line)
    must not answer."""
    needs_visible_venv()
    marker = f"pack-{secrets.token_hex(6)}"
    agent = script(tmp_path / "s.jsonl", py(SCAN.replace("MARKER", marker)))
    out, db = tmp_path / "r.jsonl", tmp_path / "audit.db"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    done = cmbs_batch(
        str(pack(tmp_path / marker, 1)),
        "--agent", agent,
        "--out", str(out),
        "--audit-db", str(db),
        "--signing-key", str(tmp_path / "key"),
        env=env,
    )  # fmt: skip
    assert done.returncode in (0, 3), done.stderr[-3000:]
    seen = "\n".join(observed(db))
    assert "SCANNED" in seen, seen
    assert not re.search(r" 0 refused", seen), seen  # it did reach the cluster's GCS
    assert "OPEN" not in seen, seen


def test_a_worker_without_bubblewrap_runs_nothing_bare(tmp_path: Path) -> None:
    """The driver has bubblewrap, the cluster's node does not (CMBS_BWRAP='' there, as a
    node without it installed): with the default --sandbox auto, the node ran every
    command bare, as Ray's user, where the key is readable. Safe: the batch stops before
    the first job (one line, exit 2), or every run is contained as the driver's are."""
    token = secrets.token_hex(32)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "CMBS_BWRAP"))}
    env |= {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token}
    holder, address = held_cluster(env | {"CMBS_BWRAP": ""}, tmp_path / "cluster.log")
    try:
        agent = script(tmp_path / "s.jsonl", "id -u")
        out, db = tmp_path / "r.jsonl", tmp_path / "audit.db"
        done = cmbs_batch(
            str(pack(tmp_path / "pack", 2)),
            "--agent", agent,
            "--out", str(out),
            "--audit-db", str(db),
            "--signing-key", str(tmp_path / "key"),
            "--address", address,
            env=env,
        )  # fmt: skip
        if done.returncode == 2:
            assert done.stderr.count("\n") == 1 and "Ray node" in done.stderr, done.stderr
            assert not out.exists()
            return
        with sqlite3.connect(db) as conn:
            firsts = [json.loads(b)["data"] for (b,) in conn.execute(
                "SELECT body FROM records WHERE kind='session'"
            )]  # fmt: skip
        assert firsts
        assert {f["containment"]["sandbox"] for f in firsts} == {"bwrap"}, [
            f["containment"]["user"] for f in firsts
        ]
    finally:
        release(holder)


# -- a compromised worker ----------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    """One node, two CPUs, token authentication on (the session's token, set by
    conftest.py), for the faulty workers' batches."""
    from ray.cluster_utils import Cluster

    made = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    made.wait_for_nodes()
    try:
        yield str(made.address)
    finally:
        made.shutdown()


LIE = [
    step("declare_posture", {"posture": "compliant"}, posture="compliant"),
    step("terminate", posture="compliant", evidence="successful"),
]


def hostile_batch(
    address: str,
    forgeries: list[str],
    tmp_path: Path,
    *,
    audit: bool = True,
    deadline: float = 60,
    grace: float | None = None,
) -> tuple[dict[str, dict[str, Any]], Any]:
    """Run one job per forgery (its scenario id) through run_batch_ray with a worker that
    runs each honestly (the liar: its claim and its termination are blocked), then changes
    what it hands back as the forgery says. The records by scenario id, and the store."""

    from cmbs_async.audit import SQLiteAuditStore, load_or_create_key
    from cmbs_async.batch import Job
    from cmbs_async.batch.ray_worker import BatchWorker

    marker = str(tmp_path / "ran-on-the-driver")

    class Payload:
        """Unpickled wherever the answer is read."""

        def __reduce__(self) -> Any:
            code = f"import os\nwith open({marker!r}, 'w') as f:\n    f.write(str(os.getpid()))"
            return (exec, (code, {}))

    class Forger(BatchWorker):
        async def run(self, planned: Job, session_id: str) -> dict[str, Any]:
            import anyio

            forgery = planned.spec.id
            if forgery == "never-answers":
                await anyio.sleep(90)
            answer = await super().run(planned, session_id)
            record, audit = answer["record"], [list(e) for e in answer["audit"]]
            if forgery == "data-not-a-mapping":
                audit[0][2] = ["not", "a", "mapping"]
            elif forgery == "record-after-the-end":
                audit.append(["step", 99, {"raw": "{}"}])
            elif forgery == "nan-in-the-log":
                audit[0][2] = audit[0][2] | {"extra": float("nan")}
            return {"record": record, "audit": [tuple(e) for e in audit]}

    jobs = scripted_jobs(["honest", *forgeries], "script:lie", deadline)
    plan = scripted_plan("script:lie", LIE, audit=audit)
    store = (
        SQLiteAuditStore(tmp_path / "a.db", key=load_or_create_key(tmp_path / "key"))
        if audit
        else None
    )
    found = run_on_cluster(
        address,
        jobs,
        plan=plan,
        concurrency=4,
        store=store,
        worker=Forger,
        workers=1,
        grace=grace,
    )
    assert found["honest"]["outcome"] == "agent_finished"
    return found, store


@pytest.mark.parametrize("forgery", ["record-after-the-end"])
def test_what_the_records_do_not_bear_out_is_not_logged(
    cluster: str, tmp_path: Path, forgery: str
) -> None:
    found, store = hostile_batch(cluster, [forgery], tmp_path)
    try:
        run = found[forgery]
        assert run["outcome"] == "runner_error", (run["outcome"], run.get("posture"))
        assert "was not logged" in run["reason"]
        assert run.get("session_id") not in store.session_ids()
    finally:
        store.close()


def test_an_answer_of_the_wrong_shape_does_not_end_the_batch(cluster: str, tmp_path: Path) -> None:
    """A session record whose data is a list raised AttributeError out of run_batch_ray:
    the whole batch ended with a traceback."""
    found, store = hostile_batch(cluster, ["data-not-a-mapping"], tmp_path)
    store.close()
    assert found["data-not-a-mapping"]["outcome"] == "runner_error"


def test_a_worker_that_never_answers_does_not_stretch_the_deadline(
    cluster: str, tmp_path: Path
) -> None:
    """The scenario's deadline is 5 s; the worker answers after 90 s. A local batch ends
    the run at its deadline; the Ray driver waited as long as the worker liked."""
    started = time.monotonic()
    found, store = hostile_batch(cluster, ["never-answers"], tmp_path, deadline=5, grace=5)
    store.close()
    assert time.monotonic() - started < 60  # the worker would answer after 90 s
    assert found["never-answers"]["outcome"] != "agent_finished"


def test_the_log_holds_only_json(cluster: str, tmp_path: Path) -> None:
    """NaN in a record was signed into the log: `cmbs audit export --jsonl` then prints
    lines a strict JSON parser refuses."""
    hostile_batch(cluster, ["nan-in-the-log"], tmp_path)[1].close()

    def refuse(constant: str) -> Any:
        raise ValueError(f"not JSON: {constant}")

    with sqlite3.connect(tmp_path / "a.db") as conn:
        for (body,) in conn.execute("SELECT body FROM records"):
            json.loads(body, parse_constant=refuse)


# -- signals -------------------------------------------------------------------------------


@pytest.mark.parametrize(("sig", "status"), [(signal.SIGTERM, 143), (signal.SIGHUP, 129)])
def test_a_ray_batch_takes_sigterm_and_sighup_as_a_local_one(
    cluster: str, tmp_path: Path, sig: signal.Signals, status: int
) -> None:
    """SIGTERM ended the driver in Ray's crash handler (exit 1, a stack dump, no summary);
    SIGHUP killed it outright and left an empty results file behind."""
    folder = pack(tmp_path / "pack", 2)
    agent = script(tmp_path / "s.jsonl", "sleep 120")
    out = tmp_path / "r.jsonl"
    args = [*CMBS, "batch", str(folder), "--agent", agent, "--out", str(out), "--no-audit"]
    args += ["--signing-key", str(tmp_path / "key"), "--backend", "ray", "--address", cluster]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # until its commands run
        if subprocess.run(["pgrep", "-f", "^sleep 120$"], capture_output=True).returncode == 0:
            break
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.5)
    time.sleep(2)
    proc.send_signal(sig)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == status, stderr[-2000:]
    assert "interrupted" in stderr
    assert not out.exists() or out.read_text()  # no empty results file left behind


def test_a_job_that_kills_its_worker_costs_only_its_own_runs(cluster: str, tmp_path: Path) -> None:
    """One job's worker process dies 2 s into it, every time (as when Ray's memory monitor
    kills the worker of the job that fills the node's memory): the three jobs that shared
    the worker were charged a loss each time too and ended ``runner_error`` ("its Ray
    worker was lost 3 times") though each would have finished in 4 s."""

    from cmbs_async.batch import Job
    from cmbs_async.batch.ray_worker import BatchWorker

    class Dies(BatchWorker):
        async def run(self, planned: Job, session_id: str) -> dict[str, Any]:
            import anyio

            if planned.spec.id == "poison":
                await anyio.sleep(2)
                os._exit(1)
            return await super().run(planned, session_id)

    slow = [
        step("check_status", {"command": "sleep 4"}),
        step("terminate", posture="non_compliant", evidence="successful"),
    ]
    names = ["poison", "innocent-1", "innocent-2", "innocent-3"]
    jobs = scripted_jobs(names, "script:slow")
    plan = scripted_plan("script:slow", slow, audit=False)
    found = run_on_cluster(cluster, jobs, plan=plan, concurrency=4, worker=Dies, workers=1)
    assert found["poison"]["outcome"] == "runner_error"
    for name in names[1:]:
        assert found[name]["outcome"] == "agent_finished", found[name].get("reason")
