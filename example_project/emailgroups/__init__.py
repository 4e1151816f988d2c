"""An example Celery app: email groups whose members are replaced by CSV uploads, one upload per group
at a time, and a beat-scheduled digest that runs once per tick across the cluster."""

from .celery import app

__all__ = ["app"]
