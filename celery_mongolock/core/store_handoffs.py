"""Handoffs made by the lease store's commands: the callbacks that publish the run a command of this
process handed a key (or a slot of it) to, and how such a command marks the handoff it makes.

A part of ``LeaseStore`` (``store``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from celery_mongolock.core.documents.base import Document

__all__ = ["HandoffCallback", "Handoffs"]

log_release = logging.getLogger("celery_mongolock.release")

#: ``callback(key, entry, document)``: publish the run a command of this process handed ``key`` to.
HandoffCallback = Callable[[str, Document, Document], None]


class Handoffs:
    """The handoff callbacks of one store, and the publishing of the handoffs its commands make."""

    def __init__(self) -> None:
        self.callbacks: list[HandoffCallback] = []
        #: Called with every reply ``publish`` is given, published or not (the spill's refill: a key
        #: whose window of parked runs runs low after a handoff is refilled from its spilled runs).
        self.after_reply: Callable[[str, Mapping[str, Any]], object] | None = None

    def add_callback(self, callback: HandoffCallback) -> None:
        """``LeaseStore.add_handoff_callback``."""
        if callback not in self.callbacks:
            self.callbacks.append(callback)

    def by(self, token: str) -> str:
        """How a releasing command of this process marks a handoff it makes: with its token when this
        process publishes handoffs (a callback), else unmarked, so that a worker's sweeper adopts and
        publishes it at its next pass (a marked one would wait until it expired unclaimed)."""
        return token if self.callbacks else ""

    def publish(
        self, key: str, doc: Mapping[str, Any] | None, by: str, *, refill: bool = True
    ) -> Document | None:
        """If the command whose reply is ``doc`` handed ``key`` (or slots of it) to parked runs, publish
        those runs. Returns the (last) handoff published. Then (``refill``) ``after_reply``."""
        try:
            return self._publish(key, doc, by)
        finally:
            if refill and doc and doc.get("sp") and self.after_reply is not None:
                self.after_reply(key, doc)

    def _publish(self, key: str, doc: Mapping[str, Any] | None, by: str) -> Document | None:
        if not by:
            return None
        found = [(ho, (doc or {}).get("fence")) for ho in [(doc or {}).get("ho")]]
        found += [(h.get("ho"), h.get("f")) for h in (doc or {}).get("hs") or [] if isinstance(h, dict)]
        published: Document | None = None
        for ho, fence in found:
            if not isinstance(ho, dict) or ho.get("by") != by:
                continue
            log_release.info("lease %r handed to %s (fence %s)", key, ho.get("t"), fence)
            for callback in list(self.callbacks):
                try:
                    callback(key, ho, dict(doc or {}))
                except Exception:
                    log_release.exception("publishing the handoff of %r to %s failed", key, ho.get("t"))
            published = ho
        return published
