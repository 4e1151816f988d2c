"""Security: MongoDB authentication and TLS work, credentials never leak, only the owner renews or releases.

Real servers only: the embedded MongoDB-compatible server started with ``--auth`` (a user created the way
its docs say: connect once without auth, ``createUser``, restart with ``--auth``) and with TLS (a CA and
a server certificate made here with the ``openssl`` binary), a real Redis and real ``celery worker``
processes. The password has the characters that break naive URL handling and redaction.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote, quote_plus

import pytest
from celery.app.utils import filter_hidden_settings
from pymongo import MongoClient

from celery_mongolock import ConfigurationError, LeaseLost, LeaseStore, LockContended, StoreUnavailable
from celery_mongolock.config import read_settings
from celery_mongolock.embedded import EmbeddedMongo
from celery_mongolock.store import Lease

from . import integration_app as it
from .servers import RedisServer, wait_for
from .workers import ROOT, Worker, worker_env

USER = "lease-user"
PASSWORD = "p@ss:w/rd%"
WRONG_PASSWORD = "wr0ng:p@ss/%"
DB = "mongolock_security"
# Our words for MongoDB's refusals (the server's and pymongo's own differ between servers and releases).
REFUSED_LOGIN = "it did not accept the user name and password"
UNTRUSTED_CERTIFICATE = "its TLS certificate was not trusted"
QUEUE = "mongolock_security"


def secrets(password: str = PASSWORD) -> list[str]:
    """Every spelling of a password that must never be shown: as is, and URL-escaped both ways."""
    return [password, quote_plus(password), quote(password, safe="")]


def assert_no_secret(text: str, *passwords: str) -> None:
    for password in passwords or (PASSWORD, WRONG_PASSWORD):
        for spelling in secrets(password):
            assert spelling not in text, f"credential {spelling!r} leaked into: {text[:2000]}"


def auth_url(server: EmbeddedMongo, password: str = PASSWORD, user: str = USER) -> str:
    return (
        f"mongodb://{quote_plus(user)}:{quote_plus(password)}@{server.host}:{server.port}/"
        "?authSource=admin&directConnection=true"
    )


def start_with_auth(server: EmbeddedMongo, roles: list[dict[str, str]]) -> EmbeddedMongo:
    """Create the users on a server without auth, then restart it with ``--auth`` (SecantusDB's way)."""
    server.start()
    client: MongoClient[dict[str, Any]] = MongoClient(server.url)
    try:
        client.admin.command("createUser", USER, pwd=PASSWORD, roles=roles)
        client.admin.command("createUser", "no-rights", pwd=PASSWORD, roles=[])
    finally:
        client.close()
    server.stop()
    server.auth = True
    return server.start()


@pytest.fixture(scope="module")
def auth_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedMongo]:
    server = EmbeddedMongo(storage_path=tmp_path_factory.mktemp("auth-data"))
    try:
        yield start_with_auth(server, [{"role": "readWrite", "db": DB}])
    finally:
        server.stop()


@pytest.fixture
def db_client(auth_server: EmbeddedMongo) -> Iterator[Any]:
    client: MongoClient[dict[str, Any]] = MongoClient(auth_url(auth_server))
    yield client[DB]
    client[DB]["leases"].delete_many({})
    client.close()


# -- authentication ----------------------------------------------------------------------------------------


def test_lease_store_works_with_a_user_and_password(auth_server: EmbeddedMongo, db_client: Any) -> None:
    store = LeaseStore(auth_url(auth_server), database=DB, operation_timeout=10)
    try:
        lease = store.acquire("sec:auth", ttl=10, heartbeat=True)
        assert lease is not None
        assert store.acquire("sec:auth") is None  # contention, as without auth
        info = store.inspect("sec:auth")
        assert info is not None and info.held and info.owner == lease.owner
        assert [i.key for i in store.list(prefix="sec:")] == ["sec:auth"]
        lease.renew()
        assert lease.release() is True
        assert store.force_release("sec:auth") is False
        assert db_client["leases"].count_documents({"_id": "sec:auth"}) == 1
        assert store.url is not None and store.url.startswith("mongodb://***@")
        assert_no_secret(f"{store.url} {store!r} {lease!r}")
    finally:
        store.close()


@pytest.mark.parametrize(
    ("make_url", "match"),
    [
        pytest.param(lambda s: auth_url(s, WRONG_PASSWORD), REFUSED_LOGIN, id="wrong-password"),
        pytest.param(lambda s: auth_url(s, PASSWORD, "nobody"), REFUSED_LOGIN, id="unknown-user"),
        pytest.param(lambda s: s.url, "it requires a user name and password, and the URL gives none", id="no-credentials"),  # noqa: E501
        pytest.param(lambda s: auth_url(s, PASSWORD, "no-rights"), f"needs the readWrite role on database '{DB}'", id="user-without-rights"),  # noqa: E501
    ],
)  # fmt: skip
def test_refused_credentials_fail_closed_without_leaking(
    auth_server: EmbeddedMongo, make_url: Any, match: str
) -> None:
    """Said in our words (the server's own message differs between servers and releases)."""
    operations: dict[str, Callable[[LeaseStore], object]] = {
        "acquire": lambda store: store.acquire("sec:refused"),
        "inspect": lambda store: store.inspect("sec:refused"),
        "list": lambda store: store.list(),
        "force_release": lambda store: store.force_release("sec:refused"),
    }
    for name, operation in operations.items():
        # A fresh store (a fresh process's view) for each: after one refusal pymongo keeps re-selecting
        # the server until the operation's deadline, then reports the refusal inside a timeout error.
        store = LeaseStore(make_url(auth_server), database=DB, operation_timeout=3)
        try:
            with pytest.raises(StoreUnavailable, match=match) as info:
                operation(store)
            assert f"{DB}.leases" in str(info.value), name  # says which store refused
            assert_no_secret(f"{info.value} {info.value!r} {store!r} {store.url}")
            with pytest.raises(StoreUnavailable) as again:  # still closed on the next call
                operation(store)
            assert_no_secret(f"{again.value} {again.value!r}")
        finally:
            store.close()


def test_bad_urls_never_show_the_password() -> None:
    escaped = quote_plus(PASSWORD)
    for url in [
        f"mongodb://{USER}:{escaped}@h:99999/",  # invalid port
        f"mongodb://{USER}:{escaped}@h/?bogusOption=1",
        f"mongodb://{USER}:{PASSWORD}@h/",  # not escaped
        f"mongodb://{USER}:{escaped}@h/\n",  # stray newline
        f"mongodb+srv://{USER}:{escaped}@h:27017/",  # SRV with a port
        f"mongodb://{USER}:{escaped}@h/?tls=true&tlsCAFile=/nonexistent/ca.pem",
    ]:
        with pytest.raises(ConfigurationError) as info:
            LeaseStore(url)
        assert_no_secret(f"{info.value} {info.value!r}")
        with pytest.raises(ConfigurationError, match="mongolock_url") as info:
            read_settings({"mongolock_url": url})
        assert_no_secret(f"{info.value} {info.value!r}")
    # Valid URLs whose password pymongo accepts unescaped (quotes, spaces) are masked whole.
    for password in ["it's", 'say "x"', "with space"]:
        store = LeaseStore(f"mongodb://{USER}:{password}@h:1/")
        assert store.url == "mongodb://***@h:1/"
        assert password not in repr(store)


# -- real workers and the command line with authentication ------------------------------------------------


@pytest.fixture(scope="module")
def celery_app(redis_server: RedisServer) -> Iterator[Any]:
    """The integration app pointed at the Redis broker; its settings put back afterwards."""
    keys = ("broker_url", "result_backend", "mongolock_url", "mongolock_database", "mongolock_lease_seconds")
    saved = {k: it.app.conf.get(k) for k in keys}
    it.app.conf.update(broker_url=redis_server.url, result_backend=redis_server.url)
    yield it.app
    it.app.conf.update(saved)
    for attr in ("_mongolock_settings", "_mongolock_store"):
        it.app.__dict__.pop(attr, None)


def start_worker(env: dict[str, str], ready_dir: Path) -> Worker:
    return Worker(env, ready_dir, concurrency=2, extra_args=["-Q", QUEUE]).start(timeout=120)


@pytest.mark.slow
def test_singleton_tasks_run_in_a_real_worker_with_authentication(
    auth_server: EmbeddedMongo, db_client: Any, celery_app: Any, redis_server: RedisServer, tmp_path: Path
) -> None:
    worker = start_worker(
        worker_env(redis_server.url, auth_url(auth_server), DB, tmp_path, lease=3.0), tmp_path
    )
    try:
        resource, tags = uuid.uuid4().hex[:8], [uuid.uuid4().hex[:8] for _ in range(3)]
        results = [it.guarded.apply_async((resource, t, 0.3), queue=QUEUE) for t in tags]
        assert [r.get(timeout=120) for r in results] == tags
        spans = sorted(
            (
                db_client["runs"].find_one({"tag": t, "kind": "start"})["mono"],
                db_client["runs"].find_one({"tag": t, "kind": "end"})["mono"],
            )
            for t in tags
        )
        assert all(end <= nxt for (_, end), (nxt, _) in itertools.pairwise(spans)), spans
    finally:
        worker.stop()
    log = worker.log_path.read_text(errors="replace")
    assert f"leases in mongodb://***@{auth_server.host}:{auth_server.port}/" in log
    assert_no_secret(log)


@pytest.mark.slow
def test_a_worker_with_a_wrong_password_fails_closed_and_never_logs_it(
    auth_server: EmbeddedMongo, celery_app: Any, redis_server: RedisServer, tmp_path: Path
) -> None:
    env = worker_env(redis_server.url, auth_url(auth_server, WRONG_PASSWORD), DB, tmp_path, lease=3.0)
    worker = start_worker(env, tmp_path)  # starts, and warns at once that the store refuses it
    try:
        result = it.failer.apply_async((uuid.uuid4().hex[:8], "never-runs"), queue=QUEUE)
        wait_for(result.ready, timeout=120, message="the run to fail closed")
        assert result.failed()
        # The body never ran: the store refused before it (the error is ours, not the body's).
        assert type(result.result).__name__ == "StoreUnavailable", repr(result.result)
        assert REFUSED_LOGIN in str(result.result)
        assert_no_secret(f"{result.result} {result.result!r} {result.traceback}")
    finally:
        worker.stop()
    log = worker.log_path.read_text(errors="replace")
    assert "does not answer" in log and REFUSED_LOGIN in log
    assert_no_secret(log)


def run_cli(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "celery", "-A", "tests.integration_app", "mongolock", *args],
        cwd=ROOT,
        env={
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "MONGOLOCK_IT_MONGODB_URL": url,
            "MONGOLOCK_IT_DB": DB,
            "MONGOLOCK_IT_OP_TIMEOUT": "5",
        },
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )


def test_the_command_line_works_with_authentication_and_never_prints_the_password(
    auth_server: EmbeddedMongo, db_client: Any
) -> None:
    url = auth_url(auth_server)
    with LeaseStore(url, database=DB) as store:
        lease = store.acquire("sec:cli", ttl=60, info={"task_name": "upload", "task_id": "t-1"})
        assert lease is not None
        listed = run_cli(url, "list")
        assert listed.returncode == 0, listed.stderr
        assert "sec:cli" in listed.stdout and "upload[t-1]" in listed.stdout
        as_json = run_cli(url, "list", "--json", "--all")
        assert as_json.returncode == 0, as_json.stderr
        assert [d["key"] for d in json.loads(as_json.stdout)] == ["sec:cli"]
        inspected = run_cli(url, "inspect", "sec:cli", "--json")
        assert json.loads(inspected.stdout)["owner"] == lease.owner
        watched = run_cli(url, "watch", "--count", "1")
        assert f"held on mongodb://***@{auth_server.host}:{auth_server.port}/" in watched.stdout
        refused = run_cli(auth_url(auth_server, WRONG_PASSWORD), "list", "--json")
        assert refused.returncode != 0 and REFUSED_LOGIN in refused.stderr
        # Celery's own commands that print settings (`celery report`, `celery inspect conf`) mask it too.
        report = subprocess.run(
            [sys.executable, "-m", "celery", "-A", "tests.integration_app", "report"],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT), "MONGOLOCK_IT_MONGODB_URL": url},
            capture_output=True,
            text=True,
            timeout=180,
            check=False,
        )
        assert report.returncode == 0 and "mongolock_url: '********'" in report.stdout, report.stderr
        assert filter_hidden_settings({"mongolock_url": url}) == {"mongolock_url": "********"}
        for out in (listed, as_json, inspected, watched, refused, report):
            assert_no_secret(out.stdout + out.stderr)


# -- TLS ---------------------------------------------------------------------------------------------------


def openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=120)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A self-signed CA, a server certificate it signed (for 127.0.0.1), and an unrelated CA."""
    if shutil.which("openssl") is None:  # the venv has no `cryptography`: the openssl binary makes them
        pytest.skip("needs the openssl binary to make test certificates (the venv has no `cryptography`)")
    d = tmp_path_factory.mktemp("tls")
    subj = ("-days", "2", "-nodes", "-newkey", "rsa:2048")
    openssl("req", "-x509", *subj, "-keyout", "ca.key", "-out", "ca.pem", "-subj", "/CN=test CA", cwd=d)
    openssl("req", "-x509", *subj, "-keyout", "other.key", "-out", "other.pem", "-subj", "/CN=other", cwd=d)
    openssl("req", *subj[2:], "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=localhost", cwd=d)
    (d / "ext.cnf").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\nbasicConstraints=CA:FALSE\n")
    openssl(
        "x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
        "-out", "server.pem", "-days", "2", "-extfile", "ext.cnf", cwd=d,
    )  # fmt: skip
    paths = {name: str(d / f"{name}.pem") for name in ("ca", "other", "server")}
    return {**paths, "key": str(d / "server.key")}


def tls_server(certs: dict[str, str], **kwargs: Any) -> EmbeddedMongo:
    return EmbeddedMongo(
        extra_args=["--tls-cert-file", certs["server"], "--tls-key-file", certs["key"]],
        url_options={"tls": "true", "tlsCAFile": certs["ca"]},
        **kwargs,
    )


def test_tls_connections_work_and_unverified_ones_fail_closed(certs: dict[str, str]) -> None:
    with tls_server(certs) as server:
        assert "tls=true" in server.url
        with LeaseStore(server.url, database=DB, operation_timeout=10) as store:
            lease = store.acquire("sec:tls", ttl=10)
            assert lease is not None and lease.release()
        base = f"mongodb://{server.host}:{server.port}/?directConnection=true"
        for url, match in [
            (base, "did not answer"),  # plaintext to a TLS server
            (f"{base}&tls=true", UNTRUSTED_CERTIFICATE),  # the system CAs do not know ours
            (f"{base}&tls=true&tlsCAFile={certs['other']}", UNTRUSTED_CERTIFICATE),
        ]:
            with (
                LeaseStore(url, database=DB, operation_timeout=2) as store,
                pytest.raises(StoreUnavailable, match=match),
            ):
                store.acquire("sec:tls")


def test_tls_and_authentication_together(certs: dict[str, str], tmp_path: Path) -> None:
    server = tls_server(certs, storage_path=tmp_path / "data")
    try:
        start_with_auth(server, [{"role": "readWrite", "db": DB}])
        url = f"{auth_url(server)}&tls=true&tlsCAFile={quote(certs['ca'], safe='/')}"
        with LeaseStore(url, database=DB, operation_timeout=10) as store:
            lease = store.acquire("sec:tls-auth", ttl=10)
            assert lease is not None and lease.release()
            assert_no_secret(f"{store!r} {store.url}")
        wrong = url.replace(quote_plus(PASSWORD), quote_plus(WRONG_PASSWORD))
        with (
            LeaseStore(wrong, database=DB, operation_timeout=5) as store,
            pytest.raises(StoreUnavailable, match=REFUSED_LOGIN) as info,
        ):
            store.acquire("sec:tls-auth")
        assert_no_secret(f"{info.value} {info.value!r}")
    finally:
        server.stop()


# -- only the owner renews or releases; force-release is explicit ------------------------------------------
# (test_store_contract.py covers a stale Lease of an earlier acquisition, a holder whose lease expired
# and was taken over, a forked child, and the holder learning of a force-release; test_cli.py covers
# `release` refusing without --force. What follows covers forged tokens and other holders' tools.)


def forged(store: LeaseStore, key: str, owner: str) -> Lease:
    """A Lease object for ``key`` made up by someone who does not hold it."""
    return Lease(
        store, key, owner, fence=2**62, ttl=10, heartbeat_seconds=1, expires_at=None,
        sent_at=store.clock.monotonic(), holder={},
    )  # fmt: skip


@pytest.mark.parametrize(
    "token",
    [
        pytest.param(uuid.uuid4().hex, id="guessed-token"),
        pytest.param("", id="empty-token"),
        pytest.param(None, id="null-token"),
    ],
)
def test_a_lease_with_a_forged_owner_token_cannot_renew_or_release(make_store: Any, token: Any) -> None:
    holder_store, other_store = make_store(lease_seconds=10), make_store(lease_seconds=10)
    lease = holder_store.acquire("sec:owner")
    assert lease is not None
    before = holder_store.inspect("sec:owner")
    impostor = forged(other_store, "sec:owner", token)
    with pytest.raises(LeaseLost):
        impostor.renew()
    assert forged(other_store, "sec:owner", token).release() is False
    assert other_store.renew_many([forged(other_store, "sec:owner", token)]) != []  # found lost, not renewed
    after = holder_store.inspect("sec:owner")
    assert after is not None and before is not None
    assert after.held and after.owner == lease.owner
    assert (after.fence, after.expires_at) == (before.fence, before.expires_at)
    lease.renew()  # the real holder is unaffected
    assert lease.release() is True


def test_contending_and_supervisor_calls_leave_another_holders_lease_alone(make_store: Any) -> None:
    holder_store, other_store = make_store(lease_seconds=10), make_store(lease_seconds=10)
    lease = holder_store.acquire("sec:alone", info={"task_id": "t-1"})
    assert lease is not None
    before = holder_store.inspect("sec:alone")
    assert other_store.acquire("sec:alone") is None
    with pytest.raises(LockContended, match="is held by"), other_store.hold("sec:alone", wait=0):
        pass
    assert other_store.release_held_by(task_id="t-2") == 0  # only the matching holder's leases
    assert other_store.release_held_by(task_id="t-1", pid=-1) == 0
    after = holder_store.inspect("sec:alone")
    assert after is not None and before is not None
    assert (after.owner, after.fence, after.expires_at) == (lease.owner, before.fence, before.expires_at)
    assert other_store.force_release("sec:alone") is True  # the one explicit way, by its own name
    with pytest.raises(LeaseLost):
        lease.renew()
