"""The tamper-evident audit trail: signed, hash-chained records in SQLite.

Storage only: it knows records, not the gate or the review layer that fill them
(:mod:`cmbs_async.records` builds a run's records; :func:`cmbs_async.replay` reads them).
"""

from .log import CheckpointError
from .memory import MemoryAuditStore
from .signing import SigningKeyError, default_data_dir, load_or_create_key, public_key_text
from .sqlite import SQLiteAuditStore, VerifyReport
from .store import AuditError, AuditRecord, AuditStore, Entry, RecordKind, StepHistory
from .writer import AuditWriter, open_audit_writer

__all__ = [
    "AuditError",
    "AuditRecord",
    "AuditStore",
    "AuditWriter",
    "CheckpointError",
    "Entry",
    "MemoryAuditStore",
    "RecordKind",
    "SQLiteAuditStore",
    "SigningKeyError",
    "StepHistory",
    "VerifyReport",
    "default_data_dir",
    "load_or_create_key",
    "open_audit_writer",
    "public_key_text",
]
