"""``celery mongolock history`` and ``why`` as text: one line per acquisition (``history_table``), and a
key's verdict with the details it rests on (``why_lines``). Pure rendering of what the store read.
"""

from __future__ import annotations

import datetime as _dt

from celery_mongolock.core.history import KeyStory, LeaseEnding, clock

__all__ = ["history_table", "no_lease_words", "why_lines"]


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}s"


def _stamp(when: _dt.datetime | None) -> str:
    """``2026-11-23 12:40:06.9`` (UTC), or ``-``."""
    return "-" if when is None else f"{when.astimezone(_dt.timezone.utc):%Y-%m-%d} {clock(when)}"


def _how(ending: LeaseEnding) -> str:
    if ending.holder_saw and ending.how != ending.holder_saw:
        return f"{ending.how} (holder saw: {ending.holder_saw})"
    if ending.parked:
        by = f" by {ending.by}" if ending.by else ""
        return f"{ending.how}{by} (parked)"
    if ending.by:  # a running holder that a newer send superseded (Replace(cancel_running=True))
        return f"{ending.how} by {ending.by} (running)"
    return ending.how


def _where(ending: LeaseEnding) -> str:
    """Where the lease was held; a key handed to a run that never claimed it was held by no worker (for a
    run of several keys waiting for a later key, its reservation lapses so once per lease time)."""
    if ending.how == "handoff-expired" and ending.where == "?":
        return "no worker (handed, not claimed)"
    return ending.where


def history_table(entries: list[LeaseEnding]) -> str:
    """``celery mongolock history``: one line per acquisition, newest first."""
    rows = [("FENCE", "HOW", "TASK", "WHERE", "WAITED", "HELD", "ENDED (UTC)")]
    rows += [
        (
            "-" if e.parked else str(e.fence),
            _how(e),
            e.task,
            "-" if e.parked else _where(e),
            _seconds(None if e.waited_ms is None else e.waited_ms / 1000),
            _seconds(e.held_seconds),
            _stamp(e.ended_at),
        )
        for e in entries
    ]
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(widths[c]) for c, cell in enumerate(r)).rstrip() for r in rows)


def _ago(story: KeyStory, when: _dt.datetime | None) -> str:
    if when is None:
        return "-"
    seconds = (story.server_now - when).total_seconds()
    rel = f"{seconds:.1f} s ago" if seconds >= 0 else f"in {-seconds:.1f} s"
    return f"{clock(when)} ({rel})"


def _row(name: str, value: str) -> str:
    return f"{name.ljust(11)} {value}"


def why_lines(story: KeyStory, endings: int = 5) -> list[str]:
    """``celery mongolock why``: the verdict, then the details it rests on (times on the server's clock,
    UTC): who holds the key, when it expires or was released, the parked runs and the handoff, the last
    endings."""
    lines = [f"{story.key}: {story.verdict}", ""]
    lines += _holder_rows(story)
    lines += _timing_rows(story)
    lines += _queue_rows(story)
    lines += _ending_rows(story, endings)
    return [line.rstrip() for line in lines]


def _holder_rows(story: KeyStory) -> list[str]:
    """The holder (or the last one), or one line per hold of a ``limit=N`` key."""
    h = story.holder
    task = str(h.get("task_name") or h.get("role") or "?") + (f"[{h['task_id']}]" if h.get("task_id") else "")
    where = str(h.get("worker") or h.get("host") or "?") + (
        f" pid {h['pid']}" if h.get("pid") is not None else ""
    )
    if h.get("handed") and not (h.get("worker") or h.get("host")):
        where = "no worker yet (handed the key, not yet claimed)"
    keys = h.get("keys")
    if isinstance(keys, (list, tuple)) and len(keys) > 1:
        where += f", with keys {', '.join(map(str, keys))}"
    if story.state == "slots":  # a limit=N key: one line per hold, no single holder
        lines = [_row("slots", f"{len(story.slots)} of {story.limit or len(story.slots)} held")]
        for hold in story.slots:
            held = hold.get("holder") or {}
            name = str(held.get("task_name") or held.get("role") or "?")
            name += f"[{held['task_id']}]" if held.get("task_id") else ""
            at = str(held.get("worker") or held.get("host") or "?")
            at += f" pid {held['pid']}" if held.get("pid") is not None else ""
            lines.append(
                f"{'':12}slot {hold['slot']}: {name} on {at}, fence {hold['fence']}, "
                f"expires in {float(hold['expires_in']):.1f} s"
            )
        return lines
    if story.state == "free":
        return [_row("holder", "none")] + (
            [_row("last holder", f"{task} on {where}, fence {story.fence}")] if h else []
        )
    return [_row("holder", f"{task} on {where}, fence {story.fence}")]


def _timing_rows(story: KeyStory) -> list[str]:
    """When the key was taken, when it expires (or expired), when it was released."""
    lines = []
    if story.state != "slots":
        lines.append(_row("taken", _ago(story, story.acquired_at)))
    if story.state in ("held", "held-after-release") and story.expires_in is not None:
        renewed = ""
        if story.renewed_at is not None and story.renewed_at != story.acquired_at:
            renewed = f"; renewed {(story.server_now - story.renewed_at).total_seconds():.1f} s ago"
        lines.append(
            _row(
                "expires",
                f"in {story.expires_in:.1f} s on the server's clock (at {clock(story.expires_at)}{renewed})",
            )
        )
    elif story.state == "expired" and story.expires_in is not None:
        expired = f"{-story.expires_in:.1f} s ago on the server's clock (at {clock(story.expires_at)})"
        lines.append(_row("expired", expired))
    if story.released_at is not None and story.state != "held":
        why = " by force" if story.forced_release else ""
        why += f" ({story.released_for})" if story.released_for else ""
        lines.append(_row("released", _ago(story, story.released_at) + why))
    return lines


def _queue_rows(story: KeyStory) -> list[str]:
    """The parked runs in queue order, and a handoff not taken up yet."""
    if not story.parked:
        lines = [_row("parked", "none")]
    else:
        total = max(story.parked_total, len(story.parked))
        first = "" if total == len(story.parked) else f" (the first {len(story.parked)} shown)"
        lines = [_row("parked", f"{total}, in queue order{first}:")]
        for n, run in enumerate(story.parked, 1):
            # (a run parked after the server's time of the read, by a few ms: "0.0 s ago", not "-0.0")
            parked = max(0.0, (story.server_now - run.parked_at).total_seconds()) if run.parked_at else None
            deadline = "none"
            if run.deadline is not None:
                left = (run.deadline - story.server_now).total_seconds()
                deadline = f"in {left:.1f} s" if left >= 0 else f"passed {-left:.1f} s ago"
            lines.append(
                f"{'':12}{n:>2}  {run.task}  sent {clock(run.sent_at)}  "
                f"parked {'-' if parked is None else f'{parked:.1f} s ago'}  deadline {deadline}"
            )
    if story.handoff is not None:
        ho = story.handoff
        attempt = f" (attempt {ho.attempt})" if ho.attempt else ""
        lines.append(
            _row("handoff", f"to {ho.task}, handed {_ago(story, ho.handed_at)}{attempt}, not taken up yet")
        )
    for n, wait in enumerate(story.other_kind):
        wants = "a single lease" if wait.wants == "single" else "a slot" if wait.wants == "slots" else "?"
        lines.append(
            _row(
                "other kind" if n == 0 else "",
                f"{wait.task} waits to take it as {wants}, since {_ago(story, wait.since)}; last back "
                f"{_ago(story, wait.noted_at)}",
            )
        )
    return lines


def _ending_rows(story: KeyStory, endings: int) -> list[str]:
    """The last ``endings`` endings, newest first."""
    if not story.endings:
        return [_row("last ends", "none recorded")]
    lines = []
    for n, e in enumerate(story.endings[:endings]):
        held = f", held {e.held_seconds:.2f} s" if e.held_seconds is not None else ""
        where = f" on {_where(e)}"
        if e.parked:  # a run that never held the key
            where = ""
            held = f", parked {e.waited_ms / 1000:.2f} s" if e.waited_ms is not None else ""
        lines.append(
            _row(
                "last ends" if n == 0 else "",
                f"{clock(e.ended_at)}  {_how(e).ljust(11)} {e.task}{where}{held}",
            )
        )
    return lines


def no_lease_words(key: str) -> str:
    """What ``inspect`` and ``why`` say of a key with no lease document."""
    return (
        f"no lease {key!r}: nothing has taken this key (or its lease document expired and was removed); "
        "it is free. Check the spelling with: celery mongolock list --all"
    )
