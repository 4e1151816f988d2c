"""Operations: the HA beat scheduler, the ``celery mongolock`` CLI, Celery events, Prometheus metrics,
the embedded server and the testing helpers.
"""
