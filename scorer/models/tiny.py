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

from scorer.config import ModelConfig
from scorer.models.decoder import DecoderLM

NAME = "tiny-qwen3-v2"  # v2: the trained 8k BPE tokenizer (v1: 256 byte tokens, five merges)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>")
TOKENIZER_JSON = Path(__file__).with_name("tokenizer.json")  # scripts/train_tokenizer.py wrote it
_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
VOCAB_SIZE = 8192  # the tokenizer's entries, special tokens last
_SPECIAL_ID = {token: VOCAB_SIZE - len(SPECIAL_TOKENS) + i for i, token in enumerate(SPECIAL_TOKENS)}
_SEED = 0
_INIT_STD = 0.05

CONFIG: dict = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": VOCAB_SIZE,
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
    "eos_token_id": _SPECIAL_ID["<|im_end|>"],
    "pad_token_id": _SPECIAL_ID["<|endoftext|>"],
    "dtype": "float32",
}


def default_cache_root() -> Path:
    return Path(os.environ.get("SCORER_CACHE_DIR") or Path.home() / ".cache" / "scorer")


def ensure_tiny_model(cache_dir: str | Path | None = None) -> Path:
    """Return the tiny checkpoint's directory, <cache_dir>/NAME, writing it on first use.

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
    the embedded BPE tokenizer; also used by the GPU tests for a head_dim-128 model."""
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
    write_tokenizer(out_dir, config["max_position_embeddings"])
    return out_dir


def write_tokenizer(out_dir: Path, max_length: int = CONFIG["max_position_embeddings"]) -> None:
    """The shipped tokenizer.json, byte for byte (never re-serialised by this machine's
    ``tokenizers``), and a tokenizer_config.json naming its eos and pad tokens."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "tokenizer.json").write_bytes(TOKENIZER_JSON.read_bytes())
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "model_max_length": max_length,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
