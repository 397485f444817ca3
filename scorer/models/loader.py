"""Build a DecoderLM from a local Hugging Face checkpoint directory."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from scorer.config import ModelConfig
from scorer.models import MODEL_CLASSES
from scorer.models.decoder import DecoderLM
from scorer.models.fp8_checkpoint import checkpoint_format
from scorer.models.quant import quantize_model
from scorer.options import QUANTIZATIONS

# Old Llama checkpoints carry the RoPE buffer; it is recomputed from the config.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def load_model(
    model_dir: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    kernels: str = "torch",
    quantization: str = "none",
) -> tuple[DecoderLM, PreTrainedTokenizerBase]:
    """Load weights from all *.safetensors shards and the tokenizer in model_dir.

    dtype None keeps the dtype config.json names (or the stored tensors' dtype if it names none);
    ``kernels``: the model's elementwise kernels (see DecoderLM); ``quantization``: ``fp8`` runs
    the decoder's linears in FP8 (``quant.py``; a pre-quantized checkpoint's FP8 weights as they
    are, ``fp8_checkpoint.py``), ``none`` in ``dtype`` (a pre-quantized checkpoint dequantized).
    """
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {quantization!r}; expected one of {', '.join(QUANTIZATIONS)}")
    model_dir = Path(model_dir)
    config = ModelConfig.from_hf(model_dir)
    shards = sorted(model_dir.glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"{model_dir} has no *.safetensors weights")
    device = torch.device(device)
    dtype = dtype or config.dtype
    fp8_format = checkpoint_format(model_dir)  # None unless pre-quantized; refuses what cannot run

    with torch.device("meta"):
        model = MODEL_CLASSES[config.architecture](config, kernels)
    state = _read_shards(shards, device, None if fp8_format else dtype)
    fp8_linears = None
    if fp8_format is not None:
        state, fp8_linears = fp8_format.split(state, dtype or torch.bfloat16, quantization == "fp8")
    expected = set(model.state_dict())
    missing = expected - state.keys()
    if config.tie_word_embeddings:
        missing.discard("lm_head.weight")
        state.pop("lm_head.weight", None)
    unexpected = state.keys() - expected
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {model_dir} does not match {config.architecture}: "
            f"missing {sorted(missing)[:8]}, unexpected {sorted(unexpected)[:8]}"
        )
    model.load_state_dict(state, strict=False, assign=True)
    model.eval().requires_grad_(False)
    model.finalize()
    if quantization == "fp8":
        quantize_model(model, fp8_linears)

    return model, load_tokenizer(model_dir)


def load_tokenizer(model_dir: str | Path):
    return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)


def _read_shards(
    shards: list[Path], device: torch.device, dtype: torch.dtype | None
) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for shard in shards:
        with safe_open(str(shard), framework="pt", device=str(device)) as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                if name.endswith(_IGNORED_SUFFIXES):
                    continue
                tensor = f.get_tensor(name)
                if dtype is not None and tensor.is_floating_point():
                    tensor = tensor.to(dtype)
                state[name] = tensor
    return state
