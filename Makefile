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

.PHONY: install install-test jupyterlab run image test test-fast lint clean

# `make run` installs only what the console needs to run: pyproject.toml's dependencies, their progress shown. The test
# and lint tools are the `test` extra, which `make test`, `make lint`, `make test-fast` and `make install-test` add
# (issue 35.4). A stamp per step: nothing is installed again until pyproject.toml changes.
#
# The installer (issue 35.4): uv (`pip install uv`, https://docs.astral.sh/uv/) where it is on PATH and pip names no
# index, links or constraints of its own (`pip config list`, PIP_*: uv reads none of pip's configuration), else pip. On
# PyPI alone uv resolves the same 56 packages at the same versions as pip (compared 2026-11-28, uv 0.13.9), in about
# 3.5 CPU-s where pip spends 29 (benchmarks/results/first_run.txt); where uv fails, pip installs. UV=no: pip always.
# Neither compiles bytecode at install (pip --no-compile: 13 of its 29 CPU-s): the console compiles what it imports at its
# first start, and `make run` compiles the rest in the background at low priority (.venv/.compiled).
UV ?= uv
PIP_OWN_CONFIG = index-url|extra-index-url|find-links|no-index|constraint
# The installer .venv was made with ("pip" or uv's path), for the extras installed later.
VENV_INSTALL = installer="$$(cat $(VENV)/.installer 2>/dev/null)"; \
  if [ -n "$$installer" ] && [ "$$installer" != pip ]; then set -- env VIRTUAL_ENV=$(VENV) "$$installer" pip install; \
  else set -- $(VENV)/bin/pip install --no-compile --progress-bar on; fi; "$$@"
$(VENV)/.installed: pyproject.toml
	@echo "Installing what the console needs to run into $(VENV) (Django, Celery, NumPy, SciPy, ...: about 10 s with uv, 1 min with pip on 2 cores with the packages at hand). Its progress follows."
	@uv="$$(command -v $(UV) 2>/dev/null)"; \
	if [ -n "$$uv" ] && config="$$($(PYTHON) -m pip config list 2>/dev/null)" \
	    && ! printf '%s\n' "$$config" | grep -qE '^[^=]*\.($(PIP_OWN_CONFIG))='; then \
	  echo "with uv ($$uv; UV=no installs with pip)"; \
	  "$$uv" venv --seed --allow-existing --python "$$($(PYTHON) -c 'import sys; print(sys.executable)')" $(VENV) \
	    && VIRTUAL_ENV=$(VENV) "$$uv" pip install -e . && echo "$$uv" >$(VENV)/.installer && exit 0; \
	  echo "uv could not install it: installing with pip"; \
	fi; \
	set -x; $(PYTHON) -m venv $(VENV) && $(VENV)/bin/pip install --no-compile --progress-bar on -e . && echo pip >$(VENV)/.installer
	touch $@

install: $(VENV)/.installed

$(VENV)/.installed-test: $(VENV)/.installed
	@echo "Installing the test and lint tools (the test extra: pytest, Playwright, Schemathesis, ruff, mypy, import-linter, JupyterLab, ...; about 1-2 min with pip's cache warm) into $(VENV)."
	@$(VENV_INSTALL) -e '.[test]'
	-$(PY) -m compileall -q -j 0 $(VENV)/lib >/dev/null
	touch $@ $(VENV)/.installed-jupyter $(VENV)/.compiled

install-test: $(VENV)/.installed-test

# JupyterLab, the demo's session app (README's walkthrough, step 4): the `jupyter` extra, without reinstalling the
# console itself (its requirements read from pyproject.toml), then its bytecode (a session's JupyterLab would otherwise
# compile its modules at each start where the environment sets PYTHONDONTWRITEBYTECODE).
$(VENV)/.installed-jupyter: $(VENV)/.installed
	@$(VENV_INSTALL) $$($(PY) -c "import tomllib; print(*tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['jupyter'])")
	-$(PY) -m compileall -q -j 0 $(VENV)/lib >/dev/null
	touch $@ $(VENV)/.compiled

jupyterlab: $(VENV)/.installed-jupyter

# The first page does not wait for JupyterLab: where it is missing, it installs in the background at low priority
# (about 1 min; its log in .venv/jupyterlab-install.log; one at a time, flock) while the console starts. JUPYTERLAB=no
# skips it. Nor for the bytecode the install left out: compiled in the background alike (nice 19, once an install).
# The console writes its own bytecode even where the environment sets PYTHONDONTWRITEBYTECODE: every start compiled
# the project's modules again otherwise (about 1 CPU-s of a restart's 2.2) and, after an install without bytecode,
# every module it imports.
JUPYTERLAB ?= yes
# DEMO=full adds the demo's second node, demo-mig-node (one mock H100 80GB, in dynamic MIG mode at its first start):
# the launch dialog's MIG tab; and a third, demo-rocm-node (two mock AMD MI250 of the rocm slot, discrete mode): its
# Whole GPUs tab (README, The walkthrough; `manage.py standalone --demo full`).
DEMO ?=
run: install
	@if [ "$(JUPYTERLAB)" = yes ] && { [ ! -e $(VENV)/.installed-jupyter ] || [ $(VENV)/.installed -nt $(VENV)/.installed-jupyter ]; }; then \
	  echo "JupyterLab (the walkthrough's step 4) installs in the background, about 1 min: its log is $(VENV)/jupyterlab-install.log"; \
	  nohup nice -n 19 flock -n $(VENV)/.jupyterlab.lock $(MAKE) --no-print-directory jupyterlab >>$(VENV)/jupyterlab-install.log 2>&1 </dev/null & \
	elif [ ! -e $(VENV)/.compiled ] || [ $(VENV)/.installed -nt $(VENV)/.compiled ]; then \
	  nohup nice -n 19 flock -n $(VENV)/.jupyterlab.lock sh -c '$(PY) -m compileall -q -j 0 $(VENV)/lib; touch $(VENV)/.compiled' \
	    >/dev/null 2>&1 </dev/null & \
	fi
	PYTHONDONTWRITEBYTECODE= PORT=$(PORT) $(PY) manage.py standalone$(if $(DEMO), --demo=$(DEMO))

# The session image of the docker runtime, fgpu-session:latest (also tagged fgpu-session:test), built from
# Debian's packages with mmdebstrap, no registry needed: as root, about 5 minutes, its progress shown.
image:
	tests/images/build.sh

# Lint first; a violation fails the run. On the product code (pyproject.toml [tool.ruff]): ruff's lint
# and its formatter (`ruff format .` fixes what --check finds), import-linter's contracts
# ([tool.importlinter]: layers that only point down), mypy with django-stubs ([tool.mypy]).
# On the tests: no time.sleep waits (ruff's TID251).
lint: install-test
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports --no-cache
	$(VENV)/bin/mypy
	$(VENV)/bin/ruff check --select TID251 tests

# XDIST=N runs the suite in N pytest-xdist workers (issue 34.5), a test module in one worker (--dist loadfile: its
# module fixtures start once), each worker with a test database, Redis databases and a cgroup tag of its own
# (tests/xdist_worker.py, which -p loads before Django's settings; PYTHONPATH lets it be found); then the tests marked
# `serial` (tests/conftest.py SERIAL: faults, the multi-host bed, the process races) in one process, alone. The run
# fails if either part fails; a part that selects no test (pytest's exit 5, with a PYTEST_ARGS that names one file)
# does not. XDIST=0, the default: the whole suite in one process, in collection order. Not yet the default: four
# fresh-clone runs with XDIST=3 took 21 min against 31-38 in one process, but each met other tests that fail only
# beside others (README's Tests).
XDIST ?= 0
XDIST_ARGS = -p tests.xdist_worker -n $(XDIST) --dist loadfile

test: install-test lint
	$(TEST_ENV) $(PY) -m tests.services_check
ifeq ($(XDIST),0)
	$(TEST_ENV) $(VENV)/bin/pytest $(PYTEST_ARGS)
else
	@rc=0; \
	echo "The suite in $(XDIST) workers, then the serial tests alone (XDIST=0: all in one process)"; \
	$(TEST_ENV) PYTHONPATH=$(CURDIR) $(VENV)/bin/pytest $(XDIST_ARGS) -m "not serial" $(PYTEST_ARGS) || \
	  { r=$$?; [ $$r -eq 5 ] || rc=$$r; }; \
	$(TEST_ENV) $(VENV)/bin/pytest -m serial $(PYTEST_ARGS) || { r=$$?; [ $$r -eq 5 ] || rc=$$r; }; \
	exit $$rc
endif

# Everything but the tests that start processes and browsers.
test-fast: install-test
	$(TEST_ENV) $(VENV)/bin/pytest -m "not e2e and not browser" $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) var .pytest_cache
