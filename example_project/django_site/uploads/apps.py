from __future__ import annotations

from django.apps import AppConfig


class UploadsConfig(AppConfig):
    name = "uploads"
