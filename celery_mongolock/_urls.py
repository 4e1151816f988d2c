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


def redact(text: str) -> str:
    """Return ``text`` with every ``user:password@`` in URLs (and password query options) masked."""
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
    from pymongo.errors import ConfigurationError as PyMongoConfigurationError
    from pymongo.errors import InvalidURI
    from pymongo.uri_parser import parse_uri

    try:
        # Never resolve SRV records here: validation must not touch the network.
        if not url.startswith("mongodb+srv://"):
            parse_uri(url, validate=True)
    except (InvalidURI, PyMongoConfigurationError, ValueError) as exc:
        raise ConfigurationError(
            f"{setting} {redact(url)!r} is not a valid MongoDB URL: {redact(str(exc))}"
        ) from None
    if not (url.startswith("mongodb://") or url.startswith("mongodb+srv://")):
        raise ConfigurationError(f"{setting} {redact(url)!r} must start with mongodb:// or mongodb+srv://")
    return url
