# The two commands a new user needs:  `make run` (set up, then open Sluice) and `make test`.
# `make run ARGS=--headless` runs the default workflow without the GUI.
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed-stamp

.PHONY: run test lint

$(STAMP): pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --upgrade --quiet pip
	$(VENV)/bin/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/sluice $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check engine nodes app tests bench tools

test: $(STAMP)
	$(VENV)/bin/ruff check engine nodes app tests bench tools
	QT_QPA_PLATFORM=offscreen $(VENV)/bin/python -m pytest -q
