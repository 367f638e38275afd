# fGPU Console: `make run` serves the standalone console, `make test` runs the test suite.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PORT ?= 8000
# The test suite runs against real services (see README): PostgreSQL and Redis.
TEST_DATABASE_URL ?= postgres://postgres@127.0.0.1:5432/test
TEST_REDIS_URL ?= redis://127.0.0.1:6379/0
# The tests' processes (pytest and the uvicorn, Celery, agent and standalone processes it starts) keep their
# bytecode, and pytest its assertion-rewritten modules (every module of a pytest plugin's package, Schemathesis'
# 350 among them), under var/pycache even where the environment sets PYTHONDONTWRITEBYTECODE: collecting the
# suite took 15 s instead of 24 s, and each started process 0.25 s less CPU (the machine of issue 34.5).
TEST_ENV = DATABASE_URL=$(TEST_DATABASE_URL) REDIS_URL=$(TEST_REDIS_URL) PYTHONDONTWRITEBYTECODE= PYTHONPYCACHEPREFIX=$(CURDIR)/var/pycache

.PHONY: install run image test test-fast lint clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip
	$(VENV)/bin/pip install --quiet -e '.[test]'
	touch $@

install: $(VENV)/.installed

run: install
	PORT=$(PORT) $(PY) manage.py standalone

# The session image of the docker runtime, fgpu-session:latest (also tagged fgpu-session:test), built from
# Debian's packages with mmdebstrap, no registry needed: as root, about 5 minutes, its progress shown.
image:
	tests/images/build.sh

# Lint first; a violation fails the run. On the product code (pyproject.toml [tool.ruff]): ruff's lint
# and its formatter (`ruff format .` fixes what --check finds), import-linter's contracts
# ([tool.importlinter]: layers that only point down), mypy with django-stubs ([tool.mypy]).
# On the tests: no time.sleep waits (ruff's TID251).
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports --no-cache
	$(VENV)/bin/mypy
	$(VENV)/bin/ruff check --select TID251 tests

test: install lint
	$(TEST_ENV) $(PY) -m tests.services_check
	$(TEST_ENV) $(VENV)/bin/pytest $(PYTEST_ARGS)

# Everything but the tests that start processes and browsers.
test-fast: install
	$(TEST_ENV) $(VENV)/bin/pytest -m "not e2e and not browser" $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) var .pytest_cache
