"""``celery -A proj mongolock ...``: look at leases and release them.

Registered as a Celery sub-command through the ``celery.commands`` entry point group::

    celery -A proj mongolock list [--prefix P] [--all] [--json]
    celery -A proj mongolock inspect KEY [--json]
    celery -A proj mongolock inspect --collection DB.COLL --id ID [--json]     (a DocumentLock)
    celery -A proj mongolock release KEY [--force]
    celery -A proj mongolock release --collection DB.COLL --id ID [--force]    (a DocumentLock)
    celery -A proj mongolock watch [--prefix P] [--interval S] [--count N]
    celery -A proj mongolock history KEY [--limit N] [--json]
    celery -A proj mongolock why KEY [--json]

The store is the app's (``mongolock_*`` settings). Connection passwords are never printed.

Exit status: 0 done (for ``release``: the key is free now, released by us or free already); 1 an error
(MongoDB unreachable, no such lease for ``inspect`` and ``why``); 2 a usage error, including ``release``
of a held key without ``--force``.
"""

from __future__ import annotations

import datetime as _dt
import difflib
import json
import logging
import os
import sys
import time
from typing import Any

import click

from celery_mongolock.core.store import LeaseInfo, LeaseStore
from celery_mongolock.core.store_sends import sends_of
from celery_mongolock.core.urls import redact
from celery_mongolock.exceptions import InvalidKey, MongoLockError, StoreUnavailable
from celery_mongolock.integration.config import get_store
from celery_mongolock.ops import cli_documents, cli_queue
from celery_mongolock.ops.cli_params import Number
from celery_mongolock.ops.cli_rate import rate_lines, rate_verdict, read_window
from celery_mongolock.ops.cli_sends import pending_send_lines, pending_sends_json
from celery_mongolock.ops.cli_why import history_table, no_lease_words, why_lines

__all__ = ["history_table", "mongolock", "why_lines"]


# -- usage errors in our words ----------------------------------------------------------------------------
# click's own wording of usage errors ("No such option", "Missing argument") changes between its releases;
# ours names the command, the option or argument as typed, and what it takes, from click's structured
# fields (the option's name, the parameter) only.

_ARGUMENTS = {"key": "the lease key"}


def _did_you_mean(name: str, known: list[str]) -> str:
    close = difflib.get_close_matches(name, known, n=2, cutoff=0.6)
    return f" (did you mean {' or '.join(map(repr, close))}?)" if close else ""


def _option_names(command: click.Command, ctx: click.Context) -> list[str]:
    return sorted(o for p in command.get_params(ctx) if isinstance(p, click.Option) for o in p.opts)


def _in_our_words(command: click.Command, ctx: click.Context, exc: click.UsageError) -> click.UsageError:
    """The usage error ``exc`` raised by click while parsing ``command``'s arguments, said in our words."""
    where = f"mongolock {ctx.info_name}" if ctx.info_name != "mongolock" else "mongolock"
    if isinstance(exc, click.NoSuchOption):
        known = _option_names(command, ctx)
        text = f"{where} has no option {exc.option_name!r}{_did_you_mean(exc.option_name, known)}"
        text += f"; its options are {', '.join(known)}"
    elif isinstance(exc, click.BadOptionUsage):
        text = f"{where}: option {exc.option_name!r} needs a value"
    elif isinstance(exc, click.MissingParameter) and exc.param is not None:
        name = exc.param.human_readable_name
        what = _ARGUMENTS.get(exc.param.name or "", "an argument")
        text = f"{where} needs {name}, {what}: celery -A proj {where} {name}"
    elif isinstance(exc, click.BadParameter) and exc.param is not None and isinstance(exc.param.type, Number):
        text = f"{where}: {exc.param.opts[0]} {exc.message}"  # Number's message is ours
    else:  # pragma: no cover - another of click's usage errors: its words, after ours
        text = f"{where}: bad command line ({exc.format_message()})"
    return click.UsageError(text, ctx)


class _Command(click.Command):
    """A sub-command whose usage errors are in our words."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        ctx.allow_extra_args = True  # refused below, in our words
        try:
            rest = super().parse_args(ctx, args)
        except click.UsageError as exc:
            if exc.ctx is not None and exc.ctx is not ctx:  # pragma: no cover - not ours to word
                raise
            raise _in_our_words(self, ctx, exc) from None
        if rest and not ctx.resilient_parsing:
            raise click.UsageError(
                f"mongolock {ctx.info_name} takes no more arguments, got {' '.join(map(repr, rest))}", ctx
            )
        return rest


class _Group(click.Group):
    """``mongolock``: an unknown command or option is refused in our words."""

    command_class = _Command

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, args)
        except (click.NoSuchOption, click.BadOptionUsage) as exc:
            raise _in_our_words(self, ctx, exc) from None

    def resolve_command(
        self, ctx: click.Context, args: list[str]
    ) -> tuple[str | None, click.Command | None, list[str]]:
        name = args[0] if args else ""
        if (
            name
            and not name.startswith("-")
            and self.get_command(ctx, name) is None
            and not ctx.resilient_parsing
        ):
            known = sorted(self.commands)
            raise click.UsageError(
                f"mongolock has no command {name!r}{_did_you_mean(name, known)}; "
                f"its commands are {', '.join(known)}",
                ctx,
            )
        return super().resolve_command(ctx, args)


def _store(ctx: click.Context) -> LeaseStore:
    app = getattr(ctx.obj, "app", None)
    if app is None:  # pragma: no cover - only when run outside the celery umbrella command
        raise click.UsageError("run as: celery -A your.app mongolock ...")
    try:
        return get_store(app)
    except MongoLockError as exc:
        raise click.ClickException(redact(str(exc))) from None


#: ``list`` and ``watch`` fit in this many columns for keys of up to 30 characters (``--json``: in full).
TABLE_WIDTH = 120
#: How many parked runs ``inspect`` and ``why`` read and show (the server cuts the rest out of a deep
#: queue; both say how many there are, and ``queue KEY`` pages through them all).
INSPECT_PARKED = 50
WHY_PARKED = 20
_HOLDER_WIDTH = 48


def _short_id(task_id: Any) -> str:
    text = str(task_id)
    return text if len(text) <= 12 else text[:8] + "…"


def _who(h: dict[str, Any], short: bool = False) -> str:
    """``host:pid task[id]`` (``short``: the task id's first 8 characters)."""
    where = ":".join(str(h[k]) for k in ("host", "pid") if h.get(k) is not None)
    task = h.get("task_name") or h.get("role") or ""
    if h.get("task_id"):
        task += f"[{_short_id(h['task_id']) if short else h['task_id']}]"
    if h.get("handed") and not where:  # (no worker has it yet: no host, no pid)
        return f"{task} (handed, not yet claimed)".strip()
    return f"{where} {task}".strip() or "-"


def _holder_line(h: dict[str, Any]) -> str:
    """``task[id] on worker (host pid N), with keys a, b``: one holder, in full, for ``inspect``."""
    task = str(h.get("task_name") or h.get("role") or "?")
    if h.get("task_id"):
        task += f"[{h['task_id']}]"
    where = " ".join(str(p) for p in (h.get("host"), h.get("pid") and f"pid {h['pid']}") if p)
    worker = h.get("worker")
    if h.get("handed") and not (worker or where):
        text = f"{task}, handed the key, not yet claimed by a worker"
    else:
        text = f"{task} on {worker} ({where})" if worker and where else f"{task} on {worker or where or '?'}"
    keys = h.get("keys")
    if isinstance(keys, (list, tuple)) and len(keys) > 1:
        text += f", with keys {', '.join(map(str, keys))}"
    return text


def _slots_summary(info: LeaseInfo) -> str:
    """``3/3 slots: sync_tenant x2, report x1``: the holds of a ``limit=N`` key, by task."""
    counts: dict[str, int] = {}
    for hold in info.slots:
        h = hold["holder"] or {}
        name = str(h.get("task_name") or h.get("role") or "?")
        counts[name] = counts.get(name, 0) + 1
    tasks = ", ".join(f"{name} x{n}" for name, n in counts.items())
    return f"{len(info.slots)}/{info.limit} slots: {tasks}"


def _holder(info: LeaseInfo, short: bool = False) -> str:
    if info.slots:
        if short:
            return _slots_summary(info)
        return f"{len(info.slots)}/{info.limit} slots: " + ", ".join(
            _who(s["holder"] or {}) for s in info.slots
        )
    return _who(info.holder, short)


def _expires(info: LeaseInfo) -> str:
    if info.slots:  # the first hold to end frees a slot
        return f"{min(float(s['expires_in']) for s in info.slots):.1f}s"
    if info.expires_in is None:
        return "-"
    if not info.held:
        return "free"
    return f"{info.expires_in:.1f}s"


def _parked(info: LeaseInfo) -> str:
    if not info.parked_total and not info.handoff:
        return "-"
    text = str(info.parked_total)
    if info.handoff:
        text += " (+1 handed)"
    return text


def _fit(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def _table(infos: list[LeaseInfo]) -> str:
    """The ``list``/``watch`` table: one row per key, within ``TABLE_WIDTH`` columns for usual keys (a
    long holder is cut with "…"; ``inspect`` and ``--json`` show it in full)."""
    rows = [("KEY", "HOLDER", "FENCE", "EXPIRES IN", "PARKED")]
    rows += [
        (i.key, _fit(_holder(i, short=True), _HOLDER_WIDTH), str(i.fence), _expires(i), _parked(i))
        for i in infos
    ]
    widths = [max(len(r[c]) for r in rows) for c in range(5)]
    lines = ["  ".join(cell.ljust(widths[c]) for c, cell in enumerate(r)).rstrip() for r in rows]
    return "\n".join(lines)


def _json(value: Any) -> str:
    def default(obj: Any) -> Any:
        if isinstance(obj, _dt.datetime):
            return obj.isoformat()
        return str(obj)

    return json.dumps(value, default=default, indent=2, sort_keys=True)


def _run(action: Any) -> Any:
    try:
        return action()
    except StoreUnavailable as exc:
        raise click.ClickException(_unreachable(exc)) from None
    except InvalidKey as exc:  # (bad input: a usage error, exit status 2)
        raise click.UsageError(redact(str(exc))) from None
    except MongoLockError as exc:
        raise click.ClickException(redact(str(exc))) from None


def _unreachable(exc: StoreUnavailable) -> str:
    """MongoDB did not answer: the driver's reason without its topology dump, and, when no app was given
    (neither ``-A`` nor ``CELERY_APP``), that the default URL was tried."""
    text = redact(str(exc)).split(", Topology Description:")[0]
    ctx = click.get_current_context(silent=True)
    root = ctx.find_root() if ctx is not None else None
    if not ((root.params.get("app") if root is not None else None) or os.environ.get("CELERY_APP")):
        text += (
            "; no app was given, so the default mongolock_url was tried: run celery -A your.app mongolock "
            "..., with the app whose settings name your MongoDB"
        )
    return text


@click.group(name="mongolock", cls=_Group)
@click.pass_context
def mongolock(ctx: click.Context) -> None:
    """Inspect and manage celery_mongolock leases."""
    # Each command says what happened on stdout; without this, the library's own log records (such as
    # the store's "force-released ..." warning) would be printed on stderr too, by logging's last resort.
    logging.getLogger("celery_mongolock").addHandler(logging.NullHandler())


@mongolock.command(name="list")
@click.option("--prefix", default=None, help="only keys starting with this text")
@click.option("--all", "include_free", is_flag=True, help="include released and expired leases")
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
@click.pass_context
def list_leases(ctx: click.Context, prefix: str | None, include_free: bool, as_json: bool) -> None:
    """List held leases (and keys with runs parked): key, holder, fence, expires in, parked runs."""
    store = _store(ctx)
    infos = _run(lambda: store.list(prefix, include_free=include_free, parked_limit=1))
    if as_json:
        click.echo(_json([i.as_dict() for i in infos]))
    elif infos:
        click.echo(_table(infos))
    else:
        click.echo("no leases held" + (f" with prefix {prefix!r}" if prefix else ""))


@mongolock.command(name="inspect")
@click.argument("key", required=False)
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
@cli_documents.document_options
@click.pass_context
def inspect_lease(ctx: click.Context, /, key: str | None, as_json: bool, **document: Any) -> None:
    """Show one lease in full, with the runs parked on it (next first), or a document's lock."""
    store = _store(ctx)
    if cli_documents.wants_document(key, document["collection"], document["id_text"], document["id_json"]):
        where = cli_documents.target(store, **document)
        return cli_documents.inspect_document_lock(store, where, as_json)
    assert key is not None
    info = _run(lambda: store.inspect(key, parked_limit=INSPECT_PARKED))
    if info is None:
        if as_json:
            click.echo("null")
            return
        raise click.ClickException(no_lease_words(key))
    if as_json:
        click.echo(_json(info.as_dict()))
        return
    data = info.as_dict()
    data["state"] = "held" if info.held else "free"
    data["expires_in"] = _expires(info)
    # (the names shown: a field added to LeaseInfo must not widen the column)
    width = max(len(k) for k in ("key", "state", "holder", "handoff", "parked", "acquired_at", "released_at"))
    if info.slots or info.limit:  # a limit=N key: each hold has its own holder, owner and expiry
        held = f"{len(info.slots)} of {info.limit} slots held" if info.slots else "no slot held"
        data.update(state=held if info.slots else "free", limit=info.limit)
        names: tuple[str, ...] = ("key", "state", "limit", "fence", "released_at")
    else:
        # A key nobody holds keeps its last holder's fields: named as such (as ``why`` does), not as its
        # holder.
        last = _holder_line(info.holder) if info.holder else None
        data["holder"], data["last_holder"] = (last, None) if info.held else (None, last)
        names = (
            "key",
            "state",
            "holder",
            *(("last_holder",) if last and not info.held else ()),
            "fence",
            "owner",
            "expires_in",
            "expires_at",
            "acquired_at",
            "renewed_at",
            "released_at",
        )
    for name in names:
        value = data.get(name)
        click.echo(f"{name.ljust(width)}  {value if value is not None else '-'}")
    for hold in info.slots:
        click.echo(
            f"  slot {hold['slot']}: {_holder_line(hold['holder'] or {})}, fence {hold['fence']}, "
            f"expires in {hold['expires_in']:.1f}s"
        )
    if info.handoff:
        h = info.handoff
        click.echo(
            f"{'handoff'.ljust(width)}  {h['task_name']}[{h['task_id']}] handed {h['handed_for']}s ago, "
            f"not yet taken up (attempt {h['attempt']})"
        )
    click.echo(f"{'parked'.ljust(width)}  {info.parked_total or '-'}")
    for e in info.parked:
        deadline = f", deadline {e['deadline'].isoformat()}" if e.get("deadline") else ""
        click.echo(
            f"  {e['position']:>3}. {e['task_name']}[{e['task_id']}] parked {e['parked_for']}s{deadline}"
        )
    if info.parked_total > len(info.parked):
        click.echo(f"  ... and {info.parked_total - len(info.parked)} more: celery mongolock queue {key}")


@mongolock.command(name="release")
@click.argument("key", required=False)
@click.option("--force", is_flag=True, help="required to release a held lease: whoever holds it")
@cli_documents.document_options
@click.pass_context
def release_lease(ctx: click.Context, /, key: str | None, force: bool, **document: Any) -> None:
    """Release KEY (or a document's lock) whoever holds it (the holder finds out at its next renewal).

    Exit status 0 when the key is free afterwards (released, or nobody held it); 2 when it is held and
    --force was not given.
    """
    store = _store(ctx)
    if cli_documents.wants_document(key, document["collection"], document["id_text"], document["id_json"]):
        return cli_documents.release_document_lock(store, cli_documents.target(store, **document), force)
    assert key is not None
    overlap = "releasing someone else's lease can let two runs overlap"
    try:
        info = store.inspect(key)
    except MongoLockError as exc:
        if force:
            raise click.ClickException(redact(str(exc))) from None
        why = redact(str(exc)).split(" (configured timeouts")[0].split(": ServerSelection")[0][:200]
        raise click.UsageError(
            f"could not tell whether {key!r} is held ({why}); {overlap}: repeat with --force if you are sure"
        ) from None
    if info is None or not info.held:
        click.echo(f"{key!r} is free: nobody holds it; nothing to release")
        return
    if not force:
        raise click.UsageError(
            f"{key!r} is held by {_holder(info)} (expires in {_expires(info)}); {overlap}: repeat with "
            "--force if you are sure"
        )
    released = _run(lambda: store.force_release(key))
    if released:
        click.echo(f"released {key!r} (was held by {_holder(info)})")
    else:  # it ended or expired between the two commands
        click.echo(f"{key!r} is free: nobody holds it; nothing to release")


@mongolock.command(name="watch")
@click.option("--prefix", default=None, help="only keys starting with this text")
@click.option("--interval", default=1.0, show_default=True, type=Number(float, 0.1, "seconds"))
@click.option("--count", default=0, type=Number(int, 0), help="stop after N refreshes (0: until Ctrl-C)")
@click.pass_context
def watch_leases(ctx: click.Context, prefix: str | None, interval: float, count: int) -> None:
    """Show held leases live, refreshed every INTERVAL seconds, until Ctrl-C."""
    store = _store(ctx)
    tty = sys.stdout.isatty()
    shown = 0
    try:
        while True:
            infos = _run(lambda: store.list(prefix, parked_limit=1))  # (the count is enough)
            stamp = _dt.datetime.now().strftime("%H:%M:%S")
            body = _table(infos) if infos else "no leases held"
            if tty:
                click.clear()
            click.echo(f"{stamp}  {len(infos)} held on {store.url or 'the configured MongoDB'}\n{body}\n")
            shown += 1
            if count and shown >= count:
                return
            time.sleep(interval)
    except KeyboardInterrupt:
        return


# -- a key's parked runs (``cli_queue``) --------------------------------------------------------------
#: ``queue --per-page`` at most; and the first run a page may start at (MongoDB's ``$slice`` takes 32-bit
#: numbers): a page further on is past the last, and only the count is read to say so.
MAX_PER_PAGE = 1_000_000
_MAX_PARKED_FROM = 2**31 - 1 - MAX_PER_PAGE


def _parked_info(
    ctx: click.Context, key: str, page: int | None = None, per_page: int = 50
) -> tuple[LeaseStore, LeaseInfo | None]:
    """The lease of ``key`` with its parked runs: page ``page`` of them only (read on the server), or all;
    None for a key with no lease document (nothing is parked on it)."""
    store = _store(ctx)
    if page is None:
        return store, _run(lambda: store.inspect(key))
    start = (page - 1) * per_page
    if start > _MAX_PARKED_FROM:  # past any queue (and past what MongoDB's $slice takes): the count only
        start, per_page = 0, 1
    return store, _run(lambda: store.inspect(key, parked_from=start, parked_limit=per_page))


@mongolock.command(name="queue", cls=_Command)
@click.argument("key")
@click.option("--page", default=1, show_default=True, type=Number(int, 1), help="page N (1: the next runs)")
@click.option(
    "--per-page", default=50, show_default=True, type=Number(int, 1, high=MAX_PER_PAGE), help="runs per page"
)
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
@click.pass_context
def queue_of(ctx: click.Context, key: str, page: int, per_page: int, as_json: bool) -> None:
    """The runs parked on KEY, next first, a page at a time."""
    info = _parked_info(ctx, key, page, per_page)[1]
    total = 0 if info is None else info.parked_total
    pages = cli_queue.pages(total, per_page)
    if page > pages:
        raise click.UsageError(
            f"no page {page} of the runs parked on {key!r}: {total} run(s), {pages} page(s) of {per_page}"
        )
    if info is None:  # an empty queue, as for a key with a lease and no parked run
        if as_json:
            click.echo(_json({"key": key, "parked": 0, "page": page, "pages": 1, "runs": []}))
        else:
            click.echo(f"{key}: 0 run(s) parked (no lease document)")
        return
    if as_json:
        rows = cli_queue.page_of(info, page, per_page)
        found = {"key": info.key, "parked": total, "page": page, "pages": pages, "runs": rows}
        click.echo(_json({**found, "other_kind": info.other_kind}))
        return
    click.echo("\n".join(cli_queue.queue_lines(info, page, per_page)))


@mongolock.command(name="drop", cls=_Command)
@click.argument("key")
@click.argument("task_ids", nargs=-1, required=True)
@click.option("--yes", is_flag=True, help="do not ask for confirmation (scripts)")
@click.pass_context
def drop_parked(ctx: click.Context, key: str, task_ids: tuple[str, ...], yes: bool) -> None:
    """Drop parked runs from KEY's queue by task id: they end REVOKED without running."""
    store, info = _parked_info(ctx, key)
    if info is None:  # (a usage error, as for task ids not parked on a key that has a lease: exit 2)
        raise click.UsageError(f"no lease {key!r}: nothing is parked on it")
    _drop(ctx, store, info, list(dict.fromkeys(task_ids)), yes)


@mongolock.command(name="purge", cls=_Command)
@click.argument("key")
@click.option("--yes", is_flag=True, help="do not ask for confirmation (scripts)")
@click.pass_context
def purge_queue(ctx: click.Context, key: str, yes: bool) -> None:
    """Drop every run parked on KEY: they end REVOKED without running (the holder runs on)."""
    store, info = _parked_info(ctx, key)
    if info is None:
        click.echo(f"{key!r}: no lease document, so no run parked; nothing to purge")
        return
    ids = [str(run["task_id"]) for run in info.parked]
    if not ids:
        click.echo(f"{key!r}: no run parked; nothing to purge")
        return
    _drop(ctx, store, info, ids, yes)


def _drop(ctx: click.Context, store: LeaseStore, info: LeaseInfo, ids: list[str], yes: bool) -> None:
    missing = cli_queue.not_parked(info, ids)
    if missing:  # (before asking: an answer must not be asked for nothing)
        raise click.UsageError(missing)
    if not yes:
        question = f"drop {len(ids)} run(s) parked on {info.key!r}? They end REVOKED and never run"
        try:
            answer = click.confirm(question, default=False)
        except click.Abort:  # no answer: the end of the input (no terminal), or Ctrl-C
            raise click.ClickException("nothing dropped: no answer (pass --yes in scripts)") from None
        if not answer:
            raise click.ClickException("nothing dropped")
    rounds = iter(cli_queue.drop_runs(ctx.obj.app, store, info, ids))
    try:
        while (lines := _run(lambda: next(rounds, None))) is not None:
            click.echo("\n".join(lines))  # (each round as it is done: a deep queue takes a while)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None


# -- history and why (rendered by ``cli_why``) ------------------------------------------------------
@mongolock.command(name="history")
@click.argument("key")
@click.option("--limit", default=20, show_default=True, type=Number(int, 1), help="at most N leases")
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
@click.pass_context
def lease_history(ctx: click.Context, key: str, limit: int, as_json: bool) -> None:
    """How KEY's last leases ended, newest first: holder, task, wait, hold, end (server time, UTC)."""
    store = _store(ctx)
    entries = _run(lambda: store.history(key, limit))
    if as_json:
        click.echo(_json([e.as_dict() for e in entries]))
    elif entries:
        click.echo(history_table(entries))
    else:
        click.echo(f"no endings recorded for {key!r}")


@mongolock.command(name="why")
@click.argument("key")
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
@click.pass_context
def why_key(ctx: click.Context, key: str, as_json: bool) -> None:
    """Why KEY is not running: the verdict first, then holder, expiry (server's clock), parked runs, last
    endings."""
    store = _store(ctx)
    story = _run(lambda: store.why(key, parked_limit=WHY_PARKED))
    window = read_window(store, key)
    rate = rate_lines(window)
    pending = _run(lambda: sends_of(store).pending(key))
    if as_json:
        found = {"key": key} if story is None else story.as_dict()
        click.echo(
            _json(
                None
                if story is None and not pending
                else {**found, "unique_sends": pending_sends_json(pending)}
            )
        )
        return
    if story is None and not pending and not rate:
        raise click.ClickException(no_lease_words(key))
    now = story.server_now if story is not None else _dt.datetime.now(_dt.timezone.utc)
    if story is not None:
        lines = why_lines(story)
        held_back = rate_verdict(window) if story.state == "free" else None
        if held_back is not None:  # free, but not for a start now
            lines[0] = lines[0].replace("the next run takes it at once", held_back)
    elif rate:
        lines = [f"{key}: free (no lease document); a rate limits its starts", ""]
    else:
        lines = [f"{key}: free; not taken yet, with sends pending", ""]
    click.echo("\n".join([*lines, *rate, *pending_send_lines(pending, now)]))
