"""Kernel-agnostic decoder LMs; `scorer.models.loader.load_model` builds one from a checkpoint dir
(every supported architecture, ``scorer.config.SUPPORTED_ARCHITECTURES``, is one ``DecoderLM``)."""

from scorer.models.decoder import AttnFn, DecoderLM

__all__ = ["AttnFn", "DecoderLM"]
