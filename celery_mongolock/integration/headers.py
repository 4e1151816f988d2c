"""Message headers shared by the beat scheduler (which stamps them) and the task glue (which reads them).

They live here, below both, so that neither imports the other for a name.
"""

from __future__ import annotations

__all__ = ["BEAT_HEADER"]

#: Message header stamped on every task our scheduler sends: {"entry", "tick" (epoch ms), "window" (s)}.
BEAT_HEADER = "mongolock_tick"
