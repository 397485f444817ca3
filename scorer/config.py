"""Model hyperparameters read from a Hugging Face config.json, independent of any kernel."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, PreTrainedConfig

QK_NORM_BY_ARCHITECTURE: dict[str, bool] = {"Qwen3ForCausalLM": True, "LlamaForCausalLM": False}
_ARCHITECTURE_BY_MODEL_TYPE = {"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}
# "dynamic" and "longrope" change their frequencies with the sequence length at run time.
_STATIC_ROPE_TYPES = {"default", "linear", "llama3", "yarn"}


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
    attention_bias: bool
    mlp_bias: bool
    qk_norm: bool
    rope_type: str = "default"
    rope_theta: float = 10000.0
    dtype: torch.dtype | None = None
    """Dtype the checkpoint was saved in, when config.json says so."""
    hf_config: PreTrainedConfig | None = field(default=None, compare=False, hash=False, repr=False)
    """The transformers config; RoPE variants other than "default" read their parameters from it."""

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.rope_type != "default" and self.hf_config is None:
            raise ValueError(f"rope_type={self.rope_type!r} needs hf_config for its parameters")

    @classmethod
    def from_hf(cls, source: str | Path | Mapping[str, Any] | PreTrainedConfig) -> ModelConfig:
        """Build from a checkpoint directory, a config.json path, a config dict or a transformers config."""
        hf = _load_hf_config(source)
        architecture = _architecture(hf)
        if architecture not in QK_NORM_BY_ARCHITECTURE:
            raise ValueError(
                f"unsupported architecture {architecture!r}; supported: {sorted(QK_NORM_BY_ARCHITECTURE)}"
            )
        if getattr(hf, "hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {hf.hidden_act!r}; only silu")
        if any(t != "full_attention" for t in getattr(hf, "layer_types", None) or []):
            raise ValueError("sliding-window layers are not supported")
        rope = dict(hf.rope_parameters or {})
        rope_type = rope.get("rope_type", "default")
        if rope_type not in _STATIC_ROPE_TYPES:
            raise ValueError(f"unsupported rope_type {rope_type!r}; supported: {sorted(_STATIC_ROPE_TYPES)}")
        if rope.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError("partial rotary embeddings are not supported")
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
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
            attention_bias=bool(getattr(hf, "attention_bias", False)),
            mlp_bias=bool(getattr(hf, "mlp_bias", False)),
            qk_norm=QK_NORM_BY_ARCHITECTURE[architecture],
            rope_type=rope_type,
            rope_theta=float(rope.get("rope_theta", getattr(hf, "default_theta", 10000.0))),
            dtype=_torch_dtype(getattr(hf, "dtype", None)),
            hf_config=hf,
        )


def _load_hf_config(source: str | Path | Mapping[str, Any] | PreTrainedConfig) -> PreTrainedConfig:
    if isinstance(source, PreTrainedConfig):
        return source
    if isinstance(source, Mapping):
        values = dict(source)
        model_type = values.pop("model_type", None)
        if model_type is None:
            by_arch = {arch: mt for mt, arch in _ARCHITECTURE_BY_MODEL_TYPE.items()}
            model_type = by_arch.get((values.get("architectures") or [None])[0])
        if model_type is None:
            raise ValueError("config dict needs 'model_type' or a known 'architectures' entry")
        return AutoConfig.for_model(model_type, **values)
    path = Path(source)
    if path.is_dir() and not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} has no config.json")
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist")
    return AutoConfig.from_pretrained(str(path), local_files_only=True)


def _architecture(hf: PreTrainedConfig) -> str:
    if hf.architectures:
        return hf.architectures[0]
    try:
        return _ARCHITECTURE_BY_MODEL_TYPE[hf.model_type]
    except KeyError:
        raise ValueError(
            f"config names no architecture and model_type {hf.model_type!r} is unknown"
        ) from None


def _torch_dtype(value: object) -> torch.dtype | None:
    if isinstance(value, torch.dtype):
        return value
    if isinstance(value, str):
        dtype = getattr(torch, value, None)
        return dtype if isinstance(dtype, torch.dtype) else None
    return None
