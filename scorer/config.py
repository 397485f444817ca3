"""Model hyperparameters read from a Hugging Face config.json, independent of any kernel."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, PreTrainedConfig

QUANT_METHODS = ("compressed-tensors", "fp8")
"""The quantization_config methods a checkpoint may name (their FP8 formats: models/fp8_checkpoint.py)."""


@dataclass(frozen=True)
class Family:
    """What a decoder family does differently from Llama (see ``ModelConfig``'s fields)."""

    qk_norm: bool = False
    qkv_bias: bool | None = None  # None: the config's attention_bias (q/k/v and o alike)
    o_bias: bool | None = None
    gemma: bool = False  # embedding * sqrt(hidden), RMSNorm of (1 + weight) in fp32
    sandwich_norms: bool = False  # Gemma 2's norms after attention and around the MLP
    act_field: str = "hidden_act"  # the config field of the MLP's activation, as transformers reads it


FAMILIES: dict[str, Family] = {
    "Qwen3": Family(qk_norm=True),
    "Qwen2": Family(qkv_bias=True, o_bias=False),
    "Llama": Family(),
    "Mistral": Family(qkv_bias=False, o_bias=False),
    "Gemma": Family(gemma=True),
    "Gemma2": Family(gemma=True, sandwich_norms=True, act_field="hidden_activation"),
}
HEADS = {"ForCausalLM": "lm", "ForSequenceClassification": "score"}
SUPPORTED_ARCHITECTURES = tuple(f + h for f in FAMILIES for h in HEADS)
_ARCHITECTURE_BY_MODEL_TYPE = {f.lower(): f + "ForCausalLM" for f in FAMILIES}
ACTIVATIONS = ("silu", "gelu_pytorch_tanh", "gelu")
# "dynamic" and "longrope" change their frequencies with the sequence length at run time.
_STATIC_ROPE_TYPES = {"default", "linear", "llama3", "yarn"}
_LAYER_TYPES = ("full_attention", "sliding_attention")


class CheckpointError(ValueError):
    """A checkpoint directory the engine cannot run, in one line naming the file that is missing or
    the option that is not supported."""


class UnsupportedQuantization(CheckpointError):
    """The checkpoint's ``quantization_config`` names a format the engine cannot run."""


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections
    mlp_bias: bool
    qk_norm: bool
    rope_type: str = "default"
    rope_theta: float = 10000.0
    dtype: torch.dtype | None = None
    """Dtype the checkpoint was saved in, when config.json says so."""
    o_bias: bool | None = None  # None: as attention_bias
    hidden_act: str = "silu"  # the MLP's act(gate) * up
    gemma: bool = False  # embedding * sqrt(hidden) (rounded to the weights' dtype), norms of 1 + weight
    sandwich_norms: bool = False  # Gemma 2: attention's output and the MLP's in- and output normed
    attn_scale: float | None = None  # None: head_dim ** -0.5 (Gemma 2: query_pre_attn_scalar ** -0.5)
    attn_soft_cap: float = 0.0  # attention logits -> cap * tanh(logits / cap); 0: none
    final_soft_cap: float = 0.0  # the LM head's logits, likewise
    sliding_window: int = 0  # keys within this many positions (some or all layers); 0: none
    num_labels: int = 0
    """A score head's outputs (``*ForSequenceClassification``: ``score.weight``); 0: the LM head."""
    hf_config: PreTrainedConfig | None = field(default=None, compare=False, hash=False, repr=False)
    """The transformers config; RoPE variants other than "default" read their parameters from it."""

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise CheckpointError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.rope_type != "default" and self.hf_config is None:
            raise ValueError(f"rope_type={self.rope_type!r} needs hf_config for its parameters")

    @property
    def head(self) -> str:
        """``lm`` (label tokens' log-probs from the LM head) or ``score`` (a classification head)."""
        return "score" if self.num_labels else "lm"

    @property
    def max_positions(self) -> int:
        """Positions a prompt + document may span. A sliding window bounds it: within the window
        every key is seen, so attention is exactly full attention; past it, it would not be (not
        implemented)."""
        if self.sliding_window:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    @property
    def plain_kernels(self) -> bool:
        """Does the decoder run on FlashInfer's and Triton's elementwise kernels (SiLU, Llama's
        RMSNorm, no sandwich norms)? Gemma's families run the torch kernels."""
        return self.hidden_act == "silu" and not (self.gemma or self.sandwich_norms)

    @classmethod
    def from_hf(cls, source: str | Path | Mapping[str, Any] | PreTrainedConfig) -> ModelConfig:
        """Build from a checkpoint directory, a config.json path, a config dict or a transformers
        config; raises CheckpointError naming what the engine cannot run."""
        hf = _load_hf_config(source)
        architecture = _architecture(hf)
        family_name, head = _split_architecture(architecture)
        family = FAMILIES[family_name]
        act = getattr(hf, family.act_field, None) or "silu"
        if act not in ACTIVATIONS:
            raise CheckpointError(f"unsupported hidden_act {act!r}; supported: {', '.join(ACTIVATIONS)}")
        quantized = getattr(hf, "quantization_config", None)
        if quantized:  # the FP8 formats' details are checked by models/fp8_checkpoint.py
            method = (
                quantized.get("quant_method") if isinstance(quantized, dict) else type(quantized).__name__
            )
            if method not in QUANT_METHODS:
                raise UnsupportedQuantization(
                    f"quantization_config.quant_method {method!r} is not supported; the engine loads"
                    f" {' and '.join(QUANT_METHODS)} FP8 checkpoints"
                )
        layer_types = list(getattr(hf, "layer_types", None) or [])
        for t in layer_types:
            if t not in _LAYER_TYPES:
                raise CheckpointError(f"unsupported layer type {t!r}; supported: {', '.join(_LAYER_TYPES)}")
        window = getattr(hf, "sliding_window", None) or 0
        if layer_types and "sliding_attention" not in layer_types:
            window = 0  # e.g. Qwen2 with use_sliding_window false: a window in config.json, unused
        rope = dict(hf.rope_parameters or {})
        rope_type = rope.get("rope_type", "default")
        if rope_type not in _STATIC_ROPE_TYPES:
            raise CheckpointError(
                f"unsupported rope_type {rope_type!r}; supported: {sorted(_STATIC_ROPE_TYPES)}"
            )
        if rope.get("partial_rotary_factor", 1.0) != 1.0:
            raise CheckpointError("partial rotary embeddings (partial_rotary_factor) are not supported")
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        bias = bool(getattr(hf, "attention_bias", False))
        scalar = getattr(hf, "query_pre_attn_scalar", None)
        return cls(
            architecture=architecture,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers,
            num_heads=hf.num_attention_heads,
            num_kv_heads=hf.num_key_value_heads or hf.num_attention_heads,
            head_dim=head_dim,
            rms_norm_eps=hf.rms_norm_eps,
            max_position_embeddings=hf.max_position_embeddings,
            tie_word_embeddings=bool(hf.tie_word_embeddings),
            attention_bias=bias if family.qkv_bias is None else family.qkv_bias,
            mlp_bias=bool(getattr(hf, "mlp_bias", False)),
            qk_norm=family.qk_norm,
            rope_type=rope_type,
            rope_theta=float(rope.get("rope_theta", getattr(hf, "default_theta", 10000.0))),
            dtype=_torch_dtype(getattr(hf, "dtype", None)),
            o_bias=bias if family.o_bias is None else family.o_bias,
            hidden_act=act,
            gemma=family.gemma,
            sandwich_norms=family.sandwich_norms,
            attn_scale=float(scalar) ** -0.5 if scalar else None,
            attn_soft_cap=float(getattr(hf, "attn_logit_softcapping", None) or 0.0),
            final_soft_cap=float(getattr(hf, "final_logit_softcapping", None) or 0.0),
            sliding_window=int(window),
            num_labels=int(hf.num_labels) if HEADS[head] == "score" else 0,
            hf_config=hf,
        )


def _split_architecture(architecture: str) -> tuple[str, str]:
    """(family, head suffix) of a supported architecture; else CheckpointError naming them."""
    for suffix in HEADS:
        family = architecture.removesuffix(suffix)
        if family != architecture and family in FAMILIES:
            return family, suffix
    raise CheckpointError(
        f"unsupported architecture {architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def _load_hf_config(source: str | Path | Mapping[str, Any] | PreTrainedConfig) -> PreTrainedConfig:
    if isinstance(source, PreTrainedConfig):
        return source
    if isinstance(source, Mapping):
        values = dict(source)
        model_type = values.pop("model_type", None)
        if model_type is None and not values.get("architectures"):
            raise CheckpointError("config needs 'model_type' or 'architectures'")
        if model_type is None:
            model_type = _split_architecture(values["architectures"][0])[0].lower()
        return AutoConfig.for_model(model_type, **values)
    path = Path(source)
    if path.is_dir() and not (path / "config.json").is_file():
        raise CheckpointError(f"{path} has no config.json")
    if not path.exists():
        raise CheckpointError(f"{path} does not exist")
    try:
        return AutoConfig.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError, KeyError) as e:  # not JSON, or a model_type transformers lacks
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{path}: config.json cannot be read ({first})") from None


def _architecture(hf: PreTrainedConfig) -> str:
    if hf.architectures:
        return hf.architectures[0]
    try:
        return _ARCHITECTURE_BY_MODEL_TYPE[hf.model_type]
    except KeyError:
        raise CheckpointError(
            f"config.json names no architecture and model_type {hf.model_type!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        ) from None


def _torch_dtype(value: object) -> torch.dtype | None:
    if isinstance(value, torch.dtype):
        return value
    if isinstance(value, str):
        dtype = getattr(torch, value, None)
        return dtype if isinstance(dtype, torch.dtype) else None
    return None
