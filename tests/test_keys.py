"""Key normalisation: pure logic, no server."""

from __future__ import annotations

import pytest

from celery_mongolock import InvalidKey
from celery_mongolock.keys import MAX_KEY_BYTES, normalize_key


@pytest.mark.parametrize("key", ["email-group:42", "a", "grüße", "键" * 60, "x" * MAX_KEY_BYTES])
def test_short_keys_are_kept_as_is(key: str) -> None:
    assert normalize_key(key) == key


def test_long_keys_are_hashed_with_a_readable_prefix() -> None:
    key = "tenant:" + "x" * 1000
    out = normalize_key(key)
    assert out.startswith("tenant:xxxx")
    assert "~sha256:" in out
    assert len(out.encode()) <= MAX_KEY_BYTES
    assert normalize_key(key) == out  # deterministic
    assert normalize_key(key + "y") != out


def test_multibyte_keys_are_measured_in_bytes() -> None:
    key = "键" * 100  # 300 bytes
    assert "~sha256:" in normalize_key(key)


@pytest.mark.parametrize(
    ("key", "match"),
    [
        ("", "must not be empty"),
        ("   ", "only whitespace"),
        ("a\x00b", "NUL"),
        ("\ud800", "not valid Unicode"),
        (42, "must be a str, got int"),
        (None, "must be a str, got NoneType"),
        (b"bytes", "must be a str, got bytes"),
    ],
)
def test_bad_keys(key: object, match: str) -> None:
    with pytest.raises(InvalidKey, match=match):
        normalize_key(key)


def test_invalid_key_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="empty"):
        normalize_key("")
