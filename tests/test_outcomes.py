"""The typed results of the lease engine's commands (``_outcomes``): pure functions of a reply."""

from __future__ import annotations

import datetime as _dt

import pytest

from celery_mongolock.core.documents.queue import ADMIT_OUTCOMES
from celery_mongolock.core.outcomes import Admission, AdmitOutcome, Contended

NOW = _dt.datetime(2026, 11, 25, 12, 0, 0)  # naive, as MongoDB answers without tz_aware


def test_every_outcome_the_admit_pipeline_can_decide_has_a_type() -> None:
    for lo in ADMIT_OUTCOMES:
        assert isinstance(AdmitOutcome.of(lo), AdmitOutcome)
    assert AdmitOutcome.of("claimed") is AdmitOutcome.ACQUIRED
    assert AdmitOutcome.of("due") is AdmitOutcome.ACQUIRED


def test_an_unknown_outcome_is_named() -> None:
    with pytest.raises(ValueError, match="unknown admit outcome 'bogus'"):
        AdmitOutcome.of("bogus")


def test_a_parked_admission_says_where_the_run_waits_and_whom_it_superseded() -> None:
    reply = {
        "lo": "parked",
        "holder": {"task_id": "h", "task_name": "proj.upload"},
        "expires_at": NOW,
        "fence": 7,
        "q": [{"t": "a"}, {"t": "b"}],
        "sup": [{"t": "old", "by": "b"}, {"t": "older", "by": "x"}],
    }
    admission = Admission.of(None, reply)
    assert admission.outcome is AdmitOutcome.PARKED
    assert admission.holder == {"task_id": "h", "task_name": "proj.upload"}
    assert admission.expires_at == NOW.replace(tzinfo=_dt.timezone.utc)
    assert admission.fence == 7
    assert (admission.position("b"), admission.position("a"), admission.position("zz")) == (2, 1, 0)
    assert [s["t"] for s in admission.superseded_by("b")] == ["old"]


def test_a_superseded_admission_names_the_newer_send() -> None:
    admission = Admission.of(None, {"lo": "superseded", "lo_by": "newer", "fence": 3})
    assert (admission.outcome, admission.by, admission.fence) == (AdmitOutcome.SUPERSEDED, "newer", 3)


def test_an_empty_or_odd_reply_gives_empty_fields_not_errors() -> None:
    admission = Admission.of(None, {"lo": "full", "fence": True, "q": [None, {"t": "a"}]})
    assert admission.fence is None and admission.parked == ("a",) and admission.holder == {}


def test_a_contended_acquire_names_the_holder_and_the_beat_tick() -> None:
    contended = Contended.of({"holder": {"task_id": "t1"}, "expires_at": NOW, "last_tick": 5})
    assert contended.held_by_run("t1") and not contended.held_by_run("t2") and not contended.held_by_run(None)
    assert contended.tick_ran(5) and contended.tick_ran(4) and not contended.tick_ran(6)
    assert not contended.tick_ran(None)
    assert not Contended.of(None).tick_ran(0)


def test_on_a_limited_key_a_slot_held_by_the_same_run_is_reported_as_the_holder() -> None:
    reply = {
        "holder": {"task_id": "newest"},
        "hs": [{"h": {"task_id": "other", "delivery": "0"}}, {"h": {"task_id": "me", "delivery": "1"}}],
    }
    assert Contended.of(reply, task_id="me", delivery="1").holder == {"task_id": "me", "delivery": "1"}
    assert Contended.of(reply, task_id="me", delivery="0").holder == {"task_id": "newest"}
    assert Contended.of(reply).holder == {"task_id": "newest"}
