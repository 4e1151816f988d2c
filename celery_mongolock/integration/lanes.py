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

__all__ = ["LANE_SUFFIX", "add_lanes", "lane_for", "lane_of", "publish_to_lane", "restore_route", "route_of"]

log = logging.getLogger("celery_mongolock.queue")

#: A task queue's handoff lane is named ``<queue>`` + this.
LANE_SUFFIX = ".mongolock-handoff"


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


def lane_of(app: Celery, options: Mapping[str, Any]) -> tuple[Any, dict[str, str]] | None:
    """The lane to publish a handed run to and the run's own routing (``rt`` of the handoff header), or
    None (no lane: turned off, or the run's queue is unknown or gets none)."""
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
    route = {"exchange": str(exchange or ""), "routing_key": str(key or "")}
    if route["exchange"].endswith(LANE_SUFFIX) or route["routing_key"].endswith(LANE_SUFFIX):
        # A run that came through a lane and was parked again without ``restore_route``: its own queue.
        route = {"exchange": queue.exchange.name if queue.exchange is not None else "", "routing_key": ""}
        route["routing_key"] = str(queue.routing_key or queue.name)
    return lane_for(queue), route


def publish_to_lane(
    signature: Any,
    headers: dict[str, Any],
    header: str,
    lane: tuple[Any, dict[str, str]],
    publish: Callable[..., Any],
) -> bool:
    """Publish a handed run (``signature``, decoded for this publish alone) to its queue's lane with
    ``publish(**options)``, its own routing in the handoff header (``headers[header]["rt"]``); False, with
    a warning, if the broker refused it (then the caller publishes it to its queue as before lanes)."""
    queue, route = lane
    headers[header]["rt"] = route
    own = {
        k: signature.options.pop(k) for k in ("exchange", "routing_key", "queue") if k in signature.options
    }
    try:
        publish(headers=headers, queue=queue, exchange=queue.exchange, routing_key=queue.routing_key)
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
    request.delivery_info = info
