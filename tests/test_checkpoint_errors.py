"""A checkpoint directory the engine cannot run ends ``scorer score`` and ``scorer serve`` with one
line naming what is wrong, and exit code 2: no traceback, no model loaded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import BertConfig, Qwen2Config

from scorer.cli import main
from scorer.config import SUPPORTED_ARCHITECTURES, CheckpointError
from scorer.models import tiny
from scorer.models.loader import check_checkpoint, load_tokenizer

SMALL = dict(vocab_size=tiny.VOCAB_SIZE, hidden_size=64, intermediate_size=96, num_hidden_layers=2)
HEADS = dict(num_attention_heads=4, num_key_value_heads=2)


def unsupported(path: Path) -> Path:
    BertConfig(**SMALL, num_attention_heads=4, architectures=["BertForMaskedLM"]).save_pretrained(path)
    save_file({"x": torch.zeros(1)}, str(path / "model.safetensors"))
    tiny.write_tokenizer(path)
    return path


def qwen2(path: Path, weights: bool = True, tokenizer: bool = True) -> Path:
    Qwen2Config(**SMALL, **HEADS, architectures=["Qwen2ForCausalLM"]).save_pretrained(path)
    if weights:
        save_file({"x": torch.zeros(1)}, str(path / "model.safetensors"))
    else:
        torch.save({}, path / "pytorch_model.bin")
    if tokenizer:
        tiny.write_tokenizer(path)
    else:  # what transformers builds an empty tokenizer from
        (path / "tokenizer_config.json").write_text(
            json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"})
        )
    return path


def resized(path: Path) -> Path:
    """A real checkpoint whose config.json was edited after it was saved."""
    from transformers import AutoModelForCausalLM

    config = Qwen2Config(**SMALL, **HEADS, architectures=["Qwen2ForCausalLM"])
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tiny.write_tokenizer(path)
    values = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**values, "intermediate_size": 128}))
    return path


CASES = {
    "unsupported architecture": (unsupported, "unsupported architecture 'BertForMaskedLM'; supported: "),
    "no safetensors": (
        lambda p: qwen2(p, weights=False),
        "has no \\*.safetensors weights \\(found pytorch_model.bin: convert them to safetensors\\)",
    ),
    "no tokenizer": (
        lambda p: qwen2(p, tokenizer=False),
        "has no tokenizer files \\(tokenizer.json or tokenizer.model or vocab.json \\+ merges.txt\\)",
    ),
    "weights of another model": (
        qwen2,
        "does not match Qwen2ForCausalLM: missing 2\\d tensors \\(lm_head.weight, .*\\),"
        " unexpected 1 tensor \\(x\\)",
    ),
    "weights of another size": (
        resized,
        "does not match its config.json: model.layers.0.mlp.down_proj.weight is \\[64, 96\\]",
    ),
    "config not JSON": (lambda p: (p / "config.json").write_text("{") and p, "config.json cannot be read"),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("command", ["score", "serve"])
def test_a_checkpoint_mistake_is_one_line_and_exit_2(case, command, tmp_path, capfd):
    build, message = CASES[case]
    model = build(tmp_path / "ckpt") if (tmp_path / "ckpt").mkdir() is None else None
    docs = tmp_path / "docs.jsonl"
    docs.write_text('{"text": "a doc"}\n')
    args = ["--model", str(model)]
    argv = ["score", "--prompt", "q", "--docs", str(docs), *args] if command == "score" else ["serve", *args]
    capfd.readouterr()  # what building the directory printed
    assert main(argv) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    assert "--model (model)" in err[0]
    with pytest.raises(CheckpointError, match=message):
        check_checkpoint(model)


def test_the_supported_list_names_every_family_and_head():
    assert {
        a.removesuffix("ForCausalLM").removesuffix("ForSequenceClassification")
        for a in SUPPORTED_ARCHITECTURES
    } == {
        "Qwen3",
        "Qwen2",
        "Llama",
        "Mistral",
        "Gemma",
        "Gemma2",
    }
    assert len(SUPPORTED_ARCHITECTURES) == 12


def test_an_empty_tokenizer_is_refused(tmp_path):
    """A tokenizer.json of one entry (what transformers builds from tokenizer_config.json alone)."""
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")).save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(CheckpointError, match="the tokenizer files hold 1 token"):
        load_tokenizer(tmp_path)
