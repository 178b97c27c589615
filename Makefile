# Two entry points for a fresh clone; each builds .venv first if needed.
#   make demo        train the seed's model in two processes over ZeroMQ
#   make test        run the default test suite, one worker more than the cores (TEST_WORKERS=N: N workers; 0: serially)
#   make test-slow   run the slow set alone (soak, benchmark smoke runs, ...): CI runs it after `make test`
#   make test-all    run both at once
#   make lint        ruff on the repository, then mypy on the whole package: CI runs it
PYTHON ?= python3
VENV ?= .venv
BIN = $(VENV)/bin
# Most tests wait on sockets and child processes rather than compute: one worker more than the cores.
TEST_WORKERS ?= $(shell $(PYTHON) -c 'import os; print((os.cpu_count() or 1) + 1)')
PYTEST = $(BIN)/python -m pytest -n $(TEST_WORKERS)

.PHONY: demo test test-slow test-all lint install clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[test,plot]'
	touch $@

install: $(BIN)/.installed

demo: $(BIN)/.installed
	$(BIN)/distgrad demo

test: $(BIN)/.installed
	$(PYTEST)

test-slow: $(BIN)/.installed
	$(PYTEST) -m slow

test-all: $(BIN)/.installed
	$(PYTEST) -m ''

$(BIN)/.lint-installed: pyproject.toml $(BIN)/.installed
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[lint]'
	touch $@

lint: $(BIN)/.lint-installed
	$(BIN)/ruff check .
	$(BIN)/mypy

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis *.egg-info
