# Quick start: `make serve` and `make test`; both create .venv and install on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup test lint serve score gpu-test clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test: setup lint
	HYPOTHESIS_PROFILE=ci $(PY) -m pytest -q

score: setup
	$(VENV)/bin/scorer score --prompt "what is a shared prefix" --docs examples/docs.jsonl

serve: setup
	$(VENV)/bin/scorer score --prompt "what is a shared prefix" --docs examples/docs.jsonl

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
