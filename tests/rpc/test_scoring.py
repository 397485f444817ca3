"""Scores and response fields over gRPC equal what the CLI and the engine compute."""

from __future__ import annotations

import json
import random

import pytest
from rpc_requests import random_request, solo, text

from scorer import cli
from scorer.planning import names
from scorer.request import TEMPLATES, ScoreOptions
from scorer.server.convert import request_from_proto
from scorer.v1 import scorer_pb2 as pb

SCHEMES = names()

TOLERANCE = 1e-4


@pytest.mark.parametrize("scheme", SCHEMES)
def test_scores_equal_the_cli_for_every_scheme(scheme, server, scorer_cache, tmp_path, monkeypatch, capsys):
    rng = random.Random(f"cli-{scheme}")
    docs = [{"id": f"doc-{i}", "text": text(rng, rng.randint(2, 12))} for i in range(4)]
    prompt = "which passage explains prefix caching"
    docs_file = tmp_path / "docs.jsonl"
    docs_file.write_text("".join(json.dumps(d) + "\n" for d in docs))
    monkeypatch.setenv("SCORER_CACHE_DIR", str(scorer_cache))
    assert cli.main(["score", "--prompt", prompt, "--docs", str(docs_file), "--scheme", scheme]) == 0
    expected = [json.loads(line) for line in capsys.readouterr().out.splitlines()]

    reply = server.stub().ScoreDocs(
        pb.ScoreDocsRequest(
            prompt=prompt,
            docs=[pb.Doc(id=d["id"], text=d["text"]) for d in docs],
            options=pb.ScoreOptions(scheme=scheme),
        ),
        timeout=30,
    )

    assert reply.scheme == expected[0]["scheme"]
    assert [(r.index, r.id) for r in reply.results] == [(e["index"], e["id"]) for e in expected]
    for r, e in zip(reply.results, expected, strict=True):
        assert r.score == pytest.approx(e["score"], abs=TOLERANCE)


def test_response_carries_usage_timing_model_template_and_label_logprobs(server, engine):
    msg = random_request(random.Random(1), scheme="ragged", request_id="fields-1")
    reply = server.stub().ScoreDocs(msg, timeout=30)
    ref = solo(engine, msg)

    assert (reply.model, reply.template, reply.request_id) == (engine.model_name, "plain", "fields-1")
    u = ref.usage
    assert (reply.usage.prompt_tokens, reply.usage.doc_tokens) == (u.prompt_tokens, u.doc_tokens)
    assert (reply.usage.tokens_computed, reply.usage.tokens_saved) == (u.tokens_computed, u.tokens_saved)
    assert u.tokens_saved > 0 or len(msg.docs) == 1
    t = reply.timing
    assert 0 < t.forward_seconds <= t.total_seconds
    assert 0 < t.tokenize_seconds <= t.total_seconds
    assert 0 <= t.queue_seconds <= t.total_seconds
    for r, d in zip(reply.results, ref.results, strict=True):
        assert list(r.label_logprobs) == pytest.approx(d.label_logprobs, abs=TOLERANCE)
        assert r.doc_tokens == d.doc_tokens


def test_default_template_is_named_and_logprobs_are_opt_in(server):
    reply = server.stub().ScoreDocs(pb.ScoreDocsRequest(prompt="q", docs=[pb.Doc(text="d")]), timeout=30)
    assert reply.template == "qwen3_reranker"
    assert len(reply.results[0].label_logprobs) == 0


def test_top_n_sorts_by_score_and_keeps_input_order_among_ties(server):
    texts = ["alpha beta", "gamma delta", "alpha beta", "epsilon", "gamma delta", "alpha beta"]
    docs = [pb.Doc(id=str(i), text=t) for i, t in enumerate(texts)]
    stub = server.stub()
    full = stub.ScoreDocs(pb.ScoreDocsRequest(prompt="q", docs=docs, options=pb.ScoreOptions(scheme="naive")))
    top = stub.ScoreDocs(
        pb.ScoreDocsRequest(prompt="q", docs=docs, options=pb.ScoreOptions(scheme="naive", top_n=4))
    )

    assert [r.index for r in full.results] == list(range(len(docs)))
    expected = sorted(full.results, key=lambda r: -r.score)[:4]
    assert [r.index for r in top.results] == [r.index for r in expected]
    for a, b in zip(top.results, top.results[1:], strict=False):
        assert a.score > b.score or (a.score == b.score and a.index < b.index)
    assert (
        len(stub.ScoreDocs(pb.ScoreDocsRequest(prompt="q", docs=docs[:2], options={"top_n": 9})).results) == 2
    )


def test_token_ids_score_like_the_text_they_encode(server, engine):
    texts = ["shared prefix attention", "a longer passage about ranking documents"]
    by_text = pb.ScoreDocsRequest(prompt="what is a prefix", docs=[pb.Doc(text=t) for t in texts])
    tokenized = engine.tokenize(request_from_proto(by_text, ""))
    lead = TEMPLATES[ScoreOptions.template].doc_lead
    by_ids = pb.ScoreDocsRequest(
        prompt_token_ids=tokenized.prefix_ids,
        docs=[pb.Doc(token_ids=engine.tokenizer.encode(lead + t, add_special_tokens=False)) for t in texts],
    )
    stub = server.stub()
    a, b = stub.ScoreDocs(by_text, timeout=30), stub.ScoreDocs(by_ids, timeout=30)
    assert [r.score for r in b.results] == pytest.approx([r.score for r in a.results], abs=TOLERANCE)
    assert b.usage.prompt_tokens == a.usage.prompt_tokens


def test_doc_special_tokens_option_reaches_the_tokenizer(server):
    docs = [pb.Doc(text="a <|im_end|> b")]
    stub = server.stub()
    parsed = stub.ScoreDocs(pb.ScoreDocsRequest(prompt="q", docs=docs), timeout=30)
    options = pb.ScoreOptions(doc_special_tokens="text")
    text = stub.ScoreDocs(pb.ScoreDocsRequest(prompt="q", docs=docs, options=options), timeout=30)
    assert text.results[0].doc_tokens > parsed.results[0].doc_tokens


def test_request_id_is_echoed_or_generated_and_stamped_on_the_log(server):
    stub = server.stub()
    given = stub.ScoreDocs(pb.ScoreDocsRequest(prompt="q", docs=[pb.Doc(text="d")], request_id="rid-echo-42"))
    generated = stub.ScoreDocs(pb.ScoreDocsRequest(prompt="q", docs=[pb.Doc(text="d")]))
    assert given.request_id == "rid-echo-42"
    assert len(generated.request_id) == 32 and generated.request_id != given.request_id
    log = server.log()
    assert "request_id=rid-echo-42 " in log
    assert f"request_id={generated.request_id} " in log
