"""The lease document and every filter and update pipeline that touches it: pure functions, no I/O.

``base`` is the single-lease document (acquire, renew, release); ``reading`` the documents as read and
``records`` the history's records. Queued runs: ``key_state`` (who holds the key, whether something
waits, how long it is kept), ``entries`` (a parked run's entry), ``copies`` (the duplicate guard),
``handoff`` (a key handed to the oldest parked run, the sweeper's command), ``admit_stages`` (the admit's
stages, one engine for both key shapes), ``queue`` (the admit of a key held as one lease), ``sets``
(``Replace`` with ``keys=``). ``limit=N`` keys: ``slots`` (the holds), ``slot_queue`` (slots handed to
parked runs), ``slot_admit`` (the admit of a run on such a key), ``slot_reserve`` and ``slot_sets``.
``core.store`` sends what these build.
"""
