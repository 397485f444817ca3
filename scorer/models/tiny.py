"""The embedded default model: a tiny Qwen3 checkpoint with fixed-seed random weights.

It exists so the scorer runs end to end without downloading anything. Its scores carry no meaning:
the weights are random noise (seeded, so they are reproducible), not a trained ranker.
It is written once as a normal HF checkpoint (config.json, model.safetensors, tokenizer.json,
tokenizer_config.json) and then loaded through `load_model` like any other.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from scorer.config import ModelConfig
from scorer.models.decoder import DecoderLM

NAME = "tiny-qwen3-v1"
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_MERGES = [("y", "e"), ("ye", "s"), ("n", "o"), ("Ġ", "yes"), ("Ġ", "no")]
_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
_SEED = 0
_INIT_STD = 0.05

CONFIG: dict = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "hidden_act": "silu",
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    "tie_word_embeddings": True,
    "attention_bias": False,
    "use_sliding_window": False,
    "bos_token_id": None,
    "eos_token_id": 258 + len(_MERGES),
    "pad_token_id": 256 + len(_MERGES),
    "dtype": "float32",
}


def default_cache_root() -> Path:
    return Path(os.environ.get("SCORER_CACHE_DIR") or Path.home() / ".cache" / "scorer")


def ensure_tiny_model(cache_dir: str | Path | None = None) -> Path:
    """Return the tiny checkpoint's directory, <cache_dir>/tiny-qwen3-v1, writing it on first use.

    cache_dir defaults to $SCORER_CACHE_DIR, else ~/.cache/scorer.
    """
    root = Path(cache_dir) if cache_dir is not None else default_cache_root()
    target = root / NAME
    if all((target / f).is_file() for f in _FILES):
        return target
    if target.exists():
        if any(target.iterdir()):
            raise RuntimeError(f"{target} exists but is not a complete tiny checkpoint; remove it")
        target.rmdir()
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{NAME}-", dir=root))
    try:
        write_tiny_checkpoint(tmp)
        for path in [tmp, *tmp.iterdir()]:
            path.chmod(0o755 if path.is_dir() else 0o644)  # mkdtemp and save_file create owner-only
        os.rename(tmp, target)
    except OSError:
        if not all((target / f).is_file() for f in _FILES):
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def write_tiny_checkpoint(out_dir: Path) -> None:
    write_random_checkpoint(out_dir, CONFIG, _SEED, _INIT_STD)


def write_random_checkpoint(out_dir: Path, config: dict, seed: int = 0, std: float = _INIT_STD) -> Path:
    """A loadable HF-style checkpoint of ``config`` with seeded random weights (norms at one) and
    the tiny byte-level tokenizer; also used by the GPU tests for a head_dim-128 model."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    with torch.device("meta"):
        model = DecoderLM(ModelConfig.from_hf(config))
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            weights[name] = torch.ones(param.shape)
        else:
            weights[name] = torch.randn(param.shape, generator=generator) * std
    save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    build_tokenizer().save_pretrained(str(out_dir))
    return out_dir


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE: 256 byte tokens, a few merges ("yes", "no", " yes", " no"), chat special tokens."""
    vocab = {char: byte for byte, char in sorted(_bytes_to_unicode().items())}
    for left, right in _MERGES:
        vocab[left + right] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=_MERGES))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=CONFIG["max_position_embeddings"],
    )


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map, which the ByteLevel pre-tokenizer emits."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}
