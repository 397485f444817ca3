"""A front end's tokenizer (``scorer.tokenizer``): the engine's fast backend, sent in its
EngineInfo and rebuilt without transformers, encodes and looks up tokens as the engine's
transformers tokenizer does, so a front end turns every request into the engine's Job."""

import dataclasses
import pickle
import subprocess
import sys

from scorer.engine import Tokenizing
from scorer.request import Doc, InvalidInput, ScoreOptions, ScoreRequest
from scorer.server.frontend_process import front_tokenizer
from scorer.tokenizer import BackendTokenizer, TokenizerSpec

TEXTS = (
    "",
    "plain words",
    "a <|im_end|> b",
    "<|im_start|>user\nwhat is rope<|im_end|>\n",
    "ünïcödé 北京 🙂 \t tabs",
    "  leading and trailing  ",
    "<|im_end|><|im_end|>no space",
    "x" * 3000,
)


def test_the_front_ends_tokenizer_encodes_and_looks_up_as_the_engines(engine):
    ref, tok = engine.tokenizer, front_tokenizer(engine.info)
    assert isinstance(tok, BackendTokenizer) and ref.is_fast
    for text in TEXTS:
        for add in (True, False):
            for split in (None, False, True):
                kw = {"add_special_tokens": add, "split_special_tokens": split}
                assert tok.encode(text, **kw) == ref.encode(text, **kw), (text[:40], kw)
    vocab = sorted(ref.get_vocab())
    words = [*vocab[:: max(1, len(vocab) // 300)], *ref.added_tokens_encoder, "no such token", ""]
    assert [tok.convert_tokens_to_ids(w) for w in words] == [ref.convert_tokens_to_ids(w) for w in words]
    assert (tok.unk_token, tok.unk_token_id) == (ref.unk_token, ref.unk_token_id)
    assert tok.added_tokens_encoder == ref.added_tokens_encoder and len(tok) == len(ref)
    assert tok.backend_tokenizer.get_vocab() == ref.backend_tokenizer.get_vocab()


def _requests() -> list[ScoreRequest]:
    docs = [Doc("rotary embeddings", id="a"), Doc("a <|im_end|> b", id="b"), Doc("x " * 700, id="c")]
    return [
        ScoreRequest("what is rope", docs, instruction="Find it"),
        ScoreRequest("q <|im_end|> q", docs, options=ScoreOptions(special_tokens="text")),
        ScoreRequest("q", docs, options=ScoreOptions(doc_special_tokens="text", truncate="doc_end")),
        ScoreRequest("q", docs[:1], options=ScoreOptions(template="plain", label_tokens=("a", "b"))),
        ScoreRequest("q", docs[:1], options=ScoreOptions(label_tokens=("a", "not one token"))),
    ]


def _job_or_error(tokenizing: Tokenizing, req: ScoreRequest):
    try:
        job = tokenizing.tokenize(req)
    except InvalidInput as e:
        return e.field, str(e)
    return (
        tuple(job.prefix_ids),
        job.items,
        job.doc_tokens,
        job.truncated,
        job.label_ids,
        job.shape,
        job.tokens,
    )


def test_a_front_end_turns_each_request_into_the_engines_job(engine):
    ref = Tokenizing(engine.tokenizer, engine.info)
    front = Tokenizing(front_tokenizer(engine.info), engine.info)
    answers = [(_job_or_error(front, r), _job_or_error(ref, r)) for r in _requests()]
    assert all(mine == theirs for mine, theirs in answers), answers
    assert isinstance(answers[-1][0][0], str)  # the error case: refused alike, naming its field


def test_a_tokenizer_whose_calls_do_more_than_its_backend_is_loaded_by_transformers(engine):
    truncating = type(engine.tokenizer).from_pretrained(engine.info.model_dir)
    truncating._tokenizer.enable_truncation(16)
    assert TokenizerSpec.of(truncating) is None
    without = dataclasses.replace(engine.info, tokenizer=None)
    tok = front_tokenizer(without)
    assert not isinstance(tok, BackendTokenizer)
    assert tok.encode("plain words") == engine.tokenizer.encode("plain words")


def test_a_front_end_process_tokenizes_without_torch_transformers_or_the_model(engine, tmp_path):
    """A front end's start on the 2-core VM (``python -m bench.frontend_start``): 0.8 s without
    torch's import, 4.3 s with it, 4.8 s with the model runner's imports too (transformers among
    them), 11-13 s through transformers' AutoTokenizer. Torch is named (``scorer.lazy_torch``) and
    never imported while a front end turns calls of text and of token ids into Jobs."""
    info = tmp_path / "info.pkl"
    info.write_bytes(pickle.dumps(engine.info))
    code = (
        "import pickle, sys\n"
        "from scorer.server.frontend_process import front_tokenizer\n"
        "from scorer.engine import Tokenizing\n"
        "from scorer.request import Doc, ScoreOptions, ScoreRequest\n"
        f"info = pickle.load(open({str(info)!r}, 'rb'))\n"
        "tok = Tokenizing(front_tokenizer(info), info)\n"
        "for scheme in ('', 'naive', 'multi_item', 'cascade'):\n"
        "    docs = [Doc(text='a cat is an animal'), Doc(token_ids=(5, 6, 7))]\n"
        "    tok.tokenize(ScoreRequest('what is a cat', docs, options=ScoreOptions(scheme=scheme)))\n"
        "    tok.tokenize(ScoreRequest('', docs, prompt_token_ids=tuple(range(9, 300))))\n"
        "heavy = ('torch._C', 'transformers', 'scorer.runner', 'scorer.models.decoder')\n"
        "print(sorted(m for m in heavy if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], timeout=300, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


def test_the_engine_side_loads_torch_as_it_imports_before_any_thread_starts():
    """``scorer.lazy_torch``'s loader takes no lock on Python 3.11: the modules that build an engine
    import torch whole, on the importing thread, so no serving thread can race its first read."""
    code = (
        "import threading, scorer.lazy_torch as lt\n"
        "assert not lt.loaded()\n"
        "import scorer.runtime\n"
        "print(lt.loaded(), threading.active_count())"
    )
    out = subprocess.run([sys.executable, "-c", code], timeout=300, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.split() == ["True", "1"], out.stdout + out.stderr
