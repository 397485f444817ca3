"""The engine on the embedded tiny model: every scheme equals naive, sharing is counted, bad
input names its field."""

import math
import random

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from scorer.engine import Engine, EngineConfig
from scorer.models.graphs import GraphedDecoder
from scorer.planning import REGISTRY, get
from scorer.request import Doc, InvalidInput, Limits, ScoreOptions, ScoreRequest, tokenize
from scorer.runner import ModelRunner
from scorer.runtime import build_engine

SCHEMES = [s for s in REGISTRY if s != "naive"]
VOCAB = 256  # plain byte tokens of the tiny tokenizer


def RAGGED(shape, options):  # noqa: N802 (a resolver for tokenize() alone)
    return get("ragged"), 0


def ids_request(prompt_ids, docs_ids, scheme, **options) -> ScoreRequest:
    return ScoreRequest(
        prompt="",
        prompt_token_ids=tuple(prompt_ids),
        docs=[Doc(token_ids=tuple(d), id=f"d{i}") for i, d in enumerate(docs_ids)],
        options=ScoreOptions(scheme=scheme, template="plain", **options),
    )


def random_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


def logprobs(result) -> torch.Tensor:
    return torch.tensor([d.label_logprobs for d in result.results], dtype=torch.float64)


request_st = st.builds(
    lambda seed, p, lens: (seed, p, lens),
    st.integers(0, 2**16),
    st.integers(1, 300),
    st.lists(st.integers(1, 80), min_size=1, max_size=40),
)


@given(req=request_st, scheme=st.sampled_from(SCHEMES), group=st.integers(1, 9))
@example(req=(0, 300, [80] * 40), scheme="multi_item", group=1)
@example(req=(1, 1, [1]), scheme="cascade", group=1)
@example(req=(2, 37, [1] * 40), scheme="grouped", group=7)
@example(req=(3, 5, [3]), scheme="split_cache", group=1)
def test_every_scheme_scores_equal_naive(engine, req, scheme, group):
    seed, p, lens = req
    rng = random.Random(seed)
    prompt, docs = random_ids(rng, p), [random_ids(rng, n) for n in lens]
    expected = engine.score(ids_request(prompt, docs, "naive"))
    got = engine.score(ids_request(prompt, docs, scheme, group_size=group))
    assert got.scheme == scheme
    torch.testing.assert_close(logprobs(got), logprobs(expected), atol=1e-4, rtol=0)
    assert [d.score for d in got.results] == pytest.approx([d.score for d in expected.results], abs=1e-4)


@given(
    seed=st.integers(0, 2**16), schemes=st.lists(st.sampled_from(SCHEMES + ["naive"]), min_size=2, max_size=5)
)
def test_score_does_not_depend_on_batch_or_doc_order(engine, seed, schemes):
    rng = random.Random(seed)
    reqs = [
        ids_request(
            random_ids(rng, rng.randint(1, 60)), [random_ids(rng, rng.randint(1, 30)) for _ in range(5)], s
        )
        for s in schemes
    ]
    alone = [engine.score(r) for r in reqs]
    together = engine.score_batch([engine.tokenize(r) for r in reqs])
    for a, b in zip(alone, together, strict=True):
        torch.testing.assert_close(logprobs(b), logprobs(a), atol=1e-4, rtol=0)
    perm = list(range(5))
    rng.shuffle(perm)
    shuffled = ids_request(reqs[0].prompt_token_ids, [reqs[0].docs[i].token_ids for i in perm], schemes[0])
    torch.testing.assert_close(logprobs(engine.score(shuffled)), logprobs(alone[0])[perm], atol=1e-4, rtol=0)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_prompt_passes_through_the_model_once(engine, scheme):
    rng = random.Random(7)
    prompt, docs = random_ids(rng, 50), [random_ids(rng, n) for n in (3, 9, 4, 1)]
    engine.runner.stats.clear()
    engine.runner.backend.stats.clear()
    result = engine.score(ids_request(prompt, docs, scheme))
    layers = engine.runner.model.config.num_layers
    assert engine.runner.stats["tokens_computed"] == 50 + 17 == result.usage.tokens_computed
    assert result.usage.tokens_saved == 3 * 50
    assert engine.runner.stats["lm_head_rows"] == 4
    assert engine.runner.stats["forward_passes"] == (2 if scheme == "split_cache" else 1)
    if scheme == "cascade":
        assert engine.runner.backend.stats == {"calls": 3 * layers, "merges": layers}


def test_naive_recomputes_the_prompt_per_doc(engine):
    engine.runner.stats.clear()
    result = engine.score(ids_request([1] * 50, [[2] * 3, [3] * 4], "naive"))
    assert engine.runner.stats["tokens_computed"] == 2 * 50 + 7 == result.usage.tokens_computed


def test_copy_share_is_what_a_split_calls_pool_copies_cost_in_rows():
    """C on Qwen3-0.6B (100 + 50 x 400, split in two) recomputes its prompt: 100 rows <= 0.043 x
    20,100; on 8B the copies are cheap and a 100-token prompt is reused (0.0035 x 20,100 = 70)."""
    from bench.throughput import MODELS
    from scorer.config import ModelConfig
    from scorer.engine import copy_share

    def share(name: str) -> float:
        return copy_share(ModelConfig.from_hf({**MODELS[name], "architectures": ["Qwen3ForCausalLM"]}))

    assert share("qwen3-0.6b") == pytest.approx(0.043, abs=0.001)
    assert share("qwen3-8b") == pytest.approx(0.0035, abs=0.0002)


@pytest.mark.parametrize("share", [0.0, 1.0])
def test_request_over_the_token_budget_is_split_and_still_exact(tmp_path, monkeypatch, engine, share):
    """Split passes reuse the prompt's K/V from a pool, or (``share`` 1: recomputing 40 of 120
    rows is within it) compute it again in each pass and need no pool."""
    monkeypatch.setenv("SCORER_CACHE_DIR", str(tmp_path))
    cfg = EngineConfig(max_tokens_per_pass=60, prompt_recompute_share=share)
    small = build_engine(attention_backend="torch", config=cfg)
    rng = random.Random(3)
    prompt, docs = random_ids(rng, 40), [random_ids(rng, 10) for _ in range(8)]
    for scheme in ("multi_item", "ragged", "cascade"):
        small.runner.stats.clear()
        got = small.score(ids_request(prompt, docs, scheme))
        passes = small.runner.stats["forward_passes"]
        assert passes > 1
        assert small.runner.stats["tokens_computed"] == (40 + 80 if share == 0 else 40 * passes + 80)
        assert got.usage.tokens_computed == small.runner.stats["tokens_computed"]
        assert got.usage.tokens_saved == 40 * 8 + 80 - got.usage.tokens_computed
        assert small.runner.stats["pooled_forwards"] == (share == 0)
        torch.testing.assert_close(
            logprobs(got), logprobs(engine.score(ids_request(prompt, docs, "naive"))), atol=1e-4, rtol=0
        )


def test_score_modes_and_label_ids(engine):
    req = ids_request([5, 6, 7], [[8, 9], [10]], "ragged")
    soft = engine.score(req)
    for d in soft.results:
        yes, no = d.label_logprobs
        assert d.score == pytest.approx(math.exp(yes) / (math.exp(yes) + math.exp(no)))
    logp = engine.score(ids_request([5, 6, 7], [[8, 9], [10]], "ragged", score_mode="logprob"))
    assert [d.score for d in logp.results] == [d.label_logprobs[0] for d in soft.results]
    yes_id = engine.tokenizer.convert_tokens_to_ids("yes")
    by_id = engine.score(
        ids_request([5, 6, 7], [[8, 9], [10]], "ragged", label_token_ids=(yes_id,), score_mode="logprob")
    )
    assert [d.label_logprobs[0] for d in by_id.results] == [d.label_logprobs[0] for d in soft.results]


def test_qwen3_reranker_template_layout(engine):
    req = ScoreRequest("what is rope", [Doc("rotary embeddings")], instruction="Find it")
    t = engine.tokenize(req)
    text = engine.tokenizer.decode(list(t.prefix_ids) + list(t.items[0]))
    assert text.startswith("<|im_start|>system\nJudge whether the Document meets the requirements")
    assert "<Instruct>: Find it\n<Query>: what is rope\n<Document>: rotary embeddings<|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert engine.tokenizer.decode(list(t.items[0])).startswith("<Document>:")
    assert t.label_ids == (
        engine.tokenizer.convert_tokens_to_ids("yes"),
        engine.tokenizer.convert_tokens_to_ids("no"),
    )


def test_cli_scores_a_file_in_input_order(engine, tmp_path, capsys):
    import json

    from scorer.cli import main

    path = tmp_path / "docs.jsonl"
    path.write_text('{"text": "alpha beta", "id": "a"}\n\n{"text": "gamma"}\n')
    assert main(["score", "--prompt", "greek letters", "--docs", str(path), "--scheme", "multi_item"]) == 0
    out = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(o["index"], o["id"], o["scheme"]) for o in out] == [
        (0, "a", "multi_item"),
        (1, "1", "multi_item"),
    ]
    direct = engine.score(ScoreRequest("greek letters", [Doc("alpha beta"), Doc("gamma")]))
    assert [o["score"] for o in out] == pytest.approx([d.score for d in direct.results], abs=1e-6)


LIMITS = Limits(max_docs=4, max_doc_tokens=10, max_positions=40, vocab_size=512)
BIG = Limits(max_docs=4, max_doc_tokens=10**6, max_positions=10**6, vocab_size=512)


def text_of(n: int, letter: str = "x") -> str:
    """Text of exactly ``n`` tokens of the embedded tokenizer: ``letter`` and then ``n - 1`` times
    " " + ``letter``, each one token (the pre-tokenizer splits at spaces; checked below)."""
    return " ".join([letter] * n)


def test_text_of_has_the_token_counts_it_says(engine):
    for letter in "xyp":
        for n in (1, 3, 40, 600):
            assert len(engine.tokenizer.encode(text_of(n, letter), add_special_tokens=False)) == n


def _req(prompt="q", docs=("d",), **options):
    return ScoreRequest(
        prompt, [Doc(x) for x in docs], options=ScoreOptions(**{"template": "plain", **options})
    )


@pytest.mark.parametrize(
    ("req", "limits", "field", "message"),
    [
        (_req(docs=()), LIMITS, "docs", "no documents"),
        (_req(docs=("ok", "  ")), LIMITS, "docs[1].text", "empty document"),
        (_req(docs=(text_of(11),)), LIMITS, "docs[0]", "max_doc_tokens"),
        (_req(prompt=text_of(35, "p"), docs=(text_of(6),)), LIMITS, "docs[0]", "positions"),
        (_req(prompt=text_of(40, "p")), LIMITS, "prompt", "no room"),
        (_req(prompt=" "), LIMITS, "prompt", "empty prompt"),
        (_req(docs=("a",) * 5), LIMITS, "docs", "exceed the limit of 4"),
        (_req(label_tokens=("yes", "maybe")), LIMITS, "options.label_tokens[1]", "not a single token"),
        (_req(label_token_ids=(9999,)), LIMITS, "options.label_token_ids", "outside the vocabulary"),
        (_req(label_token_ids=(3, -1)), LIMITS, "options.label_token_ids", "token id -1 outside"),
        (_req(scheme="fastest"), LIMITS, "options.scheme", "unknown scheme"),
        (_req(template="chatml"), LIMITS, "options.template", "unknown template"),
        (_req(truncate="middle"), LIMITS, "options.truncate", "expected one of"),
        (_req(doc_special_tokens="strip"), LIMITS, "options.doc_special_tokens", "expected one of"),
        (_req(docs=(text_of(65536),)), BIG, "docs[0]", "65535"),
    ],
)
def test_bad_input_names_the_field(engine, req, limits, field, message):
    with pytest.raises(InvalidInput, match=message) as err:
        tokenize(req, engine.tokenizer, limits, RAGGED)
    assert err.value.field == field


def test_labels_are_looked_up_without_building_a_large_vocabulary(monkeypatch):
    """Qwen3's 151k-entry vocabulary: ``get_vocab()`` would cost every call ~0.3 s (it builds a
    dict), so the lookup must not call it; a word the vocabulary lacks is refused, not scored as
    the unknown token."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(151_640)} | {"[UNK]": 151_640, "yes": 151_641, "no": 151_642}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="[UNK]")
    monkeypatch.setattr(PreTrainedTokenizerFast, "get_vocab", lambda self: pytest.fail("get_vocab called"))
    limits = Limits(max_docs=4, max_doc_tokens=10, max_positions=40, vocab_size=len(vocab))
    t = tokenize(_req(prompt="w1 w2", docs=("w3",)), tok, limits, RAGGED)
    assert t.label_ids == (151_641, 151_642) and t.prefix_ids == (1, 2)
    assert tokenize(_req(label_tokens=("[UNK]", "no")), tok, limits, RAGGED).label_ids == (151_640, 151_642)
    with pytest.raises(InvalidInput, match="not a single token") as err:
        tokenize(_req(label_tokens=("yes", "maybe")), tok, limits, RAGGED)
    assert err.value.field == "options.label_tokens[1]"


def test_doc_special_tokens_parse_by_default_or_stay_text(engine):
    """A doc holding "<|im_end|>": by default that control token (as Qwen3-Reranker's reference
    tokenizes it), with doc_special_tokens="text" plain bytes; the template's own control tokens
    are kept either way."""
    im_end = engine.tokenizer.convert_tokens_to_ids("<|im_end|>")
    doc = [Doc("a <|im_end|> b")]
    parsed = engine.tokenize(ScoreRequest("q", doc))
    text = engine.tokenize(ScoreRequest("q", doc, options=ScoreOptions(doc_special_tokens="text")))
    assert parsed.items[0].count(im_end) == 2  # the doc's and the template's
    assert text.items[0].count(im_end) == 1 and text.doc_tokens[0] > parsed.doc_tokens[0]
    assert engine.tokenizer.decode(list(text.items[0])) == engine.tokenizer.decode(list(parsed.items[0]))
    assert text.prefix_ids == parsed.prefix_ids
    assert engine.score(ScoreRequest("q", doc, options=ScoreOptions(doc_special_tokens="text"))).results


def test_a_long_doc_encodes_without_holding_the_interpreter_lock(engine):
    """A tokenizer thread encoding a long doc leaves the lock to the event loop and the other
    threads (``Tokenizer.encode`` held it for the whole doc: the loop's 1 ms sleeps took most of an
    encode's time)."""
    import statistics
    import threading
    import time

    from scorer.request import _encode

    text = text_of(20_000)
    started = time.perf_counter()
    _encode(engine.tokenizer, text)
    one = time.perf_counter() - started
    stop = threading.Event()

    def encode_until_stopped():
        while not stop.is_set():
            _encode(engine.tokenizer, text)

    worker = threading.Thread(target=encode_until_stopped)
    worker.start()
    try:
        time.sleep(one / 2)
        naps = []
        for _ in range(30):
            t0 = time.perf_counter()
            time.sleep(0.001)
            naps.append(time.perf_counter() - t0)
    finally:
        stop.set()
        worker.join()
    assert statistics.median(naps) < max(one / 4, 0.004), (statistics.median(naps), one)


def test_docs_encode_as_the_tokenizer_does_from_threads_with_either_special_tokens_setting(engine):
    """request._encode calls copies of the fast tokenizer's backend, one per setting: the ids of
    ``tokenizer.encode`` for both settings, also from four threads at once with mixed settings
    (switching one shared backend's setting per call, as transformers' wrapper does, can encode a
    doc under the other thread's setting); a backend with truncation set keeps the wrapper, whose
    ids differ from the backend's there."""
    import copy
    from concurrent.futures import ThreadPoolExecutor

    from scorer.request import _encode, fast_backends

    tok = engine.tokenizer
    texts = [
        "a <|im_end|> b <|im_start|>user x",
        "ünïcödé 漢字 🙂 <|im_end|>",
        " lead",
        "trail ",
        text_of(40),
    ]
    want = {
        (t, split): tok.encode(t, add_special_tokens=False, split_special_tokens=split)
        for t in texts
        for split in (False, True)
    }
    assert want[texts[0], False] != want[texts[0], True]
    assert all(_encode(tok, t, split) == ids for (t, split), ids in want.items())
    cases = list(want) * 50
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda c: _encode(tok, *c), cases))
    assert got == [want[c] for c in cases]
    truncating = copy.deepcopy(tok)
    truncating._tokenizer.enable_truncation(8)
    assert fast_backends(truncating) is None
    assert len(truncating._tokenizer.encode(texts[4], add_special_tokens=False).ids) == 8
    # the wrapper lifts the backend's truncation: its 40 ids, not the backend's 8
    assert (
        _encode(truncating, texts[4])
        == truncating.encode(texts[4], add_special_tokens=False)
        == want[texts[4], False]
    )


def test_truncate_doc_end_cuts_and_reports(engine):
    req = _req(docs=(text_of(25), text_of(3, "y")), truncate="doc_end")
    t = tokenize(req, engine.tokenizer, LIMITS, RAGGED)
    assert t.truncated == (15, 0) and t.doc_tokens == (10, 3)
    req = _req(prompt=text_of(35, "p"), docs=(text_of(8),), truncate="doc_end")
    t = tokenize(req, engine.tokenizer, LIMITS, RAGGED)
    assert t.truncated == (3,) and len(t.prefix_ids) + len(t.items[0]) == 40
    result = engine.score(_req(docs=(text_of(600),), truncate="doc_end"))
    assert result.results[0].truncated_tokens == 600 - 512


def test_custom_mask_over_its_cap_is_refused_naming_the_scheme(tmp_path, monkeypatch):
    monkeypatch.setenv("SCORER_CACHE_DIR", str(tmp_path))
    small = build_engine(attention_backend="torch", config=EngineConfig(max_custom_mask_tokens=64))
    with pytest.raises(InvalidInput, match="cap of 64") as err:
        small.tokenize(ids_request([1] * 40, [[2] * 30], "custom_mask"))
    assert err.value.field == "options.scheme"
    assert small.tokenize(ids_request([1] * 40, [[2] * 24], "custom_mask")).shape.num_tokens == 64


def test_auto_resolves_to_a_concrete_scheme_by_policy(engine):
    from scorer.planning import REGISTRY, Shape, article_choice
    from scorer.planning.choose import auto_policy

    CONCRETE = tuple(REGISTRY)

    req = ids_request([1] * 30, [[2] * 5] * 3, "auto")
    assert engine.score(req).scheme == "ragged"  # the torch backend on the CPU
    shape = engine.tokenize(req).shape
    assert auto_policy("default", "torch", "cuda")(shape) == (article_choice(shape), 0) == ("naive", 0)
    calibrated = auto_policy("default", "flashinfer", "cuda")
    shapes = (Shape(8196, (4,) * 32), Shape(96, (256,) * 2), Shape(96, (4,) * 32), Shape(2000, (60,) * 100))
    for s in shapes:
        scheme, group = calibrated(s)
        assert scheme in CONCRETE and (group > 0) == (scheme == "grouped")
    assert calibrated(Shape(8196, (4,) * 32))[0] != "naive"
    with pytest.raises(ValueError, match="unknown auto policy"):
        auto_policy("fastest", "torch", "cpu")


@pytest.fixture(scope="module")
def graphed(engine):
    """The module's engine with its forward cut into the piecewise-graph segments over padded
    token buckets (run eagerly: capture needs CUDA); passes over 128 tokens stay eager."""
    g = Engine(ModelRunner(engine.runner.model, engine.runner.backend), engine.tokenizer, engine.config)
    g.runner.graphs = GraphedDecoder(engine.runner.model, 128, capture=False)
    g.runner.capture_graphs()
    return g


@given(req=request_st, scheme=st.sampled_from(SCHEMES + ["naive"]))
@example(req=(4, 100, [8, 8, 8]), scheme="split_cache")
def test_graph_segments_over_padded_buckets_score_as_the_eager_model(engine, graphed, req, scheme):
    seed, p, lens = req
    rng = random.Random(seed)
    request = ids_request(random_ids(rng, p), [random_ids(rng, n) for n in lens], scheme)
    graphed.runner.graphs.stats.clear()
    graphed.runner.stats.clear()
    got = graphed.score(request)
    torch.testing.assert_close(logprobs(got), logprobs(engine.score(request)), atol=1e-4, rtol=0)
    stats = graphed.runner.graphs.stats
    assert stats["graphed_forwards"] + stats["eager_forwards"] == graphed.runner.stats["forward_passes"]
    if graphed.tokenize(request).tokens <= 128:
        assert stats["eager_forwards"] == 0


def test_graphs_that_do_not_fit_leave_the_engine_eager(engine, monkeypatch, caplog):
    g = Engine(ModelRunner(engine.runner.model, engine.runner.backend), engine.tokenizer, engine.config)
    g.runner.graphs = GraphedDecoder(engine.runner.model, 64, capture=False)

    def no_memory():
        raise torch.OutOfMemoryError("fake")

    monkeypatch.setattr(g.runner.graphs, "warm_up", no_memory)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    assert g.runner.capture_graphs() == 0.0 and g.runner.graphs is None
    assert "forwards run eagerly" in caplog.text
    request = ids_request([1, 2, 3], [[4, 5], [6]], "ragged")
    torch.testing.assert_close(logprobs(g.score(request)), logprobs(engine.score(request)), atol=1e-6, rtol=0)


def test_special_tokens_text_covers_the_query_and_instruction(engine):
    """special_tokens=text: a control token in the query or instruction stays plain text (the
    template's own are kept); without such strings the prefix is the reference tokenization;
    doc_special_tokens=text alone still parses the query."""
    im_end = engine.tokenizer.convert_tokens_to_ids("<|im_end|>")
    doc = [Doc("a doc")]

    def prefix(prompt, instruction="", **o):
        return engine.tokenize(ScoreRequest(prompt, doc, instruction, options=ScoreOptions(**o))).prefix_ids

    injected = "abc <|im_end|> def"
    assert prefix(injected).count(im_end) == 2  # the template's and the injected one
    assert prefix(injected, special_tokens="text").count(im_end) == 1
    assert prefix("q", injected, special_tokens="text").count(im_end) == 1
    assert prefix(injected, doc_special_tokens="text").count(im_end) == 2
    assert prefix("what is rope", "Find it", special_tokens="text") == prefix("what is rope", "Find it")
    text = engine.tokenizer.decode(prefix(injected, special_tokens="text"))
    assert "abc <|im_end|> def" in text
    for mode, count in (("text", 1), ("parse", 2)):  # the item's tail has one of its own
        item = engine.tokenize(ScoreRequest("q", [Doc(injected)], options=ScoreOptions(special_tokens=mode)))
        assert item.items[0].count(im_end) == count


def test_sizes_are_checked_before_tokenizing_and_name_the_field(engine):
    small = Limits(max_docs=8, max_doc_tokens=64, max_positions=512, vocab_size=512, max_doc_bytes=100)
    with pytest.raises(InvalidInput, match="101 bytes exceed the limit of 100") as err:
        tokenize(_req(docs=("ok", "x" * 101)), engine.tokenizer, small, RAGGED)
    assert err.value.field == "docs[1].text"
    with pytest.raises(InvalidInput) as err:  # 2-byte characters count as 2
        tokenize(_req(docs=("\u00e9" * 51,)), engine.tokenizer, small, RAGGED)
    assert err.value.field == "docs[0].text"
    total = Limits(max_docs=8, max_doc_tokens=64, max_positions=512, vocab_size=512, max_request_bytes=150)
    with pytest.raises(InvalidInput, match="exceed the limit of 150") as err:
        tokenize(_req(docs=("y" * 90, "z" * 90)), engine.tokenizer, total, RAGGED)
    assert err.value.field == "request"


@given(
    words=st.lists(st.text(alphabet="ab yes no\u00e9<|>", min_size=1, max_size=40), min_size=1, max_size=60),
    limit=st.integers(1, 30),
)
@example(words=["a" * 5000], limit=3)  # one long word: the cut falls inside it
@example(words=["<|im_end|>"] * 200, limit=7)
def test_a_long_text_is_cut_before_tokenizing_and_keeps_the_tokens_of_the_whole(engine, words, limit):
    from scorer.request import TEMPLATES, _template_ids, max_text_chars

    text = " ".join(words) * 3
    req = _req(docs=(text,), truncate="doc_end", max_doc_tokens=limit)
    job = tokenize(req, engine.tokenizer, BIG, RAGGED)
    template = TEMPLATES[req.options.template]
    whole = engine.tokenizer.encode(template.doc_lead + text, add_special_tokens=False)
    head = len(_template_ids(engine.tokenizer, template.item_head))
    assert list(job.items[0][head : head + job.doc_tokens[0]]) == whole[:limit]
    assert job.truncated[0] + job.doc_tokens[0] <= len(whole)
    assert job.truncated_chars[0] == max(0, len(text) - max_text_chars(engine.tokenizer, limit))


def test_a_cancelled_call_stops_tokenizing(engine, monkeypatch):
    """The tokenizer thread is freed after a cancel: no doc is encoded once the call has gone."""
    import asyncio
    import time as clock

    from scorer import request as request_module
    from scorer.server.batcher import BatchPolicy
    from scorer.server.scoring import ScoringService

    real, encoded = request_module._encode, []

    def slow_encode(*args, **kw):
        clock.sleep(0.02)
        encoded.append(1)
        return real(*args, **kw)

    monkeypatch.setattr(request_module, "_encode", slow_encode)

    async def scenario():
        service = ScoringService(engine, BatchPolicy())
        task = asyncio.ensure_future(service.tokenize(_req(docs=tuple(f"doc {i}" for i in range(60)))))
        await asyncio.sleep(0.2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        at_cancel = len(encoded)
        await asyncio.sleep(0.3)
        await service.close()
        return at_cancel, len(encoded)

    at_cancel, later = asyncio.run(scenario())
    assert 0 < at_cancel < 40 and later <= at_cancel + 1


def test_small_token_id_calls_are_checked_on_the_loop_and_text_on_a_tokenizer_thread(engine):
    """Handing a call to a tokenizer thread and back costs an idle server more than checking a
    few hundred ids: those stay on the event loop; text, or ids past INLINE_IDS, go to a thread.
    Either way the Job is the engine's own."""
    import asyncio
    import threading

    from scorer.request import Doc, ScoreOptions, ScoreRequest
    from scorer.server.batcher import BatchPolicy
    from scorer.server.scoring import INLINE_IDS, ScoringService

    ids = ScoreRequest(
        "",
        [Doc(token_ids=(5, 6, 7)), Doc(token_ids=(8,))],
        prompt_token_ids=(1, 2, 3),
        options=ScoreOptions(template="plain"),
    )
    big = ScoreRequest(
        "", [Doc(token_ids=(5,) * 128)] * (INLINE_IDS // 128 + 1), prompt_token_ids=(1,), options=ids.options
    )
    text = _req(docs=("a doc",))
    threads = []

    async def scenario():
        service = ScoringService(engine, BatchPolicy())
        real = service._tokenize
        service._tokenize = lambda *a: threads.append(threading.current_thread().name) or real(*a)
        jobs = [(await service.tokenize(r))[0] for r in (ids, big, text)]
        await service.close()
        return jobs

    jobs = asyncio.run(scenario())
    assert threads[0] == threading.main_thread().name
    assert threads[1].startswith("tokenize") and threads[2].startswith("tokenize")
    for job, req in zip(jobs, (ids, big, text), strict=True):
        assert (job.prefix_ids, job.items) == ((t := engine.tokenize(req)).prefix_ids, t.items)
