"""The tamper-evident audit trail: signed, hash-chained records in SQLite, and replay."""

from .replay import ReplayReport, replay
from .signing import SigningKeyError, default_data_dir, load_or_create_key, public_key_text
from .sqlite import AuditError, SQLiteAuditStore, VerifyReport
from .store import AuditRecord, AuditStore, StepHistory
from .writer import AuditWriter, open_audit_writer

__all__ = [
    "AuditError",
    "AuditRecord",
    "AuditStore",
    "AuditWriter",
    "ReplayReport",
    "SQLiteAuditStore",
    "SigningKeyError",
    "StepHistory",
    "VerifyReport",
    "default_data_dir",
    "load_or_create_key",
    "open_audit_writer",
    "public_key_text",
    "replay",
]
