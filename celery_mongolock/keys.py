"""Lease keys: validation and normalisation.

A lease key is the ``_id`` of one lease document. Keys are text; the key a caller passes is the key
stored, unless it is longer than ``MAX_KEY_BYTES`` (UTF-8), in which case it is shortened to a readable
prefix plus a SHA-256 of the whole key, so that every distinct key still maps to a distinct lease.
"""

from __future__ import annotations

import hashlib

from .exceptions import InvalidKey

__all__ = ["MAX_KEY_BYTES", "normalize_key"]

#: Keys longer than this (in UTF-8 bytes) are stored as ``<prefix>~sha256:<hex>``.
MAX_KEY_BYTES = 200
_PREFIX_CHARS = 120


def normalize_key(key: object) -> str:
    """Return the lease key stored for ``key``; raise ``InvalidKey`` naming the problem."""
    if not isinstance(key, str):
        raise InvalidKey(f"lease key must be a str, got {type(key).__name__}: {key!r:.80}")
    if not key:
        raise InvalidKey("lease key must not be empty")
    if not key.strip():
        raise InvalidKey(f"lease key must not be only whitespace: {key!r}")
    if "\x00" in key:
        raise InvalidKey(f"lease key must not contain NUL characters: {key!r:.80}")
    try:
        encoded = key.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidKey(f"lease key is not valid Unicode text ({exc.reason}): {key!r:.80}") from None
    if len(encoded) <= MAX_KEY_BYTES:
        return key
    digest = hashlib.sha256(encoded).hexdigest()
    return f"{key[:_PREFIX_CHARS]}~sha256:{digest}"
