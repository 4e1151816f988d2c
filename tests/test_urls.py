"""URL validation and credential redaction: pure logic."""

from __future__ import annotations

import pytest

from celery_mongolock import ConfigurationError
from celery_mongolock.core.urls import redact, validate_mongo_url


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


@pytest.mark.parametrize(
    ("url", "ours"),
    [
        ("mongodb://h/?retryWrits=true", "unknown option 'retryWrits' (did you mean 'retryWrites'?)"),
        ("mongodb://h/?tls=maybe", "option 'tls' has a bad value 'maybe'"),
        ("mongodb://h:99999", "port '99999' of host 'h:99999' is not a number from 1 to 65535"),
        ("mongodb://h/bad$db", "the database name 'bad$db' after the hosts holds '$'"),
    ],
)
def test_the_reason_is_ours_whatever_pymongo_says(
    url: str, ours: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """pymongo's wording changes between its releases (4.20.1 stopped naming an unknown option): our
    message names the offending part itself, and pymongo's text, whatever it is, is only detail."""
    from pymongo import uri_parser

    def refuse(*args: object, **kwargs: object) -> None:
        raise ValueError("something pymongo said this month")

    for name in ("split_options", "parse_uri"):
        monkeypatch.setattr(uri_parser, name, refuse)
    with pytest.raises(ConfigurationError) as info:
        validate_mongo_url(url, setting="mongolock_url")
    assert ours in str(info.value)
    assert str(info.value).startswith(f"mongolock_url {url!r} is not a valid MongoDB URL: ")


def test_a_password_with_an_unescaped_character_is_never_echoed() -> None:
    for url in ["mongodb://u:pa?ss=hunter2@h", "mongodb://u:pa/hunter2@h", "mongodb://u:hunter2@x@h"]:
        with pytest.raises(ConfigurationError) as info:
            validate_mongo_url(url, setting="mongolock_url")
        assert "hunter2" not in str(info.value), str(info.value)
