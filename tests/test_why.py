"""``why`` and ``history`` on crafted lease documents: the verdicts and the printed reports (golden), and
how ``ends`` and the history collection are merged. Pure logic: no server."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest

from celery_mongolock.core.history import KeyStory, LeaseEnding, merge_endings
from celery_mongolock.ops.cli import history_table, why_lines

NOW = dt.datetime(2026, 11, 23, 12, 40, 7, tzinfo=dt.timezone.utc)


def at(seconds: float) -> dt.datetime:
    return NOW + dt.timedelta(seconds=seconds)


def stamp(seconds: float) -> int:
    """A send stamp: microseconds since the epoch."""
    return int(at(seconds).timestamp() * 1_000_000)


HOLDER = {"host": "h2", "pid": 1872, "task_name": "app.upload", "task_id": "4f1c", "worker": "w2@h2"}
ENDS = [
    {"f": 100, "t": "1b9a", "n": "app.upload", "host": "h1", "pid": 1865, "worker": "w1@h1",
     "a": at(-4.0), "e": at(-2.5), "w": 1200, "how": "released"},
    {"f": 101, "t": "77d2", "n": "app.upload", "host": "h1", "pid": 1866, "worker": "w1@h1",
     "a": at(-2.5), "e": at(-1.3), "how": "holder-died"},
]  # fmt: skip
PARKED = [
    {"id": "9a0e/0.0", "t": "9a0e", "n": "app.upload", "s": stamp(-4.1), "at": at(-3.9), "dl": None},
    {"id": "5b21/0.0", "t": "5b21", "n": "app.upload", "s": stamp(-3.8), "at": at(-3.6), "dl": at(30)},
]


def held(**changes: Any) -> dict[str, Any]:
    """A lease document as ``LeaseStore.why`` reads it: held by HOLDER for 1.1 s, 28.9 s left."""
    doc: dict[str, Any] = {
        "_id": "email-group:42",
        "owner": "tok",
        "fence": 102,
        "holder": HOLDER,
        "acquired_at": at(-1.1),
        "renewed_at": at(-0.4),
        "expires_at": at(28.9),
        "released_at": None,
        "forced_release": False,
        "released_for": None,
        "ends": list(ENDS),
        "__now": NOW,
        "__expires_in_ms": 28900,
    }
    doc.update(changes)
    return doc


def released(how: str = "released", **changes: Any) -> dict[str, Any]:
    """HOLDER's lease ended 0.5 s ago (``how``), its ending last in ``ends``."""
    ending = {**ENDS[0], "f": 102, "t": "4f1c", "pid": 1872, "worker": "w2@h2", "a": at(-1.1), "e": at(-0.5)}
    fields: dict[str, Any] = {
        "owner": None,
        "released_at": at(-0.5),
        "ends": [*ENDS, {**ending, "how": how}],
        "forced_release": how == "forced",
        "released_for": "holder died" if how == "holder-died" else None,
    }
    return held(**{**fields, **changes})


VERDICTS = [
    (
        held(),
        "held by w2@h2 pid 1872 (task app.upload[4f1c]) since 12:40:05.9, expires in 28.9 s on the server's "
        "clock",
    ),
    (
        held(q=PARKED, ho=None),
        "held by w2@h2 pid 1872 (task app.upload[4f1c]) since 12:40:05.9, expires in 28.9 s on the server's "
        "clock; 2 runs parked; next: app.upload[9a0e], parked 3.9 s ago",
    ),
    (
        held(expires_at=at(-4.2), __expires_in_ms=-4200),
        "expired 4.2 s ago, not yet taken over: w2@h2 pid 1872 (task app.upload[4f1c]) stopped renewing it",
    ),
    (released(), "free (released 0.5 s ago by app.upload[4f1c]): the next run takes it at once"),
    (
        released("forced"),
        "free (force-released 0.5 s ago from app.upload[4f1c]): the next run takes it at once",
    ),
    (
        released("holder-died"),
        "free (released 0.5 s ago for app.upload[4f1c], whose worker process died): the next run takes it at "
        "once",
    ),
    (held(owner=None, ends=[]), "free: the next run takes it at once"),
    (released(q=PARKED[:1]), "free, but 1 run parked; next: app.upload[9a0e], parked 3.9 s ago"),
    (
        released(q=PARKED[1:], ho={**PARKED[0], "hat": at(-0.4)}),
        "free, handed off to app.upload[9a0e] 0.4 s ago and not taken up yet; 1 run parked; next: "
        "app.upload[5b21], parked 3.6 s ago",
    ),
    (
        # A release before the task's minimum hold: the key stays taken until then.
        released(owner="tok", expires_at=at(2.0), __expires_in_ms=2000),
        "released by w2@h2 pid 1872 (task app.upload[4f1c]) at 12:40:06.5, but kept taken until its minimum "
        "hold ends: free in 2.0 s on the server's clock",
    ),
]


def test_a_free_key_expires_in_nothing() -> None:
    """A key nobody holds has no ``expires_in`` (before: the last holder's, e.g. -133 s); an expired key
    keeps its negative one, a held one its positive one."""
    free = KeyStory.from_document(released(expires_at=at(-133.0), __expires_in_ms=-133000))
    assert free.state == "free" and free.expires_in is None
    assert KeyStory.from_document(held(owner=None, ends=[], __expires_in_ms=-5)).expires_in is None
    assert KeyStory.from_document(held(expires_at=at(-4.2), __expires_in_ms=-4200)).expires_in == -4.2
    assert KeyStory.from_document(held()).expires_in == 28.9


@pytest.mark.parametrize(("doc", "verdict"), VERDICTS, ids=[str(i) for i in range(len(VERDICTS))])
def test_verdicts(doc: dict[str, Any], verdict: str) -> None:
    assert KeyStory.from_document(doc).verdict == verdict


def test_why_report_of_a_held_key_with_parked_runs() -> None:
    report = "\n".join(why_lines(KeyStory.from_document(held(q=PARKED, ho=None))))
    assert report == (
        "email-group:42: held by w2@h2 pid 1872 (task app.upload[4f1c]) since 12:40:05.9, expires in 28.9 s "
        "on the server's clock; 2 runs parked; next: app.upload[9a0e], parked 3.9 s ago\n"
        "\n"
        "holder      app.upload[4f1c] on w2@h2 pid 1872, fence 102\n"
        "taken       12:40:05.9 (1.1 s ago)\n"
        "expires     in 28.9 s on the server's clock (at 12:40:35.9; renewed 0.4 s ago)\n"
        "parked      2, in queue order:\n"
        "             1  app.upload[9a0e]  sent 12:40:02.9  parked 3.9 s ago  deadline none\n"
        "             2  app.upload[5b21]  sent 12:40:03.2  parked 3.6 s ago  deadline in 30.0 s\n"
        "last ends   12:40:05.7  holder-died app.upload[77d2] on w1@h1 pid 1866, held 1.20 s\n"
        "            12:40:04.5  released    app.upload[1b9a] on w1@h1 pid 1865, held 1.50 s"
    )


def test_why_report_of_a_force_released_key() -> None:
    report = "\n".join(why_lines(KeyStory.from_document(released("forced"))))
    assert report == (
        "email-group:42: free (force-released 0.5 s ago from app.upload[4f1c]): the next run takes it at "
        "once\n"
        "\n"
        "holder      none\n"
        "last holder app.upload[4f1c] on w2@h2 pid 1872, fence 102\n"
        "taken       12:40:05.9 (1.1 s ago)\n"
        "released    12:40:06.5 (0.5 s ago) by force\n"
        "parked      none\n"
        "last ends   12:40:06.5  forced      app.upload[4f1c] on w2@h2 pid 1872, held 0.60 s\n"
        "            12:40:05.7  holder-died app.upload[77d2] on w1@h1 pid 1866, held 1.20 s\n"
        "            12:40:04.5  released    app.upload[1b9a] on w1@h1 pid 1865, held 1.50 s"
    )


def test_why_report_of_an_expired_key_and_a_pending_handoff() -> None:
    expired = why_lines(KeyStory.from_document(held(expires_at=at(-4.2), __expires_in_ms=-4200)))
    assert "expired     4.2 s ago on the server's clock (at 12:40:02.8)" in expired
    handoff = why_lines(KeyStory.from_document(released(ho={**PARKED[0], "hat": at(-0.4), "hn": 2})))
    assert (
        "handoff     to app.upload[9a0e], handed 12:40:06.6 (0.4 s ago) (attempt 2), not taken up yet"
        in handoff
    )


def test_story_as_dict_is_plain_data() -> None:
    data = KeyStory.from_document(held(q=PARKED, ho=None)).as_dict()
    assert data["state"] == "held" and data["verdict"].startswith("held by w2@h2")
    assert data["parked"][0]["task_id"] == "9a0e" and data["parked"][0]["sent_at"].startswith(
        "2026-11-23T12:40:02"
    )
    assert [e["how"] for e in data["endings"]] == ["holder-died", "released"]
    assert data["expires_in"] == 28.9 and data["server_now"] == NOW.isoformat()


def test_history_table() -> None:
    entries = merge_endings("email-group:42", ENDS, [], 10)
    assert history_table(entries) == (
        "FENCE  HOW          TASK              WHERE           WAITED  HELD   ENDED (UTC)\n"
        "101    holder-died  app.upload[77d2]  w1@h1 pid 1866  -       1.20s  2026-11-23 12:40:05.7\n"
        "100    released     app.upload[1b9a]  w1@h1 pid 1865  1.20s   1.50s  2026-11-23 12:40:04.5"
    )


def test_merge_prefers_ends_and_attaches_the_holders_view() -> None:
    copy = {**ENDS[1], "_id": "x", "k": "email-group:42", "v": "s", "e": at(-1.0)}  # a less exact copy
    lost = {"f": 101, "k": "email-group:42", "v": "h", "how": "lost", "why": "renewal matched nothing"}
    only_holder = {"f": 99, "k": "email-group:42", "v": "h", "how": "lost", "why": "deadline passed"}
    older = {**ENDS[0], "f": 98, "v": "s"}
    entries = merge_endings("email-group:42", ENDS, [copy, lost, only_holder, older], 10)
    assert [(e.fence, e.how, e.holder_saw, e.source) for e in entries] == [
        (101, "holder-died", "lost", "ends"),
        (100, "released", None, "ends"),
        (99, "lost", "lost", "history"),
        (98, "released", None, "history"),
    ]
    assert entries[0].ended_at == at(-1.3) and entries[0].holder_saw_why == "renewal matched nothing"
    assert "(holder saw: lost)" in history_table(entries)
    assert [e.fence for e in merge_endings("email-group:42", ENDS, [older], 2)] == [101, 100]


def test_ending_from_a_record_with_missing_fields() -> None:
    ending = LeaseEnding.from_record("k", {"f": 7, "how": "expired"})
    assert (ending.task, ending.where, ending.held_seconds) == ("?", "?", None)
    assert ending.as_dict()["fence"] == 7


def test_runs_that_ended_while_parked_sort_among_the_leases_and_print_as_such() -> None:
    sup = {
        "_id": "k\x00101\x00q\x00aa",
        "f": 101,
        "v": "q",
        "t": "aa11",
        "n": "app.upload",
        "how": "superseded",
        "by": "bb22",
        "e": at(-2.0),
        "w": 500,
    }
    late = {
        "_id": "k\x00101\x00q\x00cc",
        "f": 101,
        "v": "q",
        "t": "cc33",
        "n": "app.upload",
        "how": "timeout",
        "e": at(-1.5),
        "w": 1000,
    }
    early = {
        "_id": "k\x00100\x00q\x00dd",
        "f": 100,
        "v": "q",
        "t": "dd44",
        "n": "app.upload",
        "how": "revoked",
        "e": at(-3.0),
    }
    # (the same records read twice are one each)
    entries = merge_endings("email-group:42", ENDS, [sup, late, early, dict(sup)], 10)
    assert [(e.fence, e.how, e.parked) for e in entries] == [
        (101, "holder-died", False),
        (101, "timeout", True),
        (101, "superseded", True),
        (100, "released", False),
        (100, "revoked", True),
    ]
    table = history_table(entries).splitlines()
    assert table[2].split() == [
        "-", "timeout", "(parked)", "app.upload[cc33]", "-", "1.00s", "-", "2026-11-23", "12:40:05.5"
    ]  # fmt: skip
    assert "superseded by bb22 (parked)" in table[3]
    story = KeyStory.from_document(held(ends=ENDS), [sup, late, early])
    assert story.state == "held"  # judged on ends: the runs never held the key
    assert [e.how for e in story.endings][:3] == ["holder-died", "timeout", "superseded"]
    assert (
        story.ending_phrase(story.endings[2]) == "app.upload[aa11] superseded 2.0 s ago by bb22 while parked"
    )
    assert any(
        "superseded by bb22 (parked) app.upload[aa11], parked 0.50 s" in line for line in why_lines(story)
    )


def test_the_verdict_of_a_free_key_names_its_last_lease_not_a_parked_run() -> None:
    doc = {"_id": "email-group:42", "__now": NOW, "fence": 101, "owner": None, "ends": ENDS}
    sup = {"_id": "x", "f": 102, "v": "q", "t": "aa11", "n": "app.upload", "how": "superseded",
           "by": "bb22", "e": at(-0.5)}  # fmt: skip
    story = KeyStory.from_document(doc, [sup])
    assert story.state == "free" and story.endings[0].parked  # newest first: the superseded run...
    assert story.verdict.startswith("free (released 1.3 s ago for app.upload[77d2], whose worker")


def test_a_run_ended_with_no_fence_known_sorts_by_its_time() -> None:
    """A run superseded at its admission (a late send) is recorded with no fence: it sorts after the last
    lease acquired before it ended, not below every lease (a user's trial: history was not newest first)."""
    late_send = {
        "_id": "k\x000\x00q\x00ee",
        "f": 0,
        "v": "q",
        "t": "ee55",
        "n": "app.upload",
        "how": "superseded",
        "e": at(-2.0),  # after lease 101 was acquired (-2.5), before it ended (-1.3)
    }
    entries = merge_endings("email-group:42", ENDS, [late_send], 10)
    assert [(e.task_id, e.how) for e in entries] == [
        ("77d2", "holder-died"),
        ("ee55", "superseded"),
        ("1b9a", "released"),
    ]


def test_runs_waiting_as_the_other_kind_are_shown_while_fresh_the_longest_waiting_first() -> None:
    """``kw`` (``documents.kind_waits``): runs kept aside because the key is in use as the other kind. Not
    parked, they are in the verdict and the report while noted within the last 15 s, and in the JSON."""
    kw: list[dict[str, Any]] = [
        {"t": "c3", "n": "app.sync", "w": "slots", "sc": int(at(-3.0).timestamp() * 1000), "at": at(-1.0)},
        {"t": "a1", "n": "app.sync", "w": "slots", "sc": int(at(-9.0).timestamp() * 1000), "at": at(-2.0)},
        {"t": "old", "n": "app.sync", "w": "slots", "sc": None, "at": at(-16.0)},  # took the key, or ended
    ]
    story = KeyStory.from_document(held(kw=kw))
    assert [w.task_id for w in story.other_kind] == ["a1", "c3"]
    assert story.verdict.endswith(
        "; 2 runs wait to take it as a slot (not parked: each comes back within 5 s), the first for 9.0 s: "
        "app.sync[a1]"
    ), story.verdict
    report = why_lines(story)
    assert (
        "other kind  app.sync[a1] waits to take it as a slot, since 12:39:58.0 (9.0 s ago); last back "
        "12:40:05.0 (2.0 s ago)" in report
    ), report
    assert story.as_dict()["other_kind"][0] == {
        "task_id": "a1",
        "task_name": "app.sync",
        "wants": "slots",
        "since": at(-9.0).isoformat(),
        "noted_at": at(-2.0).isoformat(),
    }
    single = KeyStory.from_document(held(kw=[{**kw[0], "w": "single"}]))
    assert "1 run waits to take it as a single lease" in single.verdict
    assert KeyStory.from_document(held(kw=kw[2:])).other_kind == ()


def test_a_run_parked_a_moment_after_the_read_and_a_handoff_never_claimed_read_plainly() -> None:
    """A new-user trial: ``parked -0.0 s ago`` (a run parked a few ms after the server's time of the read),
    and each lapsed reservation of a run that waits for a later key shown ``on ?``."""
    just = [{**PARKED[0], "at": at(0.004)}]
    report = "\n".join(why_lines(KeyStory.from_document(held(q=just, ho=None))))
    assert "parked 0.0 s ago" in report and "-0.0" not in report
    lapsed = LeaseEnding(key="k", fence=7, how="handoff-expired", task_id="t1", task_name="app.pair")
    assert "no worker (handed, not claimed)" in history_table([lapsed])
    assert " on ?" not in "\n".join(
        why_lines(
            KeyStory.from_document(
                released(ends=[{"f": 7, "how": "handoff-expired", "t": "t1", "n": "app.pair", "e": at(-1)}])
            )
        )
    )
