"""Host (dispatch) time of one model forward: 28 layers at toy width on the CPU, so compute is
negligible and what is left is the per-op overhead that also bounds a small GPU forward.

    python -m bench.host_overhead [--tokens 16] [--iters 200]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from scorer.config import ModelConfig
from scorer.models.decoder import DecoderLM
from scorer.models.tiny import CONFIG


def causal(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, enable_gqa=True
    ).transpose(0, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--layers", type=int, default=28)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = DecoderLM(ModelConfig.from_hf({**CONFIG, "num_hidden_layers": args.layers})).eval()
    ids = torch.randint(0, 256, (args.tokens,))
    pos = torch.arange(args.tokens)
    with torch.inference_mode():
        for _ in range(10):
            model.forward_hidden(ids, pos, causal)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            model.forward_hidden(ids, pos, causal)
        ops = sum(1 for e in prof.events() if e.name.startswith("aten::") and e.cpu_parent is None)
        start = time.perf_counter()
        for _ in range(args.iters):
            model.forward_hidden(ids, pos, causal)
        per_forward_ms = (time.perf_counter() - start) / args.iters * 1e3
    result = {
        "layers": args.layers,
        "tokens": args.tokens,
        "top_level_aten_ops": ops,
        "ms_per_forward": per_forward_ms,
    }
    print(f"{args.layers} layers, {args.tokens} tokens: {ops} aten ops, {per_forward_ms:.2f} ms/forward")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
