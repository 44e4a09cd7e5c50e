"""Cost of the tamper-evident audit trail, and of the reconcile filter.

Run: ``python benchmarks/audit_throughput.py [--records N]``. In one run, against the same
SQLite schema and pragmas (WAL, synchronous=FULL, one transaction per record, as the
runtime does): (a) unsigned inserts of the same canonical bodies, (b) signed, chained
records through ``SQLiteAuditStore.append``, each also appended to the log over all
sessions (its hash chain and signed head). Prints records per second and (b)/(a). Then
what the log's chain costs per record, the time to verify ``--verify-records`` records
against a checkpoint and without one, and the reconcile filter's cost per step.
"""

from __future__ import annotations

import argparse
import sqlite3
import statistics
import tempfile
import time
from pathlib import Path

from cmbs_async.audit import Entry, RecordKind, SQLiteAuditStore, load_or_create_key
from cmbs_async.audit.log import GENESIS, chain
from cmbs_async.audit.signing import canonical, digest
from cmbs_async.protocol import Assessment, Commitment
from cmbs_async.review import reconcile

DATA = {
    "action": "check_status",
    "verdict": "ALLOW",
    "message": "Action allowed.",
    "detail": None,
}


def unsigned(path: Path, n: int) -> float:
    store = SQLiteAuditStore(path)  # the same schema and pragmas, nothing signed
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=FULL")
    start = time.perf_counter()
    for seq in range(n):
        body = canonical({"session_id": "u", "seq": seq, "kind": "decision", "data": DATA})
        db.execute("BEGIN IMMEDIATE")
        db.execute(
            "INSERT INTO records VALUES ('u', ?, 'decision', ?, ?, '', '')",
            (seq, seq, body.decode()),
        )
        db.execute("COMMIT")
    elapsed = time.perf_counter() - start
    db.close()
    store.close()
    return n / elapsed


def signed(path: Path, key_path: Path, n: int) -> float:
    store = SQLiteAuditStore(path, key=load_or_create_key(key_path))
    store.open_session("s", {"scenario": {"id": "bench"}})
    start = time.perf_counter()
    for seq in range(n):
        store.append("s", [Entry(RecordKind.DECISION, seq, DATA)])
    elapsed = time.perf_counter() - start
    assert store.verify().intact
    store.close()
    return n / elapsed


def chain_cost(samples: int) -> float:
    """Microseconds per record for the log's chain step (one SHA-256)."""
    hashes = [digest(str(i).encode()) for i in range(samples)]
    start = time.perf_counter()
    chain(GENESIS, hashes)
    return (time.perf_counter() - start) / samples * 1e6


def verification(path: Path, key_path: Path, n: int) -> tuple[float, float]:
    """Records per second verified against a checkpoint, and without one."""
    store = SQLiteAuditStore(path, key=load_or_create_key(key_path))
    per_session = 1000
    for s in range(n // per_session):
        store.open_session(f"s{s}", {"scenario": {"id": "bench"}})
        store.append(f"s{s}", [Entry(RecordKind.DECISION, i, DATA) for i in range(per_session - 1)])
    checkpoint = store.checkpoint()
    store.close()
    reader = SQLiteAuditStore(path, read_only=True)
    start = time.perf_counter()
    report = reader.verify(checkpoint=checkpoint)
    against_head = report.records / (time.perf_counter() - start)
    assert report.intact and report.records == n
    start = time.perf_counter()
    assert reader.verify().intact
    without = n / (time.perf_counter() - start)
    reader.close()
    return against_head, without


def reconcile_cost(samples: int) -> tuple[float, float]:
    assessment = Assessment(commitment_met=False, confidence=0.5, concerns=("x",))
    commitment = Commitment(interpretation="i", assumptions=("a", "b", "c", "d"))
    costs = []
    for i in range(samples):
        a = assessment if i % 2 else None
        t0 = time.perf_counter_ns()
        reconcile(a, commitment)
        costs.append(time.perf_counter_ns() - t0)
    costs.sort()
    return statistics.median(costs) / 1000, costs[int(len(costs) * 0.99)] / 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--verify-records", type=int, default=100_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        base = Path(folder)
        a_rates, b_rates = [], []
        for r in range(args.rounds):  # interleaved: drift hits both alike
            a_rates.append(unsigned(base / f"u{r}.db", args.records))
            b_rates.append(signed(base / f"s{r}.db", base / "key", args.records))
    a, b = statistics.median(a_rates), statistics.median(b_rates)
    print(f"{args.records} records, one durable transaction each (median of {args.rounds}):")
    print(f"  (a) unsigned inserts          {a:9.0f} records/s")
    print(f"  (b) signed, chained, durable  {b:9.0f} records/s   (b)/(a) = {b / a:.2f}")
    print(f"the log's chain step: {chain_cost(100_000):.2f} us per record")
    with tempfile.TemporaryDirectory() as folder:
        head, full = verification(Path(folder) / "v.db", Path(folder) / "key", args.verify_records)
    print(f"verify {args.verify_records} records against a checkpoint: {head:9.0f} records/s")
    print(f"verify them without one (every signature): {full:9.0f} records/s")
    median, p99 = reconcile_cost(100_000)
    print(f"reconcile per step: median {median:.2f} us, p99 {p99:.2f} us")


if __name__ == "__main__":
    main()
