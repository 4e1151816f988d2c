"""MongoDB URL and client option helpers: validation, credential redaction, refusals in our words
(private)."""

from __future__ import annotations

import difflib
import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from typing import Any
from urllib.parse import unquote_plus

from celery_mongolock.exceptions import ConfigurationError

__all__ = ["describe_refusal", "redact", "validate_client_options", "validate_mongo_url"]

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


_SCHEMES = ("mongodb://", "mongodb+srv://")
_BAD_DATABASE_CHARACTERS = frozenset('/\\. "$\x00')
# The connection string options of MongoDB's URI specification, spelt as its documentation spells them
# (for "did you mean"); pymongo's own table, when it has one, adds the options of newer releases.
_SPEC_OPTIONS = (
    "appName",
    "authMechanism",
    "authMechanismProperties",
    "authSource",
    "compressors",
    "connectTimeoutMS",
    "directConnection",
    "heartbeatFrequencyMS",
    "journal",
    "loadBalanced",
    "localThresholdMS",
    "maxConnecting",
    "maxIdleTimeMS",
    "maxPoolSize",
    "maxStalenessSeconds",
    "minPoolSize",
    "proxyHost",
    "proxyPort",
    "proxyUsername",
    "proxyPassword",
    "readConcernLevel",
    "readPreference",
    "readPreferenceTags",
    "replicaSet",
    "retryReads",
    "retryWrites",
    "serverMonitoringMode",
    "serverSelectionTimeoutMS",
    "serverSelectionTryOnce",
    "socketTimeoutMS",
    "srvMaxHosts",
    "srvServiceName",
    "ssl",
    "timeoutMS",
    "tls",
    "tlsAllowInvalidCertificates",
    "tlsAllowInvalidHostnames",
    "tlsCAFile",
    "tlsCertificateKeyFile",
    "tlsCertificateKeyFilePassword",
    "tlsCRLFile",
    "tlsDisableCertificateRevocationCheck",
    "tlsDisableOCSPEndpointCheck",
    "tlsInsecure",
    "uuidRepresentation",
    "w",
    "waitQueueTimeoutMS",
    "wTimeoutMS",
    "zlibCompressionLevel",
)
_SECRET_OPTIONS = frozenset({"tlscertificatekeyfilepassword", "authmechanismproperties", "proxypassword"})


@cache
def _known_options() -> dict[str, str]:
    """Lower-cased option name -> the name to show."""
    known = {name.lower(): name for name in _SPEC_OPTIONS}
    try:
        from pymongo import common
    except ImportError:  # pragma: no cover - pymongo is a dependency
        return known
    for table in ("URI_OPTIONS_VALIDATOR_MAP", "URI_OPTIONS_ALIAS_MAP", "URI_OPTIONS_DEPRECATION_MAP"):
        for name in getattr(common, table, {}):
            known.setdefault(str(name).lower(), str(name))
    return known


def _is_secret_option(name: str) -> bool:
    return name.lower() in _SECRET_OPTIONS


def _unescaped_percent(text: str) -> bool:
    """True when a '%' of ``text`` does not start a two-hex-digit escape."""
    return re.search(r"%(?![0-9A-Fa-f]{2})", text) is not None


def validate_mongo_url(url: object, setting: str = "MongoDB URL") -> str:
    """Check that ``url`` is a MongoDB connection string; raise ``ConfigurationError`` naming what is wrong.

    The reasons are our own words, naming the part of the URL as the user wrote it (an option ``retryWrits``,
    a port ``99999``, a database ``bad$db``); pymongo's own message, whose wording changes between its
    releases, follows only as detail. Nothing here touches the network (SRV records are not resolved), and
    text that may be part of an unescaped password is never echoed.
    """
    if not isinstance(url, str):
        raise ConfigurationError(
            f"{setting} must be a string such as 'mongodb://host:27017', got {type(url).__name__}"
        )
    if not url.strip():
        raise ConfigurationError(f"{setting} is empty; expected something like 'mongodb://host:27017'")
    shown = redact(url)
    if url != url.strip():
        raise ConfigurationError(
            f"{setting} {shown!r} has leading or trailing whitespace (a stray newline from an "
            "environment file?): remove it"
        )
    try:
        parts = _split(url)
        _check_userinfo(parts)
        _check_hosts(parts)
        _check_database(parts)
        _check_options(parts)
        _check_combination(parts)
    except _Refused as refused:
        raise ConfigurationError(f"{setting} {shown!r} is not a valid MongoDB URL: {refused}") from None
    return url


class _Refused(Exception):
    """What is wrong with a URL, in our words (the caller adds the setting and the redacted URL)."""

    def __init__(self, reason: str, detail: BaseException | None = None) -> None:
        if detail is not None and str(detail):
            reason = f"{reason} (pymongo: {redact(str(detail))})"
        super().__init__(reason)


@dataclass(frozen=True)
class _Parts:
    """A connection string cut up as pymongo cuts it: options at the first '?', the database at the first
    '/' before them, credentials up to the last '@' of what is left."""

    url: str
    srv: bool
    userinfo: str | None
    hosts: str
    database: str
    options: str
    # Everything before this index may be credential text (the URL's last '@'): never echo it.
    secret_end: int

    def may_be_secret(self, text: str) -> bool:
        at = self.url.find(text)
        return self.secret_end > 0 and (at < 0 or at < self.secret_end)


#: Schemes of Celery broker and result-backend URLs (kombu's transports), told apart in the message.
_BROKER_SCHEMES = ("amqp://", "amqps://", "pyamqp://", "redis://", "rediss://", "sqs://", "sentinel://")


def _split(url: str) -> _Parts:
    scheme = next((s for s in _SCHEMES if url.startswith(s)), None)
    if scheme is None:
        if url.lower().startswith(_BROKER_SCHEMES):
            # The broker's URL given for the leases' (broker_url copied into mongolock_url).
            raise _Refused(
                "it must start with mongodb:// or mongodb+srv:// (this looks like a Celery broker's URL; "
                "the leases are kept in MongoDB)"
            )
        raise _Refused("it must start with mongodb:// or mongodb+srv://")
    rest = url[len(scheme) :]
    before_options, _, options = rest.partition("?")
    host_part, _, database = before_options.partition("/")
    userinfo: str | None = None
    if "@" in host_part:
        userinfo, _, host_part = host_part.rpartition("@")
    if not host_part:
        raise _Refused("it names no host (expected mongodb://host or mongodb://host:port)")
    return _Parts(url, scheme == "mongodb+srv://", userinfo, host_part, database, options, url.rfind("@"))


def _check_userinfo(parts: _Parts) -> None:
    info = parts.userinfo
    if info is None:
        return
    if "@" in info or info.count(":") > 1 or _unescaped_percent(info) or "/" in info:
        raise _Refused(
            "the user name or password holds a character that must be escaped ('@', ':', '/', '%'): "
            "build the URL with urllib.parse.quote_plus(password)"
        )
    if not info.partition(":")[0]:
        raise _Refused("the user name before ':' is empty")


def _check_hosts(parts: _Parts) -> None:
    hosts = parts.hosts.split(",")
    for host in hosts:
        if not host:
            raise _Refused(f"its host list {parts.hosts!r} has an empty host (a stray comma?)")
        if host.endswith(".sock") or host.startswith("["):
            continue  # a unix socket path, or an IPv6 literal: pymongo checks them in full below
        _, colon, port = host.partition(":")
        if not colon:
            continue
        if parts.srv:
            raise _Refused(f"a mongodb+srv:// URL names no port (the SRV record gives it), got {host!r}")
        if not (port.isascii() and port.isdigit() and 0 < int(port) <= 65535):
            shown = "a port" if parts.may_be_secret(host) else f"port {port!r} of host {host!r}"
            hint = " (an unescaped '?', '/' or ':' in a password?)" if parts.secret_end > 0 else ""
            raise _Refused(f"{shown} is not a number from 1 to 65535{hint}")
    if parts.srv and len(hosts) != 1:
        raise _Refused(f"a mongodb+srv:// URL names exactly one host name, got {len(hosts)}")


def _check_database(parts: _Parts) -> None:
    database = unquote_plus(parts.database).split(".", 1)[0]
    bad = sorted({c for c in database if c in _BAD_DATABASE_CHARACTERS})
    if bad:
        raise _Refused(
            f"the database name {database!r} after the hosts holds {', '.join(map(repr, bad))}; "
            'a MongoDB database name cannot hold / \\ . " $, spaces or NUL'
        )


def _check_options(parts: _Parts) -> None:
    if not parts.options:
        return
    if "&" in parts.options and ";" in parts.options:
        raise _Refused("its options mix '&' and ';' as separators: use '&'")
    seen: set[str] = set()
    for item in re.split("[&;]", parts.options):
        name, equals, value = item.partition("=")
        secret = parts.may_be_secret(item)
        if not equals or not name:
            where = "an option" if secret else f"option {item!r}"
            raise _Refused(f"{where} is not of the form name=value")
        known = _known_options()
        if name.lower() not in known:
            raise _Refused(_unknown(name, secret, known))
        if name.lower() in seen and name.lower() != "readpreferencetags":
            raise _Refused(f"option {name!r} is given twice")
        seen.add(name.lower())
        _check_option_value(name, value, secret)


def _unknown(name: str, secret: bool, known: dict[str, str]) -> str:
    if secret:
        return (
            "its options hold an unknown name; an unescaped '?' or '&' in a password makes one: "
            "build the URL with urllib.parse.quote_plus(password)"
        )
    close = difflib.get_close_matches(name.lower(), known, n=3, cutoff=0.75)
    hint = f" (did you mean {' or '.join(repr(known[c]) for c in close)}?)" if close else ""
    return f"unknown option {name!r}{hint}"


def _check_option_value(name: str, value: str, secret: bool) -> None:
    from pymongo.uri_parser import split_options

    shown = "" if secret or _is_secret_option(name) else f" {unquote_plus(value)!r}"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            split_options(f"{name}={value}")
    except OSError as exc:  # a file the option names (tlsCAFile, tlsCertificateKeyFile) cannot be read
        raise _Refused(f"option {name!r} names a file that cannot be read:{shown}", exc) from None
    except Exception as exc:  # pymongo's ValueError, InvalidURI, ConfigurationError, TypeError
        if not value:
            raise _Refused(f"option {name!r} is empty", exc) from None
        raise _Refused(f"option {name!r} has a bad value{shown}", exc) from None


def _check_combination(parts: _Parts) -> None:
    """Rules between parts (directConnection with several hosts, conflicting TLS options, ...): ours where
    we know them, else pymongo's full parse (never for mongodb+srv://, which would resolve DNS)."""
    options = {
        k.lower(): v.lower() for k, _, v in (o.partition("=") for o in re.split("[&;]", parts.options))
    }
    several_hosts = len(parts.hosts.split(",")) > 1
    if options.get("directconnection") == "true" and (parts.srv or several_hosts):
        what = "a mongodb+srv:// URL" if parts.srv else "several hosts"
        raise _Refused(f"directConnection=true connects to one server: it cannot go with {what}")
    if parts.srv:
        return
    from pymongo.uri_parser import parse_uri

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            parse_uri(parts.url, validate=True)
    except OSError as exc:
        raise _Refused("it names a file that cannot be read", exc) from None
    except Exception as exc:
        raise _Refused("its options do not go together", exc) from None


# -- MongoClient options (LeaseStore(client_options=...)) ----------------------------------------------------
# MongoClient's keyword arguments that are not connection string options.
_CLIENT_KEYWORDS = ("host", "port", "document_class", "tz_aware", "connect", "type_registry", "driver")


def validate_client_options(options: Mapping[Any, Any]) -> dict[str, Any]:
    """Check ``LeaseStore(client_options=...)`` option by option; raise ``ConfigurationError`` in our words
    (the option as written, with a did-you-mean; pymongo's own text only as detail), before any client is
    made. A secret option's value is never echoed."""
    try:
        from pymongo import common
    except ImportError:  # pragma: no cover - pymongo is a dependency
        return dict(options)
    known = dict(_known_options())
    for name in (*_CLIENT_KEYWORDS, *getattr(common, "VALIDATORS", {})):
        known.setdefault(str(name).lower(), str(name))
    validate = getattr(common, "validate", None)
    validated = {str(k).lower() for k in getattr(common, "VALIDATORS", {})}
    checked: dict[str, Any] = {}
    for name, value in options.items():
        if not isinstance(name, str) or not name:
            raise ConfigurationError(f"client_options: option names must be non-empty strings, got {name!r}")
        if name.lower() not in known:
            raise ConfigurationError(
                f"client_options: {_unknown(name, False, known)}; see pymongo.MongoClient"
            )
        if validate is not None and name.lower() in validated:
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    validate(name, value)
            except Exception as exc:  # pymongo's ValueError, TypeError or ConfigurationError
                shown = "" if _is_secret_option(name) or "password" in name.lower() else f" {value!r}"
                detail = "" if shown == "" else f" (pymongo: {redact(str(exc))})"
                raise ConfigurationError(
                    f"client_options: option {name!r} has a bad value{shown}{detail}"
                ) from None
        checked[name] = value
    return checked


# -- MongoDB's refusals, in our words ---------------------------------------------------------------------
_UNAUTHORIZED = 13
_AUTHENTICATION_FAILED = (18, 8000)  # AuthenticationFailed; Atlas's


def describe_refusal(exc: BaseException, client: Any, database: str, credentials: bool | None) -> str | None:
    """Why MongoDB refused us, in our words, when ``exc`` (or, for a server selection timeout, the error
    ``client``'s topology kept) is a refused login, a missing right or an untrusted TLS certificate; else
    None. The server's and pymongo's wording differ between servers and releases: neither is relied on."""
    import ssl

    from pymongo.errors import OperationFailure, ServerSelectionTimeoutError

    errors: list[BaseException] = [exc]
    if isinstance(exc, ServerSelectionTimeoutError) and client is not None:
        # A refusal seen while selecting a server is reported inside a timeout error; the topology keeps it.
        try:
            servers = client.topology_description.server_descriptions().values()
            errors += [s.error for s in servers if s.error is not None]
        except Exception:  # pragma: no cover - no topology to read: nothing more to say
            pass
    for error in errors:
        code = error.code if isinstance(error, OperationFailure) else None
        if code in _AUTHENTICATION_FAILED:
            return (
                f"it did not accept the user name and password (authentication failed, code {code}): a wrong "
                "password, an unknown user, or a user created in another database than authSource?"
            )
        if code == _UNAUTHORIZED:
            if credentials is False:
                return f"it requires a user name and password, and the URL gives none (code {code})"
            return (
                f"the user is not authorized for this (code {code}): it needs the readWrite role on "
                f"database {database!r}"
            )
        # pymongo keeps no cause for a failed TLS handshake: OpenSSL's reason code (an identifier, the same
        # in every OpenSSL release) names it.
        cause = error.__cause__
        if (
            isinstance(error, ssl.SSLCertVerificationError)
            or isinstance(cause, ssl.SSLCertVerificationError)
            or ("CERTIFICATE_VERIFY_FAILED" in str(error))
        ):
            return (
                "its TLS certificate was not trusted (certificate verify failed): name the CA that signed it "
                "with tlsCAFile in the URL"
            )
    return None
