"""Handoff lanes: a handed-over run's message skips the broker's backlog.

A key released under ``Queue``/``Replace`` is reserved for the next parked run, whose message is
published again. Published to the end of its task queue, it would wait behind every message there (with
5,000 plain tasks queued, the key idles until they have all started). Instead it goes to the queue's
*handoff lane*: a queue of its own, ``<queue>.mongolock-handoff``, that every worker consuming the task
queue also consumes (added at worker start, before the consumer starts). Why this serves it first:

* **Redis**: kombu's consumer pops with one ``BRPOP`` over all its queues, in ``queue_order_strategy``
  order. The default, ``round_robin``, moves the queue it just took a message from to the end, so the
  lane is read before the task queue again after at most one message of each other queue. The lane is
  placed just before its task queue, so ``priority`` (a fixed order) reads it first too; ``sorted`` reads
  queues by name (the task queue first) and starves the lane behind a backlog: the worker warns.
  A message priority would not do: kombu's Redis transport pops priority 0 first and gives a message
  without a priority 0, so plain tasks are already at the top.
* **RabbitMQ**: the lane is a queue of the same channel, with its own ``basic.consume``; when a
  prefetch slot frees, RabbitMQ delivers from either queue, so the lane's message does not wait for the
  backlog. A message priority would need the task queue declared with ``x-max-priority``, and RabbitMQ
  refuses to redeclare an existing queue with other arguments.

**A run sent with a priority.** kombu's Redis transport keeps a list per priority step and pops the
most urgent step (0) of *every* queue before the next step of any: a lane message carrying the run's own
priority 9 waited behind every plain task of priority 0 to 6, however the queues were ordered (the
lock-set checker: a key reserved for such a run for 180 s while the workers ran other tasks, handed again
56 times). The priority already ordered the run among the runs parked on its key; once the key is handed
to it, its message is published to the lane with priority 0 on Redis, and its own priority (``pr`` of
``rt``) is put back with its routing before its body (``restore_route``), so that a retry or a park again
carries it. On RabbitMQ the lane is a queue of its own, delivered from alongside the task queue whatever
the priorities: the run's priority is published unchanged.

Either way, the messages a worker has already reserved (``worker_prefetch_multiplier`` times the concurrency)
start first: the bound on the idle time is the prefetch window, not the backlog.

The published copy carries the handoff header as before (exactly once, crash-safe: a copy nobody claims
is handed again by the sweeper); the run's own routing (``rt`` in the header) is put back in its
``delivery_info`` when it starts, so that its ``Task.retry()`` or a later park goes to its task queue,
never to the lane. A handoff handed again (its copy was not claimed within a lease: a busy machine, or
no worker consumes the lane) goes to the task queue itself on its even attempts (``hn``) and to the lane
on its odd ones: a lane nobody consumes delays a run, never strands it, and a busy one still skips the
backlog every other attempt. ``mongolock_handoff_lane = False`` turns lanes off.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from celery import Celery
from kombu.entity import Exchange, Queue

from celery_mongolock.integration import priority

__all__ = ["LANE_SUFFIX", "add_lanes", "lane_for", "lane_of", "publish_to_lane", "restore_route", "route_of"]

log = logging.getLogger("celery_mongolock.queue")

#: A task queue's handoff lane is named ``<queue>`` + this.
LANE_SUFFIX = ".mongolock-handoff"
#: The priority a handoff goes to its lane with on Redis (kombu pops 0 first): module docstring.
URGENT_PRIORITY = 0


def lane_name(queue: str) -> str:
    """The name of ``queue``'s handoff lane."""
    return queue + LANE_SUFFIX


def is_lane(name: str) -> bool:
    return name.endswith(LANE_SUFFIX)


def lane_for(queue: Any) -> Any:
    """``queue``'s handoff lane: its own direct exchange, the same durability and arguments (a quorum or
    priority task queue has a quorum or priority lane), so that every process declares it alike."""
    name = lane_name(str(queue.name))
    durable = bool(queue.durable)
    exchange = Exchange(name, type="direct", durable=durable)  # type: ignore[no-untyped-call]
    arguments = dict(queue.queue_arguments) if queue.queue_arguments else None
    return Queue(  # type: ignore[no-untyped-call]
        name, exchange, routing_key=name, durable=durable, queue_arguments=arguments
    )


def _laneable(queue: Any) -> bool:
    """Task queues that get a lane: not a lane, not a broadcast, not a worker's own queue."""
    exchange = getattr(queue, "exchange", None)
    return not (
        is_lane(str(queue.name))
        or getattr(exchange, "type", "direct") == "fanout"
        or queue.exclusive
        or queue.auto_delete
    )


def add_lanes(app: Celery) -> list[str]:
    """At worker start, before its consumer starts: consume each task queue's lane too, just before it.
    Returns the lanes' names."""
    queues = app.amqp.queues
    names: list[str] = []
    lanes: list[str] = []
    for queue in list(queues.consume_from.values()):
        if _laneable(queue) and not is_lane(str(queue.name)):
            lane = lane_for(queue)
            queues.add(lane)
            names.append(str(lane.name))
            lanes.append(str(lane.name))
        names.append(str(queue.name))
    if lanes:
        queues.select(names)
        _warn_order(app)
    return lanes


def _warn_order(app: Celery) -> None:
    options = app.conf.broker_transport_options or {}
    if options.get("queue_order_strategy") == "sorted":
        log.warning(
            "celery_mongolock: broker_transport_options has queue_order_strategy='sorted': Redis then reads "
            "a task queue before its handoff lane, and a handed-over run waits behind the queue's backlog; "
            "use 'round_robin' (the default) or 'priority'"
        )


def route_of(app: Celery, options: Mapping[str, Any]) -> Any:
    """The task queue a run's signature options route it to (its delivery's queue, exchange and routing
    key), or None when no queue of the app matches (then its handoff is published as the run was)."""
    queues = app.amqp.queues
    name = options.get("queue")
    if isinstance(name, Queue):
        name = name.name
    if not name:
        exchange = options.get("exchange")
        exchange = getattr(exchange, "name", exchange)
        key = options.get("routing_key")
        if not key:
            return None
        if not exchange:
            name = key
        else:
            found = [q for q in queues.values() if q.exchange is not None and q.exchange.name == exchange]
            match = [q for q in found if q.routing_key == key]
            if not match:
                return None
            name = match[0].name
    name = str(name)
    if is_lane(name):
        name = name[: -len(LANE_SUFFIX)]
    queue = queues.get(name)
    return queue if queue is not None else queues.new_missing(name)


def lane_of(
    app: Celery, options: Mapping[str, Any], task_name: str | None = None
) -> tuple[Any, dict[str, Any]] | None:
    """The lane to publish a handed run to and the run's own routing (``rt`` of the handoff header), or
    None (no lane: turned off, or the run's queue is unknown or gets none). ``task_name``: the run's task,
    whose default priority its message carries when ``options`` name none. On a broker that pops a lower
    number first (Redis), a run with a priority other than 0 gets its own priority as ``pr`` of its
    routing, and is published to the lane with 0 (``publish_to_lane``; module docstring)."""
    from celery_mongolock.integration import config

    if not config.get_settings(app).handoff_lane:
        return None
    queue = route_of(app, options)
    if queue is None or not _laneable(queue):
        return None
    exchange = options.get("exchange")
    exchange = getattr(exchange, "name", exchange)
    key = options.get("routing_key")
    if exchange is None and key is None:
        exchange = queue.exchange.name if queue.exchange is not None else ""
        key = queue.routing_key or queue.name
    route: dict[str, Any] = {"exchange": str(exchange or ""), "routing_key": str(key or "")}
    if route["exchange"].endswith(LANE_SUFFIX) or route["routing_key"].endswith(LANE_SUFFIX):
        # A run that came through a lane and was parked again without ``restore_route``: its own queue.
        route = {"exchange": queue.exchange.name if queue.exchange is not None else "", "routing_key": ""}
        route["routing_key"] = str(queue.routing_key or queue.name)
    own = own_priority(app, options, task_name)
    if own and priority.lower_first(app):
        route["pr"] = own
    return lane_for(queue), route


def own_priority(app: Celery, options: Mapping[str, Any], task_name: str | None) -> int | None:
    """The priority a run's message is published with, as Celery fills it in: its options' own, else its
    task's default (the app's ``task_default_priority`` when the task sets none), else its route's
    (``task_routes``)."""
    value = options.get("priority")
    if value is None and task_name:
        task = app.tasks.get(task_name)
        value = getattr(task, "priority", None) if task is not None else app.conf.task_default_priority
        if value is None:
            try:
                value = app.amqp.router.route({}, task_name).get("priority")
            except Exception:  # a router of the user's that fails: Celery says so when it sends
                value = None
    if value is None or isinstance(value, bool):
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def publish_to_lane(
    signature: Any,
    headers: dict[str, Any],
    header: str,
    lane: tuple[Any, dict[str, Any]],
    publish: Callable[..., Any],
) -> bool:
    """Publish a handed run (``signature``, decoded for this publish alone) to its queue's lane with
    ``publish(**options)``, its own routing in the handoff header (``headers[header]["rt"]``); with
    priority 0 when its routing keeps its own priority (``pr``: Redis, ``lane_of``). False, with a
    warning, if the broker refused it (then the caller publishes it to its queue as before lanes)."""
    queue, route = lane
    headers[header]["rt"] = route
    own = {
        k: signature.options.pop(k) for k in ("exchange", "routing_key", "queue") if k in signature.options
    }
    urgent = {"priority": URGENT_PRIORITY} if "pr" in route else {}
    try:
        publish(
            headers=headers, queue=queue, exchange=queue.exchange, routing_key=queue.routing_key, **urgent
        )
    except Exception as exc:
        log.warning(
            "could not publish a handoff to the lane %s (publishing to its queue): %s", queue.name, exc
        )
        headers[header].pop("rt", None)
        signature.options.update(own)
        return False
    return True


def restore_route(task: Any, header: str) -> None:
    """Before the body of a run delivered through a lane (``task_prerun``): put its own routing back in
    ``request.delivery_info``, so that its ``Task.retry()``, a park or a copy of it goes to its task
    queue, not to the lane."""
    request = getattr(task, "request", None)
    if request is None:
        return
    headers = getattr(request, "headers", None) or {}
    handoff = headers.get(header) or getattr(request, header, None)
    if not isinstance(handoff, Mapping) or not isinstance(handoff.get("rt"), Mapping):
        return
    info = dict(getattr(request, "delivery_info", None) or {})
    route = handoff["rt"]
    info["exchange"] = str(route.get("exchange") or "")
    info["routing_key"] = str(route.get("routing_key") or "")
    if "pr" in route:  # published to the lane with priority 0 (Redis): its own back
        info["priority"] = route["pr"]
    request.delivery_info = info
