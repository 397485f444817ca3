"""Pre-quantized FP8 checkpoints: which ``quantization_config`` the loader can run, and their
tensors turned into what the model takes.

Two formats load:

* compressed-tensors (``quant_method: compressed-tensors``, what llm-compressor writes), the
  ``FP8_DYNAMIC`` scheme: every group's weights FP8 (``type: float``, 8 bits, symmetric, static)
  per ``channel`` (or per ``tensor``), its input activations FP8 ``dynamic`` per ``token``. A
  quantized linear ``X`` stores ``X.weight`` (float8_e4m3fn [N, K]) and ``X.weight_scale`` ([N, 1],
  or one value): ``W = weight * weight_scale``.
* fine-grained FP8 (``quant_method: fp8``, Qwen's and DeepSeek's ``*-FP8`` releases):
  ``activation_scheme: dynamic``, ``weight_block_size`` [bn, bk] (128 x 128), ``X.weight`` FP8 and
  ``X.weight_scale_inv`` [ceil(N / bn), ceil(K / bk)]: despite its name the multiplier,
  ``W = weight * weight_scale_inv`` blockwise. Without ``weight_block_size``, ``X.weight_scale`` is
  one value or one per channel, as above.

With ``--quantization fp8`` the decoder's linears the checkpoint stores in FP8 run in FP8 per
output channel, and those it stores unquantized (compressed-tensors' ``ignore``, the fine-grained
format's ``modules_to_not_convert``) in the model's dtype; q/k/v and gate/up run in one precision
each (one GEMM), so such a group stored partly in FP8 is dequantized. Per-channel and
per-tensor scales are taken as they are (the checkpoint's FP8 values, exactly); 128 x 128 blocks
are dequantized at load and quantized again per channel (``quant.quantize_rows``), which rounds a
block whose scale is below its row's largest again, coarser. The activations are quantized per
token (the fine-grained format's own scheme is per 128-wide group: finer than what runs here).
With ``--quantization none`` every FP8 weight is dequantized to the model's dtype and runs as a
plain linear. Any other ``quantization_config`` is refused with one line (``UnsupportedQuantization``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from scorer.config import UnsupportedQuantization

from .quant import FP8, dequantize, quantize_rows, whole_units

DECODER_LINEAR = re.compile(r"model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)")
SUPPORTED = "compressed-tensors FP8_DYNAMIC (per-channel FP8 weights, dynamic per-token activations) or fp8"
"""What the refusal says loads."""


SCALE_SUFFIXES = (".weight_scale", ".weight_scale_inv", ".input_scale")
"""The tensors a pre-quantized checkpoint stores beside each FP8 weight."""


@dataclass(frozen=True)
class Fp8Format:
    name: str
    scale_suffix: str  # "weight_scale" or "weight_scale_inv"
    block: tuple[int, int] | None = (
        None  # the weight scales' block (rows, columns); None: per channel or tensor
    )

    def split(
        self, state: dict[str, torch.Tensor], dtype: torch.dtype, keep_fp8: bool
    ) -> tuple[dict[str, torch.Tensor], dict[str, tuple[torch.Tensor, torch.Tensor]]]:
        """``state`` as read (FP8 weights, their scales, the rest in the stored dtypes) ->
        (the model's state dict in ``dtype``, the decoder's FP8 linears by module name as (weight,
        per-channel scales [N])). With ``keep_fp8`` a decoder linear's weight is kept FP8 and its
        slot in the state dict is an empty ``meta`` tensor (``quant.quantize_model`` replaces the
        module), where the other linears of its unit are FP8 too (``quant.UNITS``: q/k/v, o,
        gate/up, down); every other FP8 weight, and every one without ``keep_fp8``, is
        dequantized. The linears a checkpoint stores unquantized (its ``ignore`` list) stay so."""
        dense: dict[str, torch.Tensor] = {}
        linears: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        scales = {k for k in state if k.endswith("." + self.scale_suffix)}
        stored = {k.removesuffix(".weight") for k, t in state.items() if t.dtype == FP8}
        # the decoder linears kept FP8; a unit stored only in part runs dequantized
        keep = whole_units({m for m in stored if DECODER_LINEAR.fullmatch(m)}) if keep_fp8 else set()
        for name, tensor in state.items():
            if name in scales:
                continue
            if not tensor.is_floating_point() or tensor.element_size() != 1:
                dense[name] = tensor.to(dtype) if tensor.is_floating_point() else tensor
                continue
            module = name.removesuffix(".weight")
            scale = state.get(f"{module}.{self.scale_suffix}")
            if tensor.dtype != FP8 or module == name or scale is None:
                raise UnsupportedQuantization(
                    f"{name} is {tensor.dtype} without its {self.scale_suffix}: not the {self.name} format"
                )
            if module in keep:
                linears[module] = self._per_channel(tensor, scale)
                dense[name] = torch.empty(tensor.shape, dtype=dtype, device="meta")
            else:
                dense[name] = self._dequantize(tensor, scale).to(dtype)
        return dense, linears

    def _dequantize(self, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        n, k = q.shape
        if self.block is not None:
            bn, bk = self.block
            if scale.shape != ((n + bn - 1) // bn, (k + bk - 1) // bk):
                raise UnsupportedQuantization(f"block scales of {list(scale.shape)} for a {n} x {k} weight")
            full = scale.float().repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
            return q.float() * full
        return dequantize(q, self._channel_scale(scale, n).reshape(n, 1))

    def _per_channel(self, q: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.block is not None:
            q, s = quantize_rows(self._dequantize(q, scale))
            return q, s.reshape(-1)
        return q, self._channel_scale(scale, q.shape[0]).float()

    def _channel_scale(self, scale: torch.Tensor, n: int) -> torch.Tensor:
        if scale.numel() == 1:
            return scale.reshape(1).expand(n).clone()
        if scale.numel() != n:
            raise UnsupportedQuantization(
                f"{self.scale_suffix} of {list(scale.shape)} for a weight of {n} rows"
            )
        return scale.reshape(n)


def checkpoint_format(model_dir: str | Path) -> Fp8Format | None:
    """The FP8 format of the checkpoint in ``model_dir`` (None: not quantized); raises
    ``UnsupportedQuantization`` (one line, naming it) for a ``quantization_config`` it cannot run."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    qc = config.get("quantization_config")
    if qc is None:
        return None
    method = qc.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    if method == "fp8":
        return _fine_grained(qc)
    raise UnsupportedQuantization(
        f"quantization_config.quant_method {method!r} is not supported; the engine loads {SUPPORTED}"
    )


def _refuse(what: str) -> UnsupportedQuantization:
    return UnsupportedQuantization(
        f"quantization_config: {what} is not supported; the engine loads {SUPPORTED}"
    )


def _compressed_tensors(qc: dict) -> Fp8Format:
    groups = qc.get("config_groups") or {}
    if not groups:
        raise _refuse("compressed-tensors without config_groups")
    for group, scheme in groups.items():
        weights, acts = scheme.get("weights") or {}, scheme.get("input_activations")
        wanted = {"type": "float", "num_bits": 8, "symmetric": True, "dynamic": False}
        for key, value in wanted.items():
            if weights.get(key, value) != value:
                raise _refuse(f"compressed-tensors group {group!r} weights {key}={weights.get(key)!r}")
        if weights.get("strategy") not in ("channel", "tensor"):
            raise _refuse(f"compressed-tensors group {group!r} weights strategy {weights.get('strategy')!r}")
        if not acts or (
            acts.get("type"),
            acts.get("num_bits"),
            acts.get("dynamic"),
            acts.get("strategy"),
        ) != (
            "float",
            8,
            True,
            "token",
        ):
            raise _refuse(f"compressed-tensors group {group!r} input_activations {acts!r}")
        if scheme.get("output_activations"):
            raise _refuse(f"compressed-tensors group {group!r} output_activations")
    if qc.get("kv_cache_scheme"):
        raise _refuse("compressed-tensors kv_cache_scheme")
    return Fp8Format("compressed-tensors FP8_DYNAMIC", "weight_scale")


def _fine_grained(qc: dict) -> Fp8Format:
    if qc.get("activation_scheme", "dynamic") != "dynamic":
        raise _refuse(f"fp8 activation_scheme {qc.get('activation_scheme')!r}")
    if qc.get("fmt", "e4m3") != "e4m3":
        raise _refuse(f"fp8 fmt {qc.get('fmt')!r}")
    block = qc.get("weight_block_size")
    if block is None:
        return Fp8Format("fp8", "weight_scale")
    if len(block) != 2:
        raise _refuse(f"fp8 weight_block_size {block!r}")
    return Fp8Format(
        f"fp8 {block[0]} x {block[1]} blocks", "weight_scale_inv", (int(block[0]), int(block[1]))
    )
