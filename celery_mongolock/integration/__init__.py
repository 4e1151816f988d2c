"""The Celery integration: the task class and its declaration checks, send stamps and handoff
publishing, signals, the child watch, message headers and settings.
"""
