"""What a handoff checks before it publishes a parked run's stored message (``_trust``): pure logic on a
Celery app, no server. The same refusals with real workers: tests/test_trust_handoff.py."""

from __future__ import annotations

import pathlib
import pickle
from typing import Any

import pytest
from celery import Celery
from kombu.serialization import dumps

from celery_mongolock import ConfigurationError, Queue, singleton_task
from celery_mongolock.config import read_settings
from celery_mongolock.integration.trust import RefusedEntry, check_entry, sign_entry

SECRET = b"0123456789abcdef-test-secret"


_APPS: dict[str, Celery] = {}


def make_app(**conf: Any) -> Celery:
    """One app per configuration (Celery warns when a task name is registered twice)."""
    ident = repr(sorted(conf.items()))
    if ident in _APPS:
        return _APPS[ident]
    app = Celery("trust", set_as_current=False)
    app.conf.update(**conf)

    queue = Queue()

    @singleton_task(
        key="resource:{resource}", app=app, name="trust.queued", on_contention=queue, shared=False
    )
    def queued(resource: str, tag: str) -> str:
        return tag

    @singleton_task(
        keys=("g:{src}", "g:{dst}"), app=app, name="trust.merge", on_contention=queue, shared=False
    )
    def merge(src: str, dst: str) -> None:
        return None

    @app.task(name="trust.plain", shared=False)
    def plain(tag: str) -> str:
        return tag

    _APPS[ident] = app
    return app


def entry_for(app: Celery, name: str, *args: Any, task_id: str = "t-1", **kwargs: Any) -> dict[str, Any]:
    """A parked entry as the library writes it: the run's signature, serialized as JSON."""
    signature = app.signature(name, args=args, kwargs=kwargs, task_id=task_id)
    content_type, encoding, body = dumps(dict(signature), serializer="json")  # type: ignore[no-untyped-call]
    return {
        "id": f"{task_id}/0",
        "t": task_id,
        "n": name,
        "m": body.encode(encoding) if isinstance(body, str) else body,
        "ct": content_type,
        "ce": encoding,
    }


def refused(app: Celery, key: str, entry: dict[str, Any], secret: bytes | None = None) -> str:
    with pytest.raises(RefusedEntry) as info:
        check_entry(app, key, entry, secret)
    return str(info.value)


def test_a_run_of_ours_is_published_with_its_own_task_id_and_arguments() -> None:
    app = make_app()
    signature = check_entry(app, "resource:r1", entry_for(app, "trust.queued", "r1", "a"), None)
    assert signature.task == "trust.queued"
    assert signature.options["task_id"] == "t-1"
    assert list(signature.args) == ["r1", "a"]


def test_a_run_of_several_keys_is_published_under_any_of_them() -> None:
    app = make_app()
    entry = {**entry_for(app, "trust.merge", "a", "b"), "ks": ["g:a", "g:b"]}
    for key in ("g:a", "g:b"):
        assert check_entry(app, key, entry, None).task == "trust.merge"


def test_an_entry_naming_a_task_that_is_not_a_singleton_task_is_refused() -> None:
    app = make_app()
    assert "'trust.plain', which is not a singleton task of this app" in refused(
        app, "resource:r1", entry_for(app, "trust.plain", "x")
    )
    # A name this worker does not have is never published here either: it is left for a worker that has
    # the task (which checks it), and refused once no worker took it up (test_unknown_task_handoff).
    assert "'os.system', a task this worker does not have" in refused(
        app, "resource:r1", {**entry_for(app, "trust.queued", "r1", "a"), "n": "os.system"}
    )


def test_an_entry_whose_arguments_render_another_key_is_refused() -> None:
    app = make_app()
    why = refused(app, "resource:r1", entry_for(app, "trust.queued", "r2", "a"))
    assert "its arguments render the key(s) ['resource:r2'], not ['resource:r1']" in why
    merge = {**entry_for(app, "trust.merge", "a", "c"), "ks": ["g:a", "g:b"]}
    assert "render the key(s)" in refused(app, "g:a", merge)
    assert "do not render the task's keys" in refused(app, "resource:r1", entry_for(app, "trust.queued"))


def test_an_entry_whose_message_names_another_task_or_task_id_is_refused() -> None:
    app = make_app()
    swapped = {**entry_for(app, "trust.plain", "resource:r1"), "n": "trust.queued"}
    assert "is not a message of task 'trust.queued'" in refused(app, "resource:r1", swapped)
    other_id = {**entry_for(app, "trust.queued", "r1", "a"), "t": "t-2"}
    assert "is for task id 't-1', not 't-2'" in refused(app, "resource:r1", other_id)


class _Touch:
    """Unpickling this creates a file: the proof that bytes from the database were unpickled."""

    def __init__(self, path: pathlib.Path) -> None:
        self.path = path

    def __reduce__(self) -> Any:
        return (pathlib.Path.touch, (self.path,))


def test_a_pickle_entry_is_never_unpickled_even_where_the_app_accepts_pickle(tmp_path: pathlib.Path) -> None:
    app = make_app(accept_content=["json", "pickle"])  # pickle from its broker; the task writes JSON
    marker = tmp_path / "unpickled"
    entry = {
        **entry_for(app, "trust.queued", "r1", "a"),
        "m": pickle.dumps(_Touch(marker)),
        "ct": "application/x-python-serialize",
        "ce": "binary",
    }
    assert "is 'application/x-python-serialize', not 'application/json'" in refused(app, "resource:r1", entry)
    assert not marker.exists()


def test_an_undecodable_or_unaccepted_message_is_refused() -> None:
    app = make_app()
    garbage = {**entry_for(app, "trust.queued", "r1", "a"), "m": b"{not json"}
    assert "does not decode as 'application/json'" in refused(app, "resource:r1", garbage)
    yaml_only = make_app(accept_content=["yaml"])
    assert "not in the app's accept_content" in refused(
        yaml_only, "resource:r1", entry_for(yaml_only, "trust.queued", "r1", "a")
    )


def test_with_a_signing_key_only_untampered_signed_entries_are_published() -> None:
    app = make_app()
    entry = entry_for(app, "trust.queued", "r1", "a")
    signed = {**entry, "sg": sign_entry(SECRET, entry)}
    assert check_entry(app, "resource:r1", signed, SECRET).options["task_id"] == "t-1"
    assert "has no signature" in refused(app, "resource:r1", entry, SECRET)
    other = entry_for(app, "trust.queued", "r1", "b")  # same key, other arguments
    tampered = {**signed, "m": other["m"]}
    assert "has a signature that does not match" in refused(app, "resource:r1", tampered, SECRET)
    assert "does not match" in refused(app, "resource:r1", {**signed, "t": "t-9"}, SECRET)
    assert "does not match" in refused(app, "resource:r1", signed, b"another-secret-of-16+bytes")


@pytest.mark.parametrize(
    ("value", "why"),
    [
        (b"short", "at least 16 bytes long, got 5"),
        (42, "must be a str or bytes secret, got int"),
    ],
)
def test_a_bad_signing_key_is_refused_without_echoing_it(value: Any, why: str) -> None:
    with pytest.raises(ConfigurationError) as info:
        read_settings({"mongolock_signing_key": value})
    assert why in str(info.value) and "mongolock_signing_key" in str(info.value)
    assert "short" not in str(info.value)


def test_the_signing_key_is_read_from_the_settings_and_not_shown() -> None:
    settings = read_settings({"mongolock_signing_key": SECRET.decode()})
    assert settings.signing_key == SECRET
    assert SECRET.decode() not in repr(settings)
