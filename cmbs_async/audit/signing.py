"""Ed25519 signing keys and canonical JSON, for the tamper-evident audit trail."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import stat
import tempfile
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from .._errors import CmbsError

__all__ = [
    "SigningKeyError",
    "canonical",
    "default_data_dir",
    "digest",
    "load_key",
    "load_or_create_key",
    "load_public_key",
    "normal_public_key",
    "public_key_text",
    "sign",
    "verify_signature",
]


class SigningKeyError(CmbsError, ValueError):
    """A signing key that cannot be used; the message is one line."""


def default_data_dir() -> Path:
    """``$XDG_DATA_HOME/cmbs``, else ``~/.local/share/cmbs``."""
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(
        os.path.expanduser("~"), ".local", "share"
    )
    return Path(base) / "cmbs"


def canonical(value: Any) -> bytes:
    """Canonical JSON: sorted keys, no spaces, UTF-8."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def load_or_create_key(path: str | Path) -> Ed25519PrivateKey:
    """Load the key at ``path``, or create it there with mode 0600 on first use.

    Creation is race-free: the key is written whole to a temporary file and linked into
    place, so of several processes creating the same key at once one wins and all use
    its key. A key file readable by group or others is refused rather than used.
    """
    path = Path(path)
    try:
        return load_key(path)
    except FileNotFoundError:
        pass
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=".signing-key-")
        try:
            with os.fdopen(fd, "wb") as handle:  # mkstemp makes it 0600
                handle.write(pem)
                handle.flush()
                os.fsync(handle.fileno())
            os.link(temporary, path)  # fails if another process got there first
        except FileExistsError:
            return load_key(path)
        finally:
            os.unlink(temporary)
    except OSError as exc:
        raise SigningKeyError(f"cannot create signing key {path}: {exc.strerror or exc}") from None
    return key


def load_key(path: str | Path) -> Ed25519PrivateKey:
    """The existing key at ``path`` (``FileNotFoundError`` if there is none)."""
    path = Path(path)
    try:
        mode = stat.S_IMODE(path.stat().st_mode)
        if path.is_dir():
            raise SigningKeyError(f"signing key {path} is a directory")
        if mode & 0o077:
            raise SigningKeyError(f"signing key {path} has mode {mode:04o}; it must be 0600")
        pem = path.read_bytes()
    except FileNotFoundError:
        raise
    except OSError as exc:  # a path under a regular file, unreadable
        raise SigningKeyError(f"cannot read signing key {path}: {exc.strerror or exc}") from None
    try:
        loaded = serialization.load_pem_private_key(pem, password=None)
    except (ValueError, TypeError) as exc:
        raise SigningKeyError(f"signing key {path} cannot be read as a PEM private key") from exc
    if not isinstance(loaded, Ed25519PrivateKey):
        raise SigningKeyError(f"signing key {path} is not an Ed25519 key")
    return loaded


def sign(key: Ed25519PrivateKey, data: bytes) -> str:
    """``data``'s Ed25519 signature, base64."""
    return base64.b64encode(key.sign(data)).decode()


def public_key_text(key: Ed25519PrivateKey) -> str:
    raw = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return base64.b64encode(raw).decode()


def load_public_key(text: str) -> Ed25519PublicKey:
    """A base64 Ed25519 public key; ``ValueError`` for anything else."""
    try:
        return Ed25519PublicKey.from_public_bytes(base64.b64decode(text, validate=True))
    except (ValueError, TypeError) as exc:
        raise ValueError(f"invalid key {text[:60]!r}: not a base64 Ed25519 public key") from exc


def normal_public_key(text: str) -> str:
    """An Ed25519 public key given as base64 (as ``cmbs audit key`` prints it) or as a PEM
    ``PUBLIC KEY`` block, in the form the audit trail stores (base64 of the raw 32 bytes);
    ``ValueError`` for anything else."""
    text = text.strip()
    if text.startswith("-----BEGIN"):
        try:
            loaded = serialization.load_pem_public_key(text.encode())
        except (ValueError, TypeError, UnsupportedAlgorithm) as exc:
            raise ValueError("invalid key: a PEM block that is not a public key") from exc
        if not isinstance(loaded, Ed25519PublicKey):
            raise ValueError("invalid key: a PEM public key that is not an Ed25519 key")
        public = loaded
    else:
        public = load_public_key(text)
    raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return base64.b64encode(raw).decode()


def verify_signature(public: Ed25519PublicKey, signature: str, data: bytes) -> bool:
    try:
        public.verify(base64.b64decode(signature), data)
    except (InvalidSignature, ValueError):
        return False
    return True
