"""The package's version: the one place it is written (pyproject.toml reads it through hatch)."""

from __future__ import annotations

__version__ = "0.1.0.dev0"
