"""Building an engine from a checkpoint directory (or the embedded tiny default)."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from .attention import HeadSpec, make_backend
from .engine import Engine, EngineConfig
from .models.loader import load_model
from .models.tiny import ensure_tiny_model

log = logging.getLogger(__name__)


def build_engine(
    model_dir: str | Path | None = None,
    attention_backend: str = "auto",
    device: str | None = None,
    dtype: torch.dtype | None = None,
    config: EngineConfig | None = None,
) -> Engine:
    """fp32 on CPU, bf16 on GPU unless ``dtype`` says otherwise; no ``model_dir``: the tiny default."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = dtype or (torch.bfloat16 if dev.type == "cuda" else torch.float32)
    path = Path(model_dir) if model_dir else ensure_tiny_model()
    model, tokenizer = load_model(path, dev, dtype)
    mc = model.config
    backend = make_backend(
        attention_backend, HeadSpec(mc.num_heads, mc.num_kv_heads, mc.head_dim, dtype, dev)
    )
    log.info("model %s on %s (%s), attention %s", path, dev, dtype, backend.name)
    return Engine(model, tokenizer, backend, config, model_name=path.name)
