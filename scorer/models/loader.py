"""Build a DecoderLM from a local Hugging Face checkpoint directory."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from scorer.config import CheckpointError, ModelConfig
from scorer.models.decoder import DecoderLM
from scorer.models.fp8_checkpoint import SCALE_SUFFIXES, checkpoint_format
from scorer.models.quant import quantize_model
from scorer.options import QUANTIZATIONS

# Old Llama checkpoints carry the RoPE buffer; it is recomputed from the config.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
TOKENIZER_FILES = (("tokenizer.json",), ("tokenizer.model",), ("vocab.json", "merges.txt"))
"""Any one of these sets of files is a tokenizer transformers can load; without one it would build
an empty tokenizer from tokenizer_config.json alone."""


def check_checkpoint(model_dir: str | Path) -> ModelConfig:
    """The checkpoint's config, once the directory has what loading needs (a supported config.json,
    *.safetensors weights of the config's names and shapes, tokenizer files), from the files'
    headers: no weight is read; else CheckpointError in one line naming what is missing or
    unsupported."""
    model_dir = Path(model_dir)
    config = ModelConfig.from_hf(model_dir)
    fp8 = checkpoint_format(model_dir)
    if not any(model_dir.glob("*.safetensors")):
        other = sorted(p.name for ext in ("*.bin", "*.pt") for p in model_dir.glob(ext))
        found = f" (found {', '.join(other[:3])}: convert them to safetensors)" if other else ""
        raise CheckpointError(f"{model_dir} has no *.safetensors weights{found}")
    if not any(all((model_dir / f).is_file() for f in files) for files in TOKENIZER_FILES):
        names = " or ".join(" + ".join(files) for files in TOKENIZER_FILES)
        raise CheckpointError(f"{model_dir} has no tokenizer files ({names})")
    shapes = {}
    for shard in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            shapes.update((n, tuple(f.get_slice(n).get_shape())) for n in f.keys() if not _ignored(n))  # noqa: SIM118
    if fp8 is not None:  # a pre-quantized checkpoint's weight scales sit beside the model's weights
        shapes = {n: s for n, s in shapes.items() if not n.endswith(SCALE_SUFFIXES)}
    _check_weights(model_dir, config, shapes)
    return config


def _some(names: set[str]) -> str:
    """``3 tensors (a, b, c)``: how many, and the first few names."""
    listed = ", ".join(sorted(names)[:4]) + (", ..." if len(names) > 4 else "")
    return f"{len(names)} tensor{'s' * (len(names) != 1)}" + (f" ({listed})" if names else "")


def _ignored(name: str) -> bool:
    return name.endswith(_IGNORED_SUFFIXES)


def _check_weights(model_dir: Path, config: ModelConfig, shapes: dict[str, tuple[int, ...]]) -> None:
    """The checkpoint's tensors (name: shape) are the model's: none missing (an LM head tied to the
    embedding, or absent beside a score head, aside), none unexpected, none of another shape."""
    with torch.device("meta"):
        expected = {n: tuple(t.shape) for n, t in DecoderLM(config).state_dict().items()}
    shapes = dict(shapes)
    if config.tie_word_embeddings or config.num_labels:
        expected.pop("lm_head.weight", None)
        shapes.pop("lm_head.weight", None)
    missing, unexpected = expected.keys() - shapes.keys(), shapes.keys() - expected.keys()
    if missing or unexpected:
        raise CheckpointError(
            f"checkpoint {model_dir} does not match {config.architecture}: "
            f"missing {_some(missing)}, unexpected {_some(unexpected)}"
        )
    wrong = sorted(n for n in expected if shapes[n] != expected[n])
    if wrong:
        n = wrong[0]
        raise CheckpointError(
            f"checkpoint {model_dir} does not match its config.json: {n} is {list(shapes[n])},"
            f" the config makes it {list(expected[n])}"
        )


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
    A checkpoint the engine cannot run raises CheckpointError (``check_checkpoint``).
    """
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {quantization!r}; expected one of {', '.join(QUANTIZATIONS)}")
    model_dir = Path(model_dir)
    config = check_checkpoint(model_dir)
    shards = sorted(model_dir.glob("*.safetensors"))
    device = torch.device(device)
    dtype = dtype or config.dtype
    fp8_format = checkpoint_format(model_dir)  # None unless pre-quantized

    with torch.device("meta"):
        model = DecoderLM(config, kernels)
    state = _read_shards(shards, device, None if fp8_format else dtype)
    fp8_linears = None
    if fp8_format is not None:
        state, fp8_linears = fp8_format.split(state, dtype or torch.bfloat16, quantization == "fp8")
    if config.tie_word_embeddings or config.num_labels:
        state.pop("lm_head.weight", None)
    model.load_state_dict(state, strict=False, assign=True)
    model.eval().requires_grad_(False)
    model.finalize()
    if quantization == "fp8":
        quantize_model(model, fp8_linears)

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
                if _ignored(name):
                    continue
                tensor = f.get_tensor(name)
                if dtype is not None and tensor.is_floating_point():
                    tensor = tensor.to(dtype)
                state[name] = tensor
    return state
