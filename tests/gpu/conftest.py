"""Fixtures of the GPU tests: a small random Qwen3 checkpoint with head_dim 128 (so the GPU kit's
prebuilt FlashInfer kernels serve it), written once per session."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from scorer.config import ModelConfig
from scorer.models.decoder import DecoderLM
from scorer.models.tiny import CONFIG as TINY_CONFIG
from scorer.models.tiny import build_tokenizer

HEAD_DIM = 128
CONFIG: dict = {
    **TINY_CONFIG,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": HEAD_DIM,
    "max_position_embeddings": 8192,
}
# Log-probs then spread by 0.1-0.25 across docs while bf16 moves them by about 0.01 (CPU bf16).
INIT_STD = 0.05


def write_checkpoint(out_dir: Path, config: dict = CONFIG, seed: int = 0) -> Path:
    """A loadable HF-style checkpoint with seeded random weights (norms at one)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    with torch.device("meta"):
        model = DecoderLM(ModelConfig.from_hf(config))
    g = torch.Generator().manual_seed(seed)
    weights = {}
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            weights[name] = torch.ones(p.shape)
        else:
            weights[name] = torch.randn(p.shape, generator=g) * INIT_STD
    save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    build_tokenizer().save_pretrained(str(out_dir))
    return out_dir


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("ckpt") / "rand-qwen3-hd128")
