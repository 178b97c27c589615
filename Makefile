# Two entry points for a fresh clone; each builds .venv first if needed.
#   make demo   train the seed's model in two processes over ZeroMQ
#   make test   run the test suite
PYTHON ?= python3
VENV ?= .venv
BIN = $(VENV)/bin

.PHONY: demo test test-all install clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[test,plot]'
	touch $@

install: $(BIN)/.installed

demo: $(BIN)/.installed
	$(BIN)/distgrad demo

test: $(BIN)/.installed
	$(BIN)/python -m pytest

test-all: $(BIN)/.installed
	$(BIN)/python -m pytest -m ''

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis *.egg-info
