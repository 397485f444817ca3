"""Train the embedded default's tokenizer once: byte-level BPE, 8,192 entries (the chat template's
special tokens last, as Qwen's are), written to scorer/models/tokenizer.json.

    python scripts/train_tokenizer.py           # (re)write scorer/models/tokenizer.json
    python scripts/train_tokenizer.py --check   # exit 1 unless training reproduces the shipped file

The text sample is English prose that ships with every CPython, never the load tool's word list
(loadtest/words.py): the language reference's help topics (``pydoc_data.topics``) and the
docstrings of the standard library's top-level modules, plus reranker exchanges in the
``qwen3_reranker`` template (scorer/request.py) so that its labels ``yes`` and ``no`` are tokens.
The sample differs between Python versions, and so would a retrained file: the shipped one was
trained on CPython 3.11.7 with tokenizers 0.23.3 (``SAMPLE_SHA256``). The checkpoint writer copies
the shipped bytes verbatim (scorer/models/tiny.py), so no machine depends on this script or on its
own ``tokenizers`` version to write the same checkpoint; tests/test_model.py pins the file's hash.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import sys
import sysconfig
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scorer.models.tiny import SPECIAL_TOKENS, TOKENIZER_JSON  # noqa: E402
from scorer.request import DEFAULT_LABELS, TEMPLATES  # noqa: E402

VOCAB_SIZE = 8192
SAMPLE_SHA256 = "84ceabc26a68e261d21bf8863dfb5cb4c31eb34b7b2711263bdf842f88e79908"  # CPython 3.11.7
EXCHANGES = (  # (query, document, answer): a few reranker calls as the template formats them
    ("what is rope", "Rotary position embeddings rotate queries and keys by an angle.", "yes"),
    ("what is rope", "A rope is a bundle of fibres twisted together for strength.", "no"),
    ("capital of france", "Paris is the capital and largest city of France.", "yes"),
    ("capital of france", "The river flows north through the valley towards the sea.", "no"),
    ("how to boil an egg", "Place the egg in boiling water for seven minutes, then cool it.", "yes"),
    ("how to boil an egg", "The museum opens at nine in the morning on weekdays.", "no"),
    ("python list sort", "list.sort() sorts the list in place; sorted() returns a new list.", "yes"),
    ("python list sort", "The weather will be cloudy with light rain in the afternoon.", "no"),
)


def sample() -> list[str]:
    """The training text, in a fixed order."""
    from pydoc_data.topics import topics

    out = [topics[k] for k in sorted(topics)]
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                doc = ast.get_docstring(node)
                if doc:
                    out.append(doc)
    t = TEMPLATES["qwen3_reranker"]
    for query, doc, answer in EXCHANGES * 16:
        prefix = t.prefix_text(query, "")
        out.append(f"{prefix}{t.item_head}{t.doc_lead}{doc}{t.item_tail}{answer}<|im_end|>\n")
    return out


def train(texts: list[str]) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(SPECIAL_TOKENS),
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # the special tokens go in after training: the template's strings are then never split (they
    # are matched before the model runs) and take the last ids, as in Qwen's vocabulary
    tokenizer.train_from_iterator([_without_special(t) for t in texts], trainer)
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    return tokenizer


def _without_special(text: str) -> str:
    for token in SPECIAL_TOKENS:
        text = text.replace(token, "\n")
    return text


def check(tokenizer: Tokenizer) -> None:
    assert tokenizer.get_vocab_size() == VOCAB_SIZE, tokenizer.get_vocab_size()
    for word in (*DEFAULT_LABELS, *SPECIAL_TOKENS):
        ids = tokenizer.encode(word, add_special_tokens=False).ids
        assert len(ids) == 1 and tokenizer.token_to_id(word) == ids[0], f"{word!r} is not one token: {ids}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--check", action="store_true", help="compare with the shipped file instead of writing it"
    )
    a = ap.parse_args(argv)
    texts = sample()
    digest = hashlib.sha256("\x00".join(texts).encode()).hexdigest()
    print(f"sample: {len(texts)} texts, {sum(map(len, texts)):,} characters, sha256 {digest}")
    if digest != SAMPLE_SHA256:
        print(f"note: not the sample of the shipped file ({SAMPLE_SHA256}): another Python version")
    tokenizer = train(texts)
    check(tokenizer)
    data = tokenizer.to_str().encode()
    if a.check:
        same = data == TOKENIZER_JSON.read_bytes()
        print(f"{TOKENIZER_JSON.name}: {'reproduced exactly' if same else 'DIFFERS'}")
        return 0 if same else 1
    TOKENIZER_JSON.write_bytes(data)
    print(f"wrote {TOKENIZER_JSON} ({len(data):,} bytes, sha256 {hashlib.sha256(data).hexdigest()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
