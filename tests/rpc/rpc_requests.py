"""Requests for the RPC tests, and their scores computed in process as the reference."""

from __future__ import annotations

import random

from scorer.engine import Engine, ScoreResult
from scorer.planning import names
from scorer.server.convert import request_from_proto
from scorer.v1 import scorer_pb2 as pb

SCHEMES = names()

FAULT_PROMPT = "please fail this batch"  # the shared server's --debug-fault-prompt
MAIN_SERVER_ARGS = ("--max-wait-ms", "20", "--max-docs", "64", "--debug-fault-prompt", FAULT_PROMPT)
"""The shared servers' settings (conftest's ``server``, test_frontends' split one)."""

WORDS = [
    *("prefix", "cache", "attention", "kernel", "ranking", "query", "document", "shared", "token"),
    *("batch", "score", "model", "layer", "search", "engine", "relevance", "passage", "answer"),
    *("vector", "index", "latency", "throughput", "memory"),
]


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def random_request(
    rng: random.Random, scheme: str | None = None, request_id: str = ""
) -> pb.ScoreDocsRequest:
    """A small request (the plain template, 1-8 docs of 1-12 words), with a random scheme unless one
    is given: the torch reference attention on a CPU makes tokens dear."""
    docs = [pb.Doc(id=f"d{i}", text=text(rng, rng.randint(1, 12))) for i in range(rng.randint(1, 8))]
    options = pb.ScoreOptions(
        scheme=scheme if scheme is not None else rng.choice(SCHEMES),
        template="plain",
        score_mode=rng.choice(("", "softmax", "logprob")),
        group_size=rng.choice((0, 2, 3)),
        return_label_logprobs=True,
    )
    return pb.ScoreDocsRequest(
        prompt=text(rng, rng.randint(1, 6)), docs=docs, options=options, request_id=request_id
    )


def solo(engine: Engine, msg: pb.ScoreDocsRequest) -> ScoreResult:
    """The request scored alone, in process, by the same checkpoint."""
    return engine.score(request_from_proto(msg, msg.request_id))
