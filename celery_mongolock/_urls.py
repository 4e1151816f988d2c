"""MongoDB URL helpers: validation and credential redaction (private)."""

from __future__ import annotations

import re

from .exceptions import ConfigurationError

__all__ = ["redact", "validate_mongo_url"]

# scheme://user:password@host: everything from "://" to the *last* "@" of the URL is credentials (an
# unescaped password may itself contain "@", "/", "?" or "#", which is exactly when users see errors).
_CREDENTIALS = re.compile(r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*://)(?P<cred>[^\s'\"]*)@")
_QUERY_SECRETS = re.compile(
    r"(?P<name>(?:password|tlsCertificateKeyFilePassword|authMechanismProperties)=)[^&#\s'\"]*", re.IGNORECASE
)


_URL_START = re.compile(r"\s*[a-zA-Z][a-zA-Z0-9+.-]*://")


def redact(text: str) -> str:
    """Return ``text`` with every ``user:password@`` in URLs (and password query options) masked."""
    start = _URL_START.match(text)
    if start is not None and "@" in text[start.end() :]:
        # The text is a URL: everything from "://" to its last "@" is credentials, whatever the password
        # holds (pymongo accepts unescaped quotes and spaces, where the pattern for free text stops).
        text = f"{start.group(0)}***@{text.rsplit('@', 1)[1]}"
    else:
        text = _CREDENTIALS.sub(lambda m: f"{m.group('scheme')}***@", text)
    return _QUERY_SECRETS.sub(lambda m: f"{m.group('name')}***", text)


def validate_mongo_url(url: object, setting: str = "MongoDB URL") -> str:
    """Check that ``url`` parses as a MongoDB connection string; raise ``ConfigurationError`` if not."""
    if not isinstance(url, str):
        raise ConfigurationError(
            f"{setting} must be a string such as 'mongodb://host:27017', got {type(url).__name__}"
        )
    if not url.strip():
        raise ConfigurationError(f"{setting} is empty; expected something like 'mongodb://host:27017'")
    if url != url.strip():
        raise ConfigurationError(
            f"{setting} {redact(url)!r} has leading or trailing whitespace (a stray newline from an "
            "environment file?): remove it"
        )
    from pymongo.errors import ConfigurationError as PyMongoConfigurationError
    from pymongo.errors import InvalidURI
    from pymongo.uri_parser import parse_uri

    try:
        if url.startswith("mongodb+srv://"):
            # Never resolve SRV records here (validation must not touch the network): check the URL's
            # form and options with pymongo's parser minus the DNS lookup, where this pymongo has it.
            try:
                from pymongo.uri_parser_shared import _validate_uri
            except ImportError:  # pragma: no cover - other pymongo versions
                pass
            else:
                _validate_uri(url, validate=True)
        else:
            parse_uri(url, validate=True)
    except (InvalidURI, PyMongoConfigurationError, ValueError, TypeError) as exc:
        raise ConfigurationError(
            f"{setting} {redact(url)!r} is not a valid MongoDB URL: {redact(str(exc))}"
        ) from None
    except OSError as exc:  # a file the URL names (tlsCAFile, tlsCertificateKeyFile) cannot be read
        raise ConfigurationError(
            f"{setting} {redact(url)!r} names a file that cannot be read: {redact(str(exc))}"
        ) from None
    if not (url.startswith("mongodb://") or url.startswith("mongodb+srv://")):
        raise ConfigurationError(f"{setting} {redact(url)!r} must start with mongodb:// or mongodb+srv://")
    return url
