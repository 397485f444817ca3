"""The built-in templates tokenize as their model cards' reference code does, and a team's own
template comes from a file (``--template-file``)."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer, processors

from scorer.engine import EngineConfig, prompting
from scorer.models import tiny
from scorer.models.loader import load_tokenizer
from scorer.request import (
    BGE_GEMMA_PROMPT,
    MXBAI_CHAT_PREFIX,
    MXBAI_TASK,
    QWEN3_SYSTEM,
    TEMPLATES,
    Doc,
    InvalidInput,
    Limits,
    Prompting,
    ScoreOptions,
    ScoreRequest,
    load_template,
    tokenize,
)
from scorer.runtime import build_engine

QUERIES = ["what is a panda?", "How do rerankers score documents, and why?"]
DOCS = [
    "hi",
    "The giant panda (Ailuropoda melanoleuca) is a bear species endemic to China.",
    "  Leading spaces,\nnew lines and 123 numbers: all kept.",
]
LIMITS = Limits(max_docs=16, max_doc_tokens=512, max_positions=4096, vocab_size=tiny.VOCAB_SIZE)
BOS = "<|endoftext|>"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """The embedded tokenizer."""
    path = tmp_path_factory.mktemp("tok")
    tiny.write_tokenizer(path)
    return load_tokenizer(path)


@pytest.fixture(scope="module")
def bos_tokenizer(tmp_path_factory):
    """The embedded tokenizer, adding a BOS to what it encodes as Gemma's does."""
    path = tmp_path_factory.mktemp("bos")
    tiny.write_tokenizer(path)
    backend = Tokenizer.from_file(str(path / "tokenizer.json"))
    bos_id = backend.token_to_id(BOS)
    backend.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, bos_id)]
    )
    backend.save(str(path / "tokenizer.json"))
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "bos_token": BOS}))
    tok = load_tokenizer(path)
    assert tok.encode("A")[0] == tok.bos_token_id == bos_id
    return tok


def enc(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def qwen3_reranker_reference(tokenizer, query: str, doc: str) -> list[int]:
    """Qwen/Qwen3-Reranker-0.6B's model card: the prefix's and suffix's tokens around the
    tokens of ``format_instruction(instruction, query, doc)``."""
    prefix = QWEN3_SYSTEM
    suffix = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    instruction = "Given a web search query, retrieve relevant passages that answer the query"
    pair = f"<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {doc}"
    return enc(tokenizer, prefix) + tokenizer(pair)["input_ids"] + enc(tokenizer, suffix)


def bge_reranker_gemma_reference(tokenizer, query: str, doc: str) -> list[int]:
    """BAAI/bge-reranker-v2-gemma's model card (``get_inputs``): [bos] + "A: {query}", then "\\n",
    "B: {passage}", "\\n" and the prompt, each tokenized alone."""
    sep = enc(tokenizer, "\n")
    return (
        [tokenizer.bos_token_id]
        + enc(tokenizer, f"A: {query}")
        + sep
        + enc(tokenizer, f"B: {doc}")
        + sep
        + enc(tokenizer, BGE_GEMMA_PROMPT)
    )


def mxbai_rerank_v2_reference(tokenizer, query: str, doc: str) -> list[int]:
    """mixedbread-ai/mxbai-rerank-*-v2 (``prepare_inputs`` and ``concat_input_ids``): the chat
    prefix, "query: {query}", "\\n", "document: {document}", "\\n", the task prompt and the chat
    suffix, each tokenized alone."""
    sep = enc(tokenizer, "\n")
    return (
        enc(tokenizer, MXBAI_CHAT_PREFIX)
        + enc(tokenizer, f"query: {query}")
        + sep
        + enc(tokenizer, f"document: {doc}")
        + sep
        + enc(tokenizer, MXBAI_TASK)
        + enc(tokenizer, "<|im_end|>\n<|im_start|>assistant\n")
    )


REFERENCES = {
    "qwen3_reranker": (qwen3_reranker_reference, "tokenizer"),
    "bge_reranker_gemma": (bge_reranker_gemma_reference, "bos_tokenizer"),
    "mxbai_rerank_v2": (mxbai_rerank_v2_reference, "tokenizer"),
}


def job_of(tokenizer, query: str, template: str, prompting_: Prompting | None = None, **options):
    options.setdefault("label_token_ids", (15, 16))  # the tiny vocabulary has no single-token "Yes"
    req = ScoreRequest(query, [Doc(d) for d in DOCS], options=ScoreOptions(template=template, **options))
    return tokenize(
        req, tokenizer, LIMITS, lambda shape, o: (_naive(), 0), prompting=prompting_ or Prompting()
    )


def _naive():
    from scorer.planning import get

    return get("naive")


@pytest.mark.parametrize("name", list(REFERENCES))
@pytest.mark.parametrize("query", QUERIES)
def test_each_built_in_template_tokenizes_as_its_model_card(name, query, request):
    reference, fixture = REFERENCES[name]
    tok = request.getfixturevalue(fixture)
    job = job_of(tok, query, name)
    for item, doc in zip(job.items, DOCS, strict=True):
        assert list(job.prefix_ids + item) == reference(tok, query, doc), doc


def test_every_built_in_template_has_a_reference():
    assert set(TEMPLATES) - {"plain"} == set(REFERENCES)


def test_a_template_gives_its_labels_and_score_mode_to_a_call_that_names_none(tokenizer):
    job = job_of(tokenizer, QUERIES[0], "mxbai_rerank_v2", label_token_ids=())
    assert job.label_ids == (16, 15) and job.options.score_mode == "softmax"  # "1", "0"
    bge = job_of(tokenizer, QUERIES[0], "bge_reranker_gemma", label_token_ids=(2146,))
    assert bge.options.score_mode == "raw" and bge.options.template == "bge_reranker_gemma"
    assert (
        job_of(tokenizer, QUERIES[0], "bge_reranker_gemma", score_mode="sigmoid").options.score_mode
        == "sigmoid"
    )
    with pytest.raises(InvalidInput, match="options.label_tokens\\[0\\]: 'Yes' is not a single token"):
        job_of(tokenizer, QUERIES[0], "bge_reranker_gemma", label_token_ids=())
    with pytest.raises(InvalidInput, match="instruction: template 'mxbai_rerank_v2' takes no instruction"):
        tokenize(
            ScoreRequest(
                "q", [Doc("d")], instruction="rank", options=ScoreOptions(template="mxbai_rerank_v2")
            ),
            tokenizer,
            LIMITS,
            lambda shape, o: (_naive(), 0),
        )


OWN = {
    "name": "ours",
    "prefix": ["Query: {query}", "\nTask: {instruction}"],
    "item_head": "\nDoc:",
    "doc_lead": " ",
    "item_tail": ["\n", "Relevant:"],
    "default_instruction": "judge",
    "labels": ["1", "0"],
    "score_mode": "logprob",
}


@pytest.mark.parametrize("suffix", [".json", ".yaml"])
def test_a_template_file_is_a_template_of_its_own_and_the_default(tokenizer, tmp_path, suffix):
    import yaml

    path = tmp_path / f"own{suffix}"
    path.write_text(json.dumps(OWN) if suffix == ".json" else yaml.safe_dump(OWN))
    template = load_template(path)
    assert template.prefix == tuple(OWN["prefix"]) and template.labels == ("1", "0")
    p = prompting(EngineConfig(template_file=str(path)), None)
    assert p.default_template == "ours" and set(TEMPLATES) < set(p.templates)
    job = job_of(tokenizer, "q?", "", p, label_token_ids=())
    assert (
        job.options.template == "ours" and job.options.score_mode == "logprob" and job.label_ids == (16, 15)
    )
    want = tokenizer.encode("Query: q?") + enc(tokenizer, "\nTask: judge")
    assert list(job.prefix_ids) == want
    tail = enc(tokenizer, "\n") + enc(tokenizer, "Relevant:")
    assert list(job.items[0]) == enc(tokenizer, "\nDoc:") + enc(tokenizer, " " + DOCS[0]) + tail
    # --template picks among the built-ins and the file's
    assert (
        prompting(EngineConfig(template_file=str(path), template="plain"), None).default_template == "plain"
    )
    with pytest.raises(ValueError, match="unknown template 'nope'"):
        prompting(EngineConfig(template_file=str(path), template="nope"), None)


@pytest.mark.parametrize(
    "content, message",
    [
        ("{", "template file .*: Expecting"),
        ('["a"]', "expected a mapping"),
        ('{"name": "x"}', "prefix is missing"),
        ('{"name": "x", "prefix": "{query}", "colour": 1}', "unknown field 'colour'"),
        ('{"name": "x", "prefix": "no query here"}', "the prefix takes \\{query\\}"),
        ('{"name": "x", "prefix": "{query}", "labels": "yes"}', "labels is not"),
        ('{"name": "x", "prefix": "{query}", "score_mode": "best"}', "score_mode is not one of"),
    ],
)
def test_a_bad_template_file_names_what_is_wrong(tmp_path, content, message):
    path = tmp_path / "t.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        load_template(path)


def test_the_engine_serves_a_template_file_by_default(tmp_path, monkeypatch):
    from scorer.settings import Settings

    monkeypatch.setenv("SCORER_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "own.json"
    path.write_text(json.dumps({**OWN, "labels": ["yes", "no"]}))
    engine = build_engine(attention_backend="torch", config=Settings(template_file=str(path)).engine_config())
    result = engine.score(ScoreRequest("q", [Doc("a doc")], options=ScoreOptions(template="")))
    assert result.results[0].score < 0  # logprob, the file's mode
    # the server's warm-up scores with the default template (and its labels) too
    from scorer.server.scoring import warm_up

    seen = []
    tokenize_ = engine.tokenize
    monkeypatch.setattr(engine, "tokenize", lambda req, *a: seen.append(tokenize_(req, *a)) or seen[-1])
    warm_up(engine)
    assert seen and {job.options.template for job in seen} == {"ours"}
    with pytest.raises(ValueError, match="--template-file \\(template_file\\): .* is not a template"):
        Settings(template_file=str(tmp_path / "t.json") if (tmp_path / "t.json").write_text("[]") else "")
    with pytest.raises(ValueError, match="--template \\(template\\): unknown template 'nope'"):
        Settings(template="nope")


def test_the_parser_names_every_built_in_template():
    from scorer.options import TEMPLATE_NAMES
    from scorer.request import TEMPLATES

    assert tuple(TEMPLATES) == TEMPLATE_NAMES
