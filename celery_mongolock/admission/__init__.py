"""The admission engine's policies: what a run that did not get its key does (retry, skip, wait, fail,
queue, replace), whatever the shape of its key set. No Celery here.
"""
