"""Building an engine from a checkpoint directory (or the embedded tiny default): the attention
backend and the model's kernels are decided here, once, before the model is built."""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

import torch

from .attention import HeadSpec, make_backend
from .config import ModelConfig
from .engine import Engine, EngineConfig
from .models.loader import load_model
from .models.tiny import ensure_tiny_model
from .options import MODEL_KERNELS
from .prefix_cache import PrefixCache, auto_mib
from .runner import ModelRunner

log = logging.getLogger(__name__)


def model_kernels(name: str, backend: str, device_type: str, plain: bool = True) -> str:
    """Kernels of the model's elementwise work (see DecoderLM): ``torch`` (HF's op order and
    rounding), ``flashinfer`` (fused norm, RoPE, SiLU-and-mul) or ``fused`` (those, one QKV GEMM and
    Triton's q/k norm + RoPE); ``auto`` takes ``fused`` with FlashInfer attention on CUDA (
    ``flashinfer`` where Triton is missing), ``torch`` otherwise, and for a model whose layers
    those kernels do not cover (not ``plain``: Gemma's families, ``ModelConfig.plain_kernels``)."""
    if name not in MODEL_KERNELS:
        raise ValueError(f"unknown model kernels {name!r}; expected one of {', '.join(MODEL_KERNELS)}")
    if name == "auto":
        if backend != "flashinfer" or device_type != "cuda" or not plain:
            return "torch"
        return "fused" if importlib.util.find_spec("triton") is not None else "flashinfer"
    return name


def build_engine(
    model_dir: str | Path | None = None,
    attention_backend: str = "auto",
    device: str | None = None,
    dtype: torch.dtype | None = None,
    config: EngineConfig | None = None,
    *,
    attention_fallback: str = "none",
    kernels: str = "auto",
    cuda_graph_max_tokens: int = 16384,
    prefix_cache_mib: int | str = 0,
    prefix_cache_admit: int | str = "auto",
    quantization: str = "none",
) -> Engine:
    """fp32 on CPU, bf16 on GPU unless ``dtype`` says otherwise; no ``model_dir``: the tiny default.
    ``prefix_cache_mib``: the prefix cache's pool (0: none; ``auto``: see ``prefix_cache.auto_mib``);
    ``prefix_cache_admit``: when it keeps a prompt block, auto, 1 or 2 sightings (see ``prefix_cache``);
    ``quantization``: ``fp8`` runs the decoder's linears in FP8 (``models/quant.py``).
    Raises BackendUnavailable when ``attention_backend`` cannot run the model (see make_backend)."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = dtype or (torch.bfloat16 if dev.type == "cuda" else torch.float32)
    path = Path(model_dir) if model_dir else ensure_tiny_model()
    mc = ModelConfig.from_hf(path)
    spec = HeadSpec(mc.num_heads, mc.num_kv_heads, mc.head_dim, dtype, dev, mc.attn_scale, mc.attn_soft_cap)
    backend = make_backend(attention_backend, spec, attention_fallback)
    chosen = model_kernels(kernels, backend.name, dev.type, mc.plain_kernels)
    model, tokenizer = load_model(path, dev, dtype, chosen, quantization)
    log.info(
        "model %s on %s (%s), attention %s, %s kernels, linears %s",
        path, dev, dtype, backend.name, chosen, "fp8" if quantization == "fp8" else dtype,
    )  # fmt: skip
    runner = ModelRunner(model, backend, cuda_graph_max_tokens)
    mib = auto_mib(dev) if prefix_cache_mib == "auto" else int(prefix_cache_mib)
    cache = PrefixCache.for_model(mib, mc, dtype, dev, admit=prefix_cache_admit)
    if cache is not None:
        log.info("prefix cache: %d MiB, %d tokens, admission %s", mib, cache.capacity, cache.admit)
    return Engine(runner, tokenizer, config, model_name=path.name, cache=cache, model_dir=str(path))
