"""Fixtures of the GPU tests: a small random Qwen3 checkpoint with head_dim 128 (so the GPU kit's
prebuilt FlashInfer kernels serve it), written once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from scorer.models.tiny import CONFIG as TINY_CONFIG
from scorer.models.tiny import write_random_checkpoint

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
    return write_random_checkpoint(out_dir, config, seed, INIT_STD)


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("ckpt") / "rand-qwen3-hd128")
