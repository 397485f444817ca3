"""Build a DecoderLM from a local Hugging Face checkpoint directory."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from scorer.config import CheckpointError, ModelConfig
from scorer.models.decoder import DecoderLM

# Old Llama checkpoints carry the RoPE buffer; it is recomputed from the config.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
TOKENIZER_FILES = (("tokenizer.json",), ("tokenizer.model",), ("vocab.json", "merges.txt"))
"""Any one of these sets of files is a tokenizer transformers can load; without one it would build
an empty tokenizer from tokenizer_config.json alone."""


def check_checkpoint(model_dir: str | Path) -> ModelConfig:
    """The checkpoint's config, once the directory has what loading needs (a supported config.json,
    *.safetensors weights, tokenizer files), before any weights are read; else CheckpointError in
    one line naming what is missing or unsupported."""
    model_dir = Path(model_dir)
    config = ModelConfig.from_hf(model_dir)
    if not any(model_dir.glob("*.safetensors")):
        other = sorted(p.name for p in model_dir.glob("*.bin")) + sorted(
            p.name for p in model_dir.glob("*.pt")
        )
        found = f" (found {', '.join(other[:3])}: convert them to safetensors)" if other else ""
        raise CheckpointError(f"{model_dir} has no *.safetensors weights{found}")
    if not any(all((model_dir / f).is_file() for f in files) for files in TOKENIZER_FILES):
        names = " or ".join(" + ".join(files) for files in TOKENIZER_FILES)
        raise CheckpointError(f"{model_dir} has no tokenizer files ({names})")
    return config


def load_model(
    model_dir: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    kernels: str = "torch",
) -> tuple[DecoderLM, PreTrainedTokenizerBase]:
    """Load weights from all *.safetensors shards and the tokenizer in model_dir.

    dtype None keeps the dtype config.json names (or the stored tensors' dtype if it names none);
    ``kernels``: the model's elementwise kernels (see DecoderLM). A checkpoint the engine cannot
    run raises CheckpointError (``check_checkpoint``; weights that do not match the config).
    """
    model_dir = Path(model_dir)
    config = check_checkpoint(model_dir)
    shards = sorted(model_dir.glob("*.safetensors"))
    device = torch.device(device)
    dtype = dtype or config.dtype

    with torch.device("meta"):
        model = DecoderLM(config, kernels)
    state = _read_shards(shards, device, dtype)
    expected = set(model.state_dict())
    missing = expected - state.keys()
    if config.tie_word_embeddings or config.num_labels:
        missing.discard("lm_head.weight")
        state.pop("lm_head.weight", None)
    unexpected = state.keys() - expected
    if missing or unexpected:
        raise CheckpointError(
            f"checkpoint {model_dir} does not match {config.architecture}: "
            f"missing {sorted(missing)[:8]}, unexpected {sorted(unexpected)[:8]}"
        )
    model.load_state_dict(state, strict=False, assign=True)
    model.eval().requires_grad_(False)
    model.finalize()

    return model, load_tokenizer(model_dir)


def load_tokenizer(model_dir: str | Path):
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    if len(tokenizer) < 2:
        raise CheckpointError(f"{model_dir}: the tokenizer files hold {len(tokenizer)} token(s)")
    return tokenizer


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
