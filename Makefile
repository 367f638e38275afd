# fGPU Console: `make run` serves the standalone console, `make test` runs the test suite.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PORT ?= 8000
# The test suite runs against real services (see README): PostgreSQL and Redis.
TEST_DATABASE_URL ?= postgres://postgres@127.0.0.1:5432/test
TEST_REDIS_URL ?= redis://127.0.0.1:6379/0

.PHONY: install run test test-fast lint clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip
	$(VENV)/bin/pip install --quiet -e '.[test]'
	touch $@

install: $(VENV)/.installed

run: install
	PORT=$(PORT) $(PY) manage.py standalone

# Lint first: ruff (pyproject.toml [tool.ruff]) on the product code, then import-linter's
# contracts (pyproject.toml [tool.importlinter]: layers that only point down); a violation fails the run.
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports --no-cache
	$(VENV)/bin/mypy && $(VENV)/bin/ruff check --select TID251 tests

test: install lint
	DATABASE_URL=$(TEST_DATABASE_URL) REDIS_URL=$(TEST_REDIS_URL) $(PY) -m tests.services_check
	DATABASE_URL=$(TEST_DATABASE_URL) REDIS_URL=$(TEST_REDIS_URL) $(VENV)/bin/pytest $(PYTEST_ARGS)

# Everything but the tests that start processes and browsers.
test-fast: install
	DATABASE_URL=$(TEST_DATABASE_URL) REDIS_URL=$(TEST_REDIS_URL) $(VENV)/bin/pytest -m "not e2e and not browser" $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) var .pytest_cache
