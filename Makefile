# The two commands a new user needs: `make demo` and `make test`. Each sets itself up (a virtualenv in
# .venv with the project and its extras installed) on a machine that has nothing but Python 3.10+.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint typecheck docs unit bench clean venv matrix lock test-newest

venv: $(STAMP)

# Installs the pinned set of requirements/lock.txt (every package, transitive ones included), so a fresh
# clone tests what the last landing tested whatever was released since. PIP_CONSTRAINT (not -c) so that the
# build backend, hatchling (in the lock through the release extra), is pinned in pip's build environment too.
LOCK := requirements/lock.txt
$(STAMP): pyproject.toml $(LOCK)
	$(PYTHON) -m venv $(VENV)
	PIP_CONSTRAINT=$(LOCK) $(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

# Remake the pinned sets from pyproject.toml with today's releases (uv, from the dev extra): lock.txt, the
# newest supported set that `make test` installs (one file for every Python from 3.10: markers where they
# differ), and oldest.txt, the oldest supported Celery, kombu and pymongo (requirements/oldest.in) that
# `nox -t oldest` installs. Then run `make test` and commit both files.
UV_COMPILE = $(VENV)/bin/uv pip compile --quiet --universal --python-version 3.10 --upgrade
lock: $(STAMP)
	$(UV_COMPILE) pyproject.toml --extra dev -o $(LOCK)
	$(UV_COMPILE) pyproject.toml requirements/oldest.in --extra test -o requirements/oldest.txt

# Today's newest releases, unpinned (nox, in .nox/newest): the store contract and real-worker integration
# suites. Finds out whether an upstream release breaks us before `make lock` moves the pins to it.
test-newest: $(STAMP)
	$(PY) -m nox -s newest $(NOX_ARGS)

# `make demo BROKER=rabbitmq`: the same demo on a RabbitMQ node started for it (rabbitmq-server installed).
BROKER ?= redis
demo: $(STAMP)
	$(PY) example_project/demo.py --broker $(BROKER)

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check $(wildcard celery_mongolock tests example_project benchmarks)
	$(VENV)/bin/lint-imports  # imports flow one way, no cycles, no Celery in the lease core ([tool.importlinter])
	$(PY) scripts/shape.py  # the largest modules and functions; fails on a call of another module's private name

typecheck: $(STAMP)
	$(PY) -m mypy

# The documentation site (docs/, mkdocs.yml) into site/; --strict turns every warning (a broken link, a
# docstring the API reference cannot render, a page missing from the nav) into an error. CI builds it as
# part of `make test`. (Not --quiet: it hides the warnings from the strict check, which then passes.)
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir site

# The suite runs in four processes (pytest-xdist), each file's tests in one of them, with servers of its
# own; tests/conftest.py hands out the longest files first. Four on two cores: the tests mostly wait (on
# leases, workers, brokers); three instead of two took the run from 17 to 12 minutes, four instead of three
# (CHANGELOG). `make test PYTEST_XDIST=` runs it in one process.
PYTEST_XDIST ?= -n 4 --dist loadfile --no-loadscope-reorder
# (lint, typecheck and docs side by side: mypy alone takes a minute on a fresh clone.) The oldest versions'
# suites (nox -t oldest: its install, then 111 tests in three processes that mostly wait) run beside all of
# it, their output into $(OLDEST_LOG), shown when they end: run after pytest, they added 3 minutes.
OLDEST_LOG := .nox-oldest.log
test: $(STAMP)
	@$(PY) -m nox --tags oldest > $(OLDEST_LOG) 2>&1 & oldest=$$!; status=0; \
	echo "nox --tags oldest: running beside the rest (pid $$oldest, output in $(OLDEST_LOG))"; \
	$(MAKE) --no-print-directory -j3 --output-sync=target lint typecheck docs \
	&& $(PY) -m pytest $(PYTEST_XDIST) --durations=25 $(PYTEST_ARGS) || status=$$?; \
	wait $$oldest || { oldest_status=$$?; [ $$status -ne 0 ] || status=$$oldest_status; }; \
	echo "---- nox --tags oldest ($(OLDEST_LOG)) ----"; cat $(OLDEST_LOG); exit $$status

# The version matrix (noxfile.py): the store contract and integration suites on every Celery minor from 5.3
# to 5.7 (each with its kombu) and on pymongo 4.6 and the newest, each in a virtualenv of its own in .nox/
# (about 2.5 minutes a combination). `make test` runs the oldest one; its own .venv has the newest.
matrix: $(STAMP)
	$(PY) -m nox $(NOX_ARGS)

# All the benchmarks, side by side, into benchmarks/results/ (REPORT.md): about 20 minutes.
# `make bench BENCH_ARGS=--quick` for a 4-minute run. The peers compared come from the `bench` extra.
bench: $(STAMP)
	$(PY) -c "import celery_singleton, celery_once" 2>/dev/null || $(PY) -m pip install --quiet -e '.[bench]'
	$(PY) benchmarks/run.py $(BENCH_ARGS)

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache site .nox
