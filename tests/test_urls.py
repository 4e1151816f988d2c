"""URL validation and credential redaction: pure logic."""

from __future__ import annotations

import pytest

from celery_mongolock import ConfigurationError
from celery_mongolock._urls import redact, validate_mongo_url


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("mongodb://user:pa55@host:27017/db", "mongodb://***@host:27017/db"),
        ("mongodb+srv://user:pa55@cluster.example.com", "mongodb+srv://***@cluster.example.com"),
        ("mongodb://user@host", "mongodb://***@host"),
        ("mongodb://host/?password=pa55&tls=true", "mongodb://host/?password=***&tls=true"),
        ("error talking to mongodb://u:pa55@h:1: refused", "error talking to mongodb://***@h:1: refused"),
        ("mongodb://host:27017", "mongodb://host:27017"),
    ],
)
def test_redact(text: str, expected: str) -> None:
    assert redact(text) == expected
    assert "pa55" not in redact(text)


def test_valid_urls_pass() -> None:
    for url in [
        "mongodb://localhost",
        "mongodb://a:1,b:2/?replicaSet=rs0",
        "mongodb://u:p@h/db?authSource=admin",
    ]:
        assert validate_mongo_url(url) == url


@pytest.mark.parametrize("url", ["", "   ", "localhost:27017", "redis://x", "mongodb://h:notaport", 17])
def test_invalid_urls(url: object) -> None:
    with pytest.raises(ConfigurationError):
        validate_mongo_url(url, setting="mongolock_url")


def test_error_names_the_setting_and_hides_the_password() -> None:
    with pytest.raises(ConfigurationError, match="mongolock_url") as info:
        validate_mongo_url("mongodb://bob:hunter2@h:notaport", setting="mongolock_url")
    assert "hunter2" not in str(info.value)


@pytest.mark.parametrize(
    "url",
    [
        "mongodb://user:p#ss@host/db",
        "mongodb://u:a/b?c@d@host:1/x",
        "mongodb://u:p@ss@host",
        "x mongodb://u:pa55@h y",
    ],
)
def test_redact_passwords_with_unescaped_characters(url: str) -> None:
    out = redact(url)
    assert "***@" in out
    for secret in ("p#ss", "a/b?c", "p@ss", "pa55"):
        assert secret not in out
