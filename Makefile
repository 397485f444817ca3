# Quick start: `make serve` and `make test`; both create .venv and install on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup test lint proto proto-check serve score deploy-local gpu-test clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

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

# tests/rpc again against servers with two front-end processes: a GPU machine's default split
test: setup lint
	HYPOTHESIS_PROFILE=ci $(PY) -m pytest -q
	SCORER_TEST_SERVER_ARGS="--frontends 2" $(PY) -m pytest -q tests/rpc --ignore=tests/rpc/test_frontends.py

score: setup
	$(VENV)/bin/scorer score --prompt "what is a shared prefix" --docs examples/docs.jsonl

serve: setup
	$(VENV)/bin/scorer serve --http-port 8080 $(SERVE_ARGS)

# Ray Serve on this machine (CPU replicas): gRPC 127.0.0.1:9000, HTTP :8000/scorer, the replica's
# metrics :9464, Ray's :9465; Ctrl-C stops it. DEPLOY_ARGS: flags and KEY=VALUE ScorerArgs.
deploy-local: setup
	$(PY) -m scorer.ray_local $(DEPLOY_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
