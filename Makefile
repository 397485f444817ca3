# Quick start: `make serve` and `make test`; both create .venv and install on first use, at the exact
# versions of constraints.txt. `make serve` installs what serving needs (the package and its HTTP
# extra); `make test` the dev extra (Ray, the SDKs the tests drive, ruff, ...).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install --progress-bar on --no-compile -c constraints.txt
STAMP := $(VENV)/.installed
SERVE_STAMP := $(VENV)/.installed-serve

.PHONY: setup serve-setup test lint proto proto-check serve score deploy-local clean

setup: $(STAMP)
serve-setup: $(SERVE_STAMP)

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml constraints.txt | $(VENV)/bin/python
	@echo "installing scorer[dev] into $(VENV) (first run: a few minutes)..."
	$(PIP) -q --upgrade pip
	$(PIP) -e '.[dev]'
	touch $(STAMP) $(SERVE_STAMP)

$(SERVE_STAMP): pyproject.toml constraints.txt | $(VENV)/bin/python
	@echo "installing scorer[http] into $(VENV) (first run: a minute or two)..."
	$(PIP) -q --upgrade pip
	$(PIP) -e '.[http]'
	touch $(SERVE_STAMP)

PROTO_GEN = $(PY) -m grpc_tools.protoc -Iproto --python_out=. --grpc_python_out=. --pyi_out=. proto/scorer/v1/scorer.proto

# Generated code is committed (the GPU machine runs the tree as is); CI fails when it is stale.
proto: setup
	$(PROTO_GEN)

proto-check: setup
	@tmp=$$(mktemp -d) && $(PY) -m grpc_tools.protoc -Iproto --python_out=$$tmp --grpc_python_out=$$tmp \
	  --pyi_out=$$tmp proto/scorer/v1/scorer.proto && \
	  for f in scorer_pb2.py scorer_pb2_grpc.py scorer_pb2.pyi; do \
	    cmp -s $$tmp/scorer/v1/$$f scorer/v1/$$f || { echo "scorer/v1/$$f is stale: run make proto"; exit 1; }; \
	  done; rm -rf $$tmp

lint: setup proto-check
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# TEST_WORKERS: pytest-xdist's workers (tests/conftest.py gives each a whole module)
TEST_WORKERS ?= 2
PYTEST := $(PY) -m pytest -q -n $(TEST_WORKERS) --durations=25
# tests/rpc again against servers with two front-end processes: a GPU machine's default split (but
# the modules whose subject does not change with it, tests/rpc/conftest.py's SINGLE_PASS)
test: setup lint
	HYPOTHESIS_PROFILE=ci $(PYTEST)
	SCORER_TEST_SERVER_ARGS="--frontends 2" $(PYTEST) tests/rpc -m "not single_pass"

# SCORE_ARGS: more flags of scorer score (scorer score --help)
score: serve-setup
	$(VENV)/bin/scorer score --prompt "what is a shared prefix" --docs examples/docs.jsonl $(SCORE_ARGS)

# SERVE_ARGS: more flags of scorer serve (scorer serve --help; docs/operating.md)
serve: serve-setup
	$(VENV)/bin/scorer serve --http-port 8080 $(SERVE_ARGS)

# Ray Serve on this machine (CPU replicas): gRPC 127.0.0.1:9000, HTTP :8000/scorer, the replica's
# metrics :9464, Ray's :9465; Ctrl-C stops it. DEPLOY_ARGS: flags and KEY=VALUE ScorerArgs.
deploy-local: setup
	$(PY) -m scorer.ray_local $(DEPLOY_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
