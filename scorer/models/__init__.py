"""Kernel-agnostic decoder LMs; `scorer.models.loader.load_model` builds one from a checkpoint dir."""

from scorer.models.decoder import AttnFn, DecoderLM

MODEL_CLASSES: dict[str, type[DecoderLM]] = {
    "Qwen3ForCausalLM": DecoderLM,
    "LlamaForCausalLM": DecoderLM,
}

__all__ = ["MODEL_CLASSES", "AttnFn", "DecoderLM"]
