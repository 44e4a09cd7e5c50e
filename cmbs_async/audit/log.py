"""The audit trail as one append-only log over every session, and its signed checkpoints.

Each session's records are chained and signed on their own; the log adds what lies
between sessions. Every record, of whatever session, takes the next position in one
sequence, and the log's root after ``n`` records is a hash chain over their hashes in
that order (``root_n = SHA-256(root_{n-1} || hash_n)``), in the manner of a transparency
log's signed tree head (RFC 9162), with a chain in place of the Merkle tree.

A checkpoint is ``{size, root, time, key_id, public_key}`` signed with the operator's
key. Kept elsewhere, it proves later that the database still holds exactly the first
``size`` records it covered, in order, plus whatever came after: a deleted session, a
cut tail, an emptied or truncated file, a rewritten prefix all change the root.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterable, Mapping
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from .._reading import json_depth_error
from .signing import canonical, load_public_key, public_key_text, sign, verify_signature
from .store import AuditError

__all__ = [
    "CHECKPOINT_MAX_BYTES",
    "CHECKPOINT_MAX_DEPTH",
    "GENESIS",
    "CheckpointError",
    "chain",
    "key_id",
    "make_checkpoint",
    "read_checkpoint",
]

#: The root of the empty log (and the ``prev`` of a session's first record).
GENESIS = "0" * 64
_FIELDS = ("size", "root", "time", "key_id", "public_key")
#: A checkpoint is one flat object: what nests deeper than this is not one.
CHECKPOINT_MAX_DEPTH = 8
#: ... and it is a few hundred bytes: the cap for reading a checkpoint file.
CHECKPOINT_MAX_BYTES = 64 * 1024


class CheckpointError(AuditError):
    """A checkpoint file that is not one, or whose signature does not hold."""


def chain(root: str, hashes: Iterable[str]) -> str:
    """The log's root after appending records with ``hashes`` to a log at ``root``."""
    for record_hash in hashes:
        root = hashlib.sha256((root + record_hash).encode()).hexdigest()
    return root


def key_id(public_key: str) -> str:
    """A short name for a public key: the first 16 hex digits of its SHA-256."""
    return hashlib.sha256(public_key.encode()).hexdigest()[:16]


def make_checkpoint(key: Ed25519PrivateKey, size: int, root: str) -> dict[str, Any]:
    """The log's state, signed: what ``cmbs audit head`` prints."""
    public = public_key_text(key)
    body = {
        "size": size,
        "root": root,
        "time": round(time.time(), 3),
        "key_id": key_id(public),
        "public_key": public,
    }
    return body | {"signature": sign(key, canonical(body))}


def read_checkpoint(text: str | object, *, trusted_key: str | None = None) -> dict[str, Any]:
    """A checkpoint from its JSON text (or that text already parsed, as
    :func:`cmbs_async._reading.read_json` reads a file), its signature checked (and its
    key, if trusted). Text nested deeper than a checkpoint can be is refused unparsed."""
    data = text
    if isinstance(text, str):
        if json_depth_error(text, CHECKPOINT_MAX_DEPTH):
            raise CheckpointError(f"not a checkpoint (nested deeper than {CHECKPOINT_MAX_DEPTH})")
        try:
            data = json.loads(text)
        except ValueError:
            raise CheckpointError("not a checkpoint (not JSON)") from None
    if not isinstance(data, Mapping) or any(name not in data for name in (*_FIELDS, "signature")):
        raise CheckpointError(f"not a checkpoint (it needs {', '.join(_FIELDS)} and a signature)")
    body = {name: data[name] for name in _FIELDS}
    size = body["size"]
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise CheckpointError("not a checkpoint (its size is not a count)")
    if not all(isinstance(data[name], str) for name in ("root", "public_key", "signature")):
        raise CheckpointError("not a checkpoint (root, public_key and signature are text)")
    if trusted_key is not None and body["public_key"] != trusted_key:
        raise CheckpointError("the checkpoint is signed by a key other than the trusted one")
    try:
        public = load_public_key(str(body["public_key"]))
    except ValueError:
        raise CheckpointError("the checkpoint's public key is not valid") from None
    if not verify_signature(public, str(data["signature"]), canonical(body)):
        raise CheckpointError("the checkpoint's signature is bad: edited or forged")
    return dict(data)


def log_head_bytes(size: int, root: str) -> bytes:
    """What the database's own signed log head covers."""
    return canonical({"log": "cmbs-audit", "size": size, "root": root})
