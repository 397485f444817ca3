"""Scoring requests: what a caller sends, the templates, and validation into a ``Job``.

A template splits ``[prefix + item]`` into a shared prefix (instruction + query) and one item
per doc (``item_head + doc + item_tail``). The prefix and each doc are tokenized separately,
so the reference for a doc is exactly ``prefix ids + item ids`` and no scheme can differ from
another by a merge across the boundary.
"""

from __future__ import annotations

import dataclasses
import json
import re
import string
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path

import numpy as np

from .options import (
    DOC_SPECIAL_TOKENS,
    MAX_DOC_BYTES,
    MAX_REQUEST_BYTES,
    PREFIX_CACHE_MODES,
    SCORE_MODES,
    TRUNCATE_MODES,
    ScoreOptions,
)
from .planning import Scheme, Shape, names
from .planning.base import MAX_ITEM_LEN, PlanError
from .token_ids import SHORT, TokenIds
from .tokenizer import BackendTokenizer, TokenizerSpec

MAX_CACHE_SALT = 256  # characters
VISIBLE = re.compile(r"[^\s\x00-\x1f\x7f-\x9f]")
"""A character that is neither white space nor a control character: text without one is empty."""
MAX_LABELS = 64  # label_tokens or label_token_ids: each doc's answer carries a log-prob per label
MAX_DOC_ID = 256  # UTF-8 bytes of a doc's id, which its answer echoes
DEFAULT_LABELS = ("yes", "no")


class InvalidInput(ValueError):
    """Bad input, naming the request field at fault."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(f"{field}: {message}")


Text = str | tuple[str, ...]
"""A template's fixed text, or its segments: each encoded on its own and the ids joined, as a model
card's reference code does where it tokenizes the pieces of its prompt separately."""


@dataclass(frozen=True)
class Template:
    """``prefix`` (formatted with {instruction} and {query}; with the tokenizer's BOS where it adds
    one) + per doc ``item_head`` + ``doc_lead`` and the doc's text + ``item_tail``. ``labels`` and
    ``score_mode``: the defaults of a call that names none (the model card's read-out)."""

    name: str
    prefix: Text
    item_head: Text = ""
    item_tail: Text = ""
    doc_lead: str = ""  # joined to the doc text before tokenizing (keeps BPE word boundaries)
    default_instruction: str = ""
    labels: tuple[str, ...] = ()  # (): DEFAULT_LABELS
    score_mode: str = ""  # "": softmax

    def __post_init__(self) -> None:
        fields_ = {name for seg in _segments(self.prefix) for _, name, _, _ in string.Formatter().parse(seg)}
        if not {"query"} <= fields_ - {None} <= {"query", "instruction"} and self.name != "plain":
            raise ValueError(
                f"template {self.name!r}: the prefix takes {{query}} and optionally {{instruction}}"
            )
        if self.score_mode not in ("", *SCORE_MODES):
            raise ValueError(f"template {self.name!r}: score_mode is not one of {', '.join(SCORE_MODES)}")

    @property
    def takes_instruction(self) -> bool:
        return self.name == "plain" or any("{instruction}" in seg for seg in _segments(self.prefix))

    def prefix_text(self, query: str, instruction: str) -> str:
        return "".join(text for seg in self.prefix_pieces(query, instruction) for text, _ in seg)

    def prefix_pieces(self, query: str, instruction: str) -> list[list[tuple[str, bool]]]:
        """The prefix's segments, each as (text, from the caller) pieces: the template's own text
        and the caller's query and instruction."""
        instruction = instruction or self.default_instruction
        if self.name == "plain":
            return [[(instruction, True), ("\n", False), (query, True)] if instruction else [(query, True)]]
        values = {"instruction": instruction, "query": query}
        out = []
        for seg in _segments(self.prefix):
            pieces = []
            for literal, name, _, _ in string.Formatter().parse(seg):
                if literal:
                    pieces.append((literal, False))
                if name:
                    pieces.append((values[name], True))
            out.append(pieces)
        return out


def _segments(text: Text) -> tuple[str, ...]:
    return (text,) if isinstance(text, str) else text


QWEN3_SYSTEM = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the "
    'Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n'
)
BGE_GEMMA_PROMPT = (
    "Given a query A and a passage B, determine whether the passage contains an answer to the query by"
    " providing a prediction of either 'Yes' or 'No'."
)
MXBAI_CHAT_PREFIX = (
    "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
    "<|im_start|>user\n"
)
MXBAI_TASK = (
    "You are a search relevance expert who evaluates how well documents match search queries. For each"
    " query-document pair, carefully analyze the semantic relationship between them, then provide your"
    " binary relevance judgment (0 for not relevant, 1 for relevant).\nRelevance:"
)
TEMPLATES: dict[str, Template] = {
    "plain": Template("plain", prefix="{query}"),
    "qwen3_reranker": Template(
        "qwen3_reranker",
        prefix=QWEN3_SYSTEM + "<Instruct>: {instruction}\n<Query>: {query}\n",
        item_head="<Document>:",
        item_tail="<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n",
        doc_lead=" ",
        default_instruction="Given a web search query, retrieve relevant passages that answer the query",
    ),
    # BAAI/bge-reranker-v2-gemma's model card (get_inputs): [bos] + "A: {query}", then per passage
    # "\n", "B: {passage}", "\n" and the prompt, each tokenized alone; the score is the logit of
    # "Yes" at the last token (its sigmoid with normalize=True: score_mode sigmoid)
    "bge_reranker_gemma": Template(
        "bge_reranker_gemma",
        prefix="A: {query}",
        item_head="\n",
        doc_lead="B: ",
        item_tail=("\n", BGE_GEMMA_PROMPT),
        labels=("Yes",),
        score_mode="raw",
    ),
    # mixedbread-ai/mxbai-rerank-base-v2 and -large-v2 (mxbai_rerank_v2.py): the chat prefix,
    # "query: {query}", then per document "\n", "document: {document}", "\n", the task prompt and
    # the chat suffix, each tokenized alone; the score is sigmoid(logit("1") - logit("0")), the
    # softmax over the labels 1 and 0
    "mxbai_rerank_v2": Template(
        "mxbai_rerank_v2",
        prefix=(MXBAI_CHAT_PREFIX, "query: {query}"),
        item_head="\n",
        doc_lead="document: ",
        item_tail=("\n", MXBAI_TASK, "<|im_end|>\n<|im_start|>assistant\n"),
        labels=("1", "0"),
    ),
}
TEMPLATE_FIELDS = tuple(f.name for f in dataclasses.fields(Template))
_SEGMENTED = ("prefix", "item_head", "item_tail")  # a text, or segments tokenized one at a time


def load_template(path: str | Path) -> Template:
    """A team's own template from a JSON or YAML file of ``Template``'s fields (``name``, ``prefix``
    with {query} and optionally {instruction}, ``item_head``, ``item_tail``, ``doc_lead``,
    ``default_instruction``, ``labels``, ``score_mode``; a list for a text tokenized in segments);
    ValueError naming the file and the field at fault."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ValueError(f"template file {path}: {e}") from None
    if path.suffix in (".yaml", ".yml"):
        import yaml

        try:
            values = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ValueError(f"template file {path}: {e}") from None
    else:
        try:
            values = json.loads(text)
        except ValueError as e:
            raise ValueError(f"template file {path}: {e}") from None
    if not isinstance(values, dict):
        raise ValueError(f"template file {path}: expected a mapping of {', '.join(TEMPLATE_FIELDS)}")
    unknown = sorted(set(values) - set(TEMPLATE_FIELDS))
    if unknown:
        raise ValueError(
            f"template file {path}: unknown field {unknown[0]!r}; fields: {', '.join(TEMPLATE_FIELDS)}"
        )
    for name in ("name", "prefix"):
        if not values.get(name):
            raise ValueError(f"template file {path}: {name} is missing")
    for name, value in values.items():
        texts = isinstance(value, list) and all(isinstance(v, str) for v in value)
        if name == "labels":
            ok, wants = texts, "a list of texts"
        elif name in _SEGMENTED:
            ok, wants = isinstance(value, str) or texts, "text or a list of texts"
        else:
            ok, wants = isinstance(value, str), "text"
        if not ok:
            raise ValueError(f"template file {path}: {name} is not {wants}")
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}
    try:
        return Template(**values)
    except ValueError as e:
        raise ValueError(f"template file {path}: {e}") from None


@dataclass(frozen=True)
class Doc:
    text: str = ""
    id: str = ""
    token_ids: Sequence[int] = ()  # a tuple, or TokenIds (a message's)


@dataclass(frozen=True)
class ScoreRequest:
    prompt: str
    docs: Sequence[Doc]
    instruction: str = ""
    prompt_token_ids: Sequence[int] = ()  # the whole shared prefix, verbatim: a tuple, or TokenIds
    options: ScoreOptions = field(default_factory=ScoreOptions)
    request_id: str = ""


@dataclass(frozen=True)
class Limits:
    max_docs: int
    max_doc_tokens: int
    max_positions: int
    vocab_size: int
    max_doc_bytes: int = MAX_DOC_BYTES
    max_request_bytes: int = MAX_REQUEST_BYTES
    sliding_window: int = 0  # the model's, where it bounds max_positions


@dataclass(frozen=True, eq=False)
class Job:
    """A validated request, resolved once when it is tokenized: the token ids of the prefix and
    of every item, what was cut, the label ids, the shape, the concrete scheme and group size, and
    the tokens it puts through the model. Everything downstream reads it; the options the answer
    needs (``top_n``, ``return_label_logprobs``, ``score_mode``) are ``request.options``."""

    request: ScoreRequest
    prefix_ids: TokenIds
    items: tuple[tuple[int, ...], ...]
    doc_tokens: tuple[int, ...]
    truncated: tuple[int, ...]
    label_ids: tuple[int, ...]
    shape: Shape
    scheme: Scheme
    group_size: int
    tokens: int
    truncated_chars: tuple[int, ...] = ()  # characters cut from each doc's end before tokenizing
    cache_hint: tuple = ()  # the prefix cache's blocks of the prompt when it was tokenized

    @property
    def options(self) -> ScoreOptions:
        return self.request.options


Resolve = Callable[[Shape, ScoreOptions], tuple[Scheme, int]]
"""(shape, options) -> the concrete scheme and group size (``auto`` resolved)."""
Peek = Callable[[TokenIds, ScoreOptions], tuple[int, tuple]]
"""(prefix ids, options) -> the prompt tokens the prefix cache holds now and its blocks of them
(a hint: it may change before the call's batch is planned, and is checked then)."""


@dataclass(frozen=True)
class ScoreHead:
    """A score head's read-out (``*ForSequenceClassification``): its ``num_labels`` outputs at
    each item's last token, ``relevant`` the index of the label a score is for. One output is read
    against a constant 0, so that softmax over the pair is its sigmoid and ``raw`` its logit."""

    architecture: str
    num_labels: int
    relevant: int

    @property
    def label_ids(self) -> tuple[int, ...]:
        """The outputs the read-out takes, the relevant one first (one output: it and the 0)."""
        if self.num_labels == 1:
            return (0, 1)
        return (self.relevant, *(i for i in range(self.num_labels) if i != self.relevant))

    def describe(self) -> str:
        return f"score head ({self.architecture}, {self.num_labels} label{'s' * (self.num_labels > 1)})"


@dataclass(frozen=True)
class Prompting:
    """What a model's engine turns requests into ids with: its templates (the built-ins and a
    ``--template-file``'s), the one a call naming none gets, and its score head (None: the LM
    head, scored from label tokens)."""

    templates: Mapping[str, Template] = field(default_factory=lambda: TEMPLATES)
    default_template: str = ScoreOptions.template
    head: ScoreHead | None = None


def check_options(o: ScoreOptions, templates: Mapping[str, Template] = TEMPLATES) -> None:
    if o.scheme not in ("", *names()):
        raise InvalidInput(
            "options.scheme", f"unknown scheme {o.scheme!r}; expected one of {', '.join(names())}"
        )
    if o.template not in ("", *templates):
        raise InvalidInput(
            "options.template", f"unknown template {o.template!r}; expected one of {', '.join(templates)}"
        )
    for name, allowed in (
        ("score_mode", SCORE_MODES),
        ("truncate", TRUNCATE_MODES),
        ("doc_special_tokens", DOC_SPECIAL_TOKENS),
        ("special_tokens", DOC_SPECIAL_TOKENS),
        ("prefix_cache", PREFIX_CACHE_MODES),
    ):
        if getattr(o, name) not in ("", *allowed):
            raise InvalidInput(f"options.{name}", f"expected one of {', '.join(allowed)}")
    if o.max_doc_tokens < 0:
        raise InvalidInput("options.max_doc_tokens", "must not be negative")
    if o.group_size < 0:
        raise InvalidInput("options.group_size", "must not be negative")
    if o.top_n < 0:
        raise InvalidInput("options.top_n", "must not be negative")
    check_labels(len(o.label_tokens), len(o.label_token_ids))
    check_cache_salt(o.cache_salt)
    if o.doc_special_tokens and o.special_tokens and o.doc_special_tokens != o.special_tokens:
        raise InvalidInput(
            "options.doc_special_tokens",
            f"{o.doc_special_tokens!r} contradicts special_tokens={o.special_tokens!r}; give one",
        )
    if o.label_tokens and o.label_token_ids:
        raise InvalidInput("options.label_token_ids", "label_tokens and label_token_ids both set; give one")


def check_labels(label_tokens: int, label_token_ids: int) -> None:
    """At most MAX_LABELS labels: the answer's size grows with docs x labels."""
    for name, count in (("label_tokens", label_tokens), ("label_token_ids", label_token_ids)):
        if count > MAX_LABELS:
            raise InvalidInput(f"options.{name}", f"{count} labels exceed the limit of {MAX_LABELS}")


def check_cache_salt(salt: str) -> None:
    if len(salt) > MAX_CACHE_SALT:
        raise InvalidInput("options.cache_salt", f"longer than {MAX_CACHE_SALT} characters")


def check_doc_id(i: int, doc_id: str) -> None:
    """A doc's id is echoed in its answer: at most MAX_DOC_ID bytes."""
    if (size := _utf8_len(doc_id)) > MAX_DOC_ID:
        raise InvalidInput(f"docs[{i}].id", f"{size} bytes exceed the limit of {MAX_DOC_ID}")


class Cancelled(Exception):
    """The call's client has gone: tokenizing stopped."""


def tokenize(
    req: ScoreRequest,
    tokenizer,
    limits: Limits,
    resolve: Resolve,
    budget: int = 0,
    mask_cap: int = 0,
    cancelled: Callable[[], bool] | None = None,
    peek: Peek | None = None,
    prompting: Prompting = Prompting(),
) -> Job:
    """Validate ``req``, turn it into token ids and resolve its scheme; raises InvalidInput naming
    the field. ``budget`` and ``mask_cap``: the engine's token budget per pass and custom-mask cap,
    against which the scheme checks the shape. Sizes are checked before any tokenizing, and a doc's
    text is cut to what its token limit can use first (``max_text_chars``); ``cancelled`` is asked
    between docs (Cancelled is raised once it says so); ``peek``: what the prefix cache holds of
    the prompt, which ``auto`` and the token count go by; ``prompting``: the templates and the head.
    The Job's options name the template and score mode the call got."""
    o = req.options
    check_options(o, prompting.templates)
    if not req.docs:
        raise InvalidInput("docs", "no documents to score")
    if len(req.docs) > limits.max_docs:
        raise InvalidInput("docs", f"{len(req.docs)} documents exceed the limit of {limits.max_docs}")
    check_sizes(req, limits)
    template = prompting.templates[o.template or prompting.default_template]
    mode = o.score_mode or template.score_mode or "softmax"
    if o.template != template.name or o.score_mode != mode:
        req = replace(req, options=replace(o, template=template.name, score_mode=mode))
        o = req.options
    if req.instruction and not template.takes_instruction:
        raise InvalidInput("instruction", f"template {template.name!r} takes no instruction")
    if req.prompt_token_ids and (req.prompt or req.instruction):
        which = "prompt" if req.prompt else "instruction"
        raise InvalidInput("prompt_token_ids", f"prompt_token_ids and {which} both set; give one")
    if req.prompt_token_ids:
        prefix = TokenIds(_checked_ids(req.prompt_token_ids, limits.vocab_size, "prompt_token_ids"))
    elif VISIBLE.search(req.prompt):
        prefix = TokenIds(_prefix_ids(tokenizer, template, req, (o.special_tokens or "parse") == "text"))
    else:
        raise InvalidInput("prompt", "empty prompt (only white space or control characters)")
    head, tail = _template_ids(tokenizer, template.item_head), _template_ids(tokenizer, template.item_tail)
    room = min(limits.max_positions - len(prefix), MAX_ITEM_LEN) - len(head) - len(tail)
    if room < 1:
        raise InvalidInput("prompt", f"{len(prefix)} prompt tokens leave no room for a document")
    doc_limit = min(o.max_doc_tokens or limits.max_doc_tokens, limits.max_doc_tokens, room)
    items, doc_tokens, truncated, truncated_chars = [], [], [], []
    split_special = (o.doc_special_tokens or o.special_tokens or "parse") == "text"
    for i, doc in enumerate(req.docs):
        if cancelled is not None and cancelled():
            raise Cancelled(f"stopped before docs[{i}]")
        if doc.token_ids and doc.text:
            raise InvalidInput(f"docs[{i}]", "text and token_ids both set; give one")
        text_cut = 0
        if doc.token_ids:
            ids = tuple(_checked_ids(doc.token_ids, limits.vocab_size, f"docs[{i}].token_ids"))
        elif VISIBLE.search(doc.text):
            text_cut = max(0, len(doc.text) - max_text_chars(tokenizer, doc_limit))
            text = doc.text[: len(doc.text) - text_cut]
            ids = tuple(_encode(tokenizer, template.doc_lead + text, split_special))
        else:
            raise InvalidInput(f"docs[{i}].text", "empty document (only white space or control characters)")
        cut = max(0, len(ids) - doc_limit)
        if cut and (o.truncate or "error") == "error":
            why = "max_doc_tokens"
            if doc_limit == room:
                why = "the prompt + document exceed the model's positions"
                if limits.sliding_window == limits.max_positions:
                    why = (
                        f"the prompt + document exceed the model's sliding window of {limits.sliding_window}"
                        " tokens; attention past it is not implemented"
                    )
            count = f"over {len(ids)}" if text_cut else f"{len(ids)}"
            raise InvalidInput(
                f"docs[{i}]",
                f"{count} tokens exceed the limit of {doc_limit} ({why}); set truncate=doc_end",
            )
        ids = ids[: len(ids) - cut]
        items.append(head + ids + tail)
        doc_tokens.append(len(ids))
        truncated.append(cut)
        truncated_chars.append(text_cut)
    labels = (
        head_label_ids(o, prompting.head)
        if prompting.head
        else label_ids(o, tokenizer, limits.vocab_size, template.labels)
    )
    cached, hint = peek(prefix, o) if peek else (0, ())
    shape = Shape(len(prefix), tuple(map(len, items)), cached)
    scheme, group = resolve(shape, o)
    try:
        scheme.check(shape, budget, mask_cap)
    except PlanError as e:
        raise InvalidInput("options.scheme", str(e)) from None
    return Job(
        req,
        prefix,
        tuple(items),
        tuple(doc_tokens),
        tuple(truncated),
        labels,
        shape,
        scheme,
        group,
        scheme.rows(shape),
        tuple(truncated_chars),
        hint,
    )


def check_sizes(req: ScoreRequest, limits: Limits) -> None:
    """Text sizes in UTF-8 bytes, before any work: a doc over ``max_doc_bytes``, a call over
    ``max_request_bytes``; and each doc's id (``check_doc_id``)."""
    total = _utf8_len(req.prompt) + _utf8_len(req.instruction)
    for i, doc in enumerate(req.docs):
        check_doc_id(i, doc.id)
        size = _utf8_len(doc.text)
        if size > limits.max_doc_bytes:
            raise InvalidInput(f"docs[{i}].text", f"{size} bytes exceed the limit of {limits.max_doc_bytes}")
        total += size
    if total > limits.max_request_bytes:
        raise InvalidInput("request", f"{total} bytes of text exceed the limit of {limits.max_request_bytes}")


def _utf8_len(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode())


CUT_SLACK_TOKENS = 16
"""Tokens' worth of text kept past a doc's limit before tokenizing, so that the cut cannot reach the
tokens that are kept (a merge across the cut changes only the last few)."""


def max_text_chars(tokenizer, doc_limit: int) -> int:
    """Characters of a doc's text that can matter for its first ``doc_limit`` tokens: no token
    covers more than ``longest_token_chars`` characters."""
    return (doc_limit + CUT_SLACK_TOKENS) * longest_token_chars(tokenizer)


@lru_cache(maxsize=16)
def longest_token_chars(tokenizer) -> int:
    """The longest token of the vocabulary, in characters of its stored form (a byte-level
    vocabulary stores a character per byte, so this bounds the text characters a token covers);
    ``get_vocab`` is slow on a large vocabulary, so once per tokenizer."""
    vocab = getattr(tokenizer, "backend_tokenizer", tokenizer).get_vocab()
    return max(map(len, vocab), default=1)


def head_label_ids(o: ScoreOptions, head: ScoreHead) -> tuple[int, ...]:
    """A score head's outputs the read-out takes; label options are an error: the head has no tokens."""
    for name in ("label_tokens", "label_token_ids"):
        if getattr(o, name):
            raise InvalidInput(
                f"options.{name}",
                f"the model has a {head.describe()}: label tokens apply to a model with an LM head only",
            )
    return head.label_ids


def label_ids(o: ScoreOptions, tokenizer, vocab_size: int, default: tuple[str, ...] = ()) -> tuple[int, ...]:
    """The label tokens as single vocabulary ids, looked up the way Qwen3-Reranker does; ``default``:
    the template's labels, for a call that names none (DEFAULT_LABELS without either)."""
    if o.label_token_ids:
        ids = tuple(_checked_ids(o.label_token_ids, vocab_size, "options.label_token_ids"))
        return _distinct(ids, o, "options.label_token_ids")
    words = o.label_tokens or default or DEFAULT_LABELS
    out = []
    for i, word in enumerate(words):
        # one entry of the vocabulary (a hash lookup: get_vocab() would build a dict of all of it,
        # ~0.3 s for Qwen3's 151k entries on a small CPU), else a word that encodes to one token
        tid = tokenizer.convert_tokens_to_ids(word)
        if not _known(tokenizer, tid, word):
            ids = _encode(tokenizer, word)
            tid = ids[0] if len(ids) == 1 else None
            if not _known(tokenizer, tid, word):
                raise InvalidInput(
                    f"options.label_tokens[{i}]", f"{word!r} is not a single token of the vocabulary"
                )
        out.append(tid)
    return _distinct(tuple(out), o, "options.label_tokens")


def _distinct(ids: tuple[int, ...], o: ScoreOptions, field_name: str) -> tuple[int, ...]:
    """Labels that can give a score: no label twice, and two at least for ``softmax``."""
    seen: dict[int, int] = {}
    for i, tid in enumerate(ids):
        if tid in seen:
            raise InvalidInput(f"{field_name}[{i}]", f"the same token as label {seen[tid]}")
        seen[tid] = i
    if len(ids) < 2 and o.score_mode in ("", "softmax"):
        raise InvalidInput(
            field_name, "softmax needs two labels at least (or score_mode logprob, raw or sigmoid)"
        )
    return ids


def _prefix_ids(tokenizer, template: Template, req: ScoreRequest, plain_text: bool) -> tuple[int, ...]:
    """The prefix's ids: the whole text encoded at once (the reference tokenization), unless
    ``plain_text`` and the caller's query or instruction hold special-token strings: then the
    caller's pieces are encoded as plain text and the template's own pieces parsed."""
    segments = template.prefix_pieces(req.prompt, req.instruction)
    special = getattr(tokenizer, "added_tokens_encoder", {})
    per_piece = plain_text and any(
        tok in text for pieces in segments for text, caller in pieces if caller for tok in special
    )
    if len(segments) == 1 and not per_piece:
        return tuple(tokenizer.encode("".join(text for text, _ in segments[0])))
    ids = list(tokenizer.encode(""))  # what the tokenizer puts around any text (a BOS, or nothing)
    for pieces in segments:
        if per_piece:
            for text, caller in pieces:
                ids += _encode(tokenizer, text, split_special=caller)
        else:
            ids += _encode(tokenizer, "".join(text for text, _ in pieces))
    return tuple(ids)


def _known(tokenizer, tid: int | None, word: str) -> bool:
    """``tid`` is a token of the vocabulary for ``word``, not the unknown token standing in."""
    return tid is not None and (tid != tokenizer.unk_token_id or word == tokenizer.unk_token)


@lru_cache(maxsize=64)
def _template_ids(tokenizer, text: Text) -> tuple[int, ...]:
    """A template's fixed text around every doc (each segment alone), encoded once per tokenizer."""
    return tuple(i for seg in _segments(text) for i in _encode(tokenizer, seg))


def _encode(tokenizer, text: str, split_special: bool = False) -> list[int]:
    """``split_special``: special-token strings in ``text`` are encoded as plain text. The ids of
    ``tokenizer.encode(text, add_special_tokens=False, split_special_tokens=split_special)``; for
    a fast tokenizer, from a copy of its Rust backend per setting (``fast_backends``), through its
    batch call: ``Tokenizer.encode`` holds the interpreter lock while it encodes (a long doc froze a
    front end's event loop and every other tokenizer thread for as long: ~60 ms for 20k words on a
    2-core VM), ``encode_batch`` releases it, and its ``_fast`` form skips the character offsets
    (~20% of a 60-token doc's encode)."""
    if not text:
        return []
    backends = fast_backends(tokenizer)
    if backends is None:
        return tokenizer.encode(text, add_special_tokens=False, split_special_tokens=split_special)
    backend = backends[split_special]
    encode = getattr(backend, "encode_batch_fast", backend.encode_batch)  # _fast: tokenizers 0.21+
    return encode([text], add_special_tokens=False)[0].ids


@lru_cache(maxsize=8)
def fast_backends(tokenizer):
    """Two copies of a fast tokenizer's Rust backend, special tokens parsed and encoded as text, or
    None where transformers' wrapper does more than call it (a slow tokenizer; truncation or
    padding set on the backend). Called directly, a 50-token doc encodes in half the wrapper's
    time; and the setting is never switched on a backend the tokenizer threads share (the
    wrapper switches its one backend's for every call)."""
    if not isinstance(tokenizer, BackendTokenizer):
        spec = TokenizerSpec.of(tokenizer)
        if spec is None:
            return None
        tokenizer = BackendTokenizer(spec)
    return tokenizer.backends


def _checked_ids(ids: Sequence[int], vocab_size: int, field_name: str) -> Sequence[int]:
    """``ids`` once each is known to be in the vocabulary, as ``token_ids`` keeps them (a long list
    as TokenIds, checked by numpy's min and max: ~10 us for 8,000 ids, where a tuple's took 300 on
    a 2-core VM); InvalidInput naming ``field_name`` and the first id outside it."""
    if isinstance(ids, TokenIds):
        array = ids.array
    elif len(ids) <= SHORT:
        out = tuple(map(int, ids))
        if out and not (min(out) >= 0 and max(out) < vocab_size):
            bad = next(t for t in out if not 0 <= t < vocab_size)
            raise InvalidInput(field_name, f"token id {bad} outside the vocabulary of {vocab_size}")
        return out
    else:
        array = np.asarray(ids)
        if array.dtype.kind not in "iu" or array.ndim != 1:  # ints past int64, or not ints at all
            array = np.array([int(t) for t in ids], dtype=object)
    if len(array) and not (array.min() >= 0 and array.max() < vocab_size):
        bad = array[(array < 0) | (array >= vocab_size)][0]
        raise InvalidInput(field_name, f"token id {int(bad)} outside the vocabulary of {vocab_size}")
    return ids if isinstance(ids, TokenIds) else TokenIds(array)
