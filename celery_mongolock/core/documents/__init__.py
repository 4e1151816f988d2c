"""The lease document and every filter and update pipeline that touches it: pure functions, no I/O.

``base`` is the single-lease document, the history record and the sweeper's filters; ``queue`` the
parked runs and the handoff; ``slots`` the holds of a ``limit=N`` key; ``slot_queue`` parked runs handed
one of N slots. ``core.store`` sends what these build.
"""
