"""The version matrix: the store contract suite and the real-worker integration suite on each supported
Celery minor (with its kombu) and on the oldest and newest supported pymongo.

    make matrix                       # every combination (nox, in .nox/)
    python -m nox -t oldest           # the oldest combination, pinned (CI runs it in `make test`)
    python -m nox -s newest           # today's newest releases, unpinned (`make test-newest`)
    python -m nox -l                  # the sessions
    python -m nox -t pythons          # the same suites on Python 3.10, 3.12 and 3.13 (newest releases)
    PYENV_VERSION=3.10.13:3.12.1:3.13.0:system make matrix    # with interpreters installed by pyenv
    python -m nox -s "compat(celery5.4-pymongo4.6)" -- -k overlap    # one, with pytest arguments

`make test`'s own virtualenv has the pinned newest set of requirements/lock.txt (`make lock` remakes it).
"""

from __future__ import annotations

import nox

nox.options.reuse_venv = "yes"
# The `pythons` sessions skip (and say so) where an interpreter is not installed; `compat` runs on the
# interpreter nox runs on, which is always there.
nox.options.error_on_missing_interpreters = False

# Celery minor -> the kombu minor released with it. A new Celery minor goes here and in the README.
CELERY_KOMBU = {"5.3": "5.3", "5.4": "5.4", "5.5": "5.5", "5.6": "5.6", "5.7": "5.7"}
# The pymongo floor of pyproject.toml, and the newest release (unpinned).
PYMONGO = {"4.6": "pymongo~=4.6.0", "newest": "pymongo"}
SUITES = ["tests/test_store_contract.py", "tests/test_integration.py"]
# The two suites side by side, one process each (pytest-xdist, from the test extra), each with servers of
# its own: the session takes as long as the longer suite.
XDIST = ["-n", "3", "--dist", "loadfile"]

OLDEST = ("5.3", "4.6")
NEWEST = ("5.7", "newest")


def _params() -> list[nox.param]:
    params = []
    for celery in CELERY_KOMBU:
        for pymongo in PYMONGO:
            combo = (celery, pymongo)
            tags = ["oldest"] if combo == OLDEST else ["newest"] if combo == NEWEST else []
            label = f"pymongo{pymongo}" if pymongo != "newest" else "pymongo-newest"
            params.append(nox.param(celery, pymongo, id=f"celery{celery}-{label}", tags=tags))
    return params


@nox.session(python=None)  # the interpreter nox runs on
@nox.parametrize(("celery", "pymongo"), _params())
def compat(session: nox.Session, celery: str, pymongo: str) -> None:
    """Store contract + integration suites on one Celery/kombu/pymongo combination."""
    kombu = CELERY_KOMBU[celery]
    # The oldest combination (the one `make test` runs) installs a pinned set, requirements/oldest.txt
    # (`make lock` remakes it), so a new release of anything cannot turn a landing red; the others resolve.
    pins = ["-c", "requirements/oldest.txt"] if (celery, pymongo) == OLDEST else []
    session.install(
        *pins,
        "-e",
        ".[test]",
        f"celery[redis]~={celery}.0",
        f"kombu~={kombu}.0",
        PYMONGO[pymongo],
    )
    _versions(session)
    # The oldest combination runs in every `make test`: its integration suite on Redis only, to keep CI
    # short (the main run has both brokers); the other combinations run on Redis and RabbitMQ.
    env = {"MONGOLOCK_TEST_BROKERS": "redis"} if (celery, pymongo) == OLDEST else {}
    session.run(
        "python", "-m", "pytest", *SUITES, *XDIST, "-p", "no:cacheprovider", "-q", *session.posargs, env=env
    )


@nox.session(python=None, tags=["newest-releases"])
def newest(session: nox.Session) -> None:
    """Store contract + integration suites on today's newest release of every dependency, unpinned
    (`make test-newest`): a new upstream release is found by running this, not by a red landing."""
    session.install("--upgrade", "--upgrade-strategy", "eager", "-e", ".[test]")
    _versions(session)
    session.run("python", "-m", "pytest", *SUITES, *XDIST, "-p", "no:cacheprovider", "-q", *session.posargs)


def _versions(session: nox.Session) -> None:
    session.run(
        "python",
        "-c",
        "import celery, kombu, pymongo, redis; print('versions: celery', celery.__version__, "
        "'kombu', kombu.__version__, 'pymongo', pymongo.__version__, 'redis', redis.__version__)",
    )


@nox.session(python=["3.10", "3.12", "3.13"], tags=["pythons"])
def pythons(session: nox.Session) -> None:
    """Store contract + integration suites on another Python, with the newest Celery, kombu and pymongo."""
    session.install("-e", ".[test]")
    session.run(
        "python",
        "-c",
        "import sys, celery, pymongo; print(sys.version, celery.__version__, pymongo.__version__)",
    )
    session.run("python", "-m", "pytest", *SUITES, *XDIST, "-p", "no:cacheprovider", "-q", *session.posargs)
