"""A hold's write to its protected document, tried again on a driver error: the one retry loop of the
lock-set checker's holds (``lockcheck._write``, ``lockcheck.run_slot_hold``,
``lockcheck_mixed.run_mixed_hold``)."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any

from pymongo.collection import Collection
from pymongo.errors import PyMongoError

__all__ = ["resolved_after_fenced_retry", "write_retrying"]


def write_retrying(
    write: Callable[[], bool], fenced: type[Exception], docs: Collection[Any], key: str, op: str
) -> tuple[str, bool]:
    """A hold's write of the op ``op`` to ``key``'s protected document in ``docs``, tried again on a
    driver error for up to 8 s: ``(outcome, retried)``, outcome ``ack`` (applied), ``ack-earlier`` (an
    earlier try applied it: the filter on the op's id refused it), ``fenced`` (``fenced`` raised: a newer
    hold wrote) or ``ambiguous`` (no answer in time). ``write`` returns whether it matched the document."""
    give_up, retried = time.monotonic() + 8.0, False
    while True:
        try:
            return ("ack" if write() else "ack-earlier"), retried
        except fenced:
            if retried:
                # An earlier attempt whose reply was lost may have been applied before the fence moved
                # (a cancel_running supersession, a newer holder): then the filter excluded the
                # document, and the fence check answered. The document says which (ci21: a holder's
                # write applied, its reply lost to a fault, the retry fenced out and reported fenced).
                return resolved_after_fenced_retry(docs, key, op), retried
            return "fenced", retried
        except PyMongoError:
            retried = True
            if time.monotonic() > give_up:
                return "ambiguous", retried
            time.sleep(0.1 + random.random() * 0.2)


def resolved_after_fenced_retry(docs: Collection[Any], key: str, op: str) -> str:
    """A retried write fenced out: ``ack-earlier`` if the document holds ``op`` (an earlier attempt was
    applied), ``fenced`` if it does not, ``ambiguous`` if it cannot be read."""
    try:
        return "ack-earlier" if docs.find_one({"_id": key, "log.o": op}, {"_id": 1}) else "fenced"
    except PyMongoError:
        return "ambiguous"
