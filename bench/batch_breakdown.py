"""Where the time of one serving batch goes: the engine's stages, host and device, on the load
tool's requests (a Qwen3-0.6B-shaped random bf16 model, the serving configuration by default).

Each batch is the oldest calls that fit the token budget, as the server's batcher forms them.
Stages, synchronised at each boundary: ``plan`` (resolve auto, planners, plan check), ``inputs``
(token ids and positions to the device), ``issue`` (``Engine.forward`` returning: backend plans
and every launch queued), ``device`` (the wait for the GPU after that), ``logprobs`` (LM head on
the score rows, log-softmax, copy to the host) and ``results``. Then the same batches unstaged:
``score_batch`` one at a time, and pipelined as the server runs them (batch k+1 launched before
batch k is collected), for the time per batch.

    python -m loadtest.gen --out reqs.jsonl --requests 400 --docs 20 --prompt-tokens 200 \\
        --doc-tokens lognormal:60:0.5:256 --token-ids --seed 1
    python -m bench.batch_breakdown --requests reqs.jsonl --out out/
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from google.protobuf import json_format

from scorer import readout
from scorer.attention import HeadSpec, make_backend
from scorer.config import ModelConfig
from scorer.engine import Engine, logical_tokens
from scorer.runner import ModelRunner
from scorer.runtime import model_kernels
from scorer.server.convert import request_from_proto
from scorer.v1 import scorer_pb2 as pb

from .e2e import QWEN3_06B, build_model
from .throughput import embedded_tokenizer
from .timing import environment, sync, write_json

STAGES = ("plan", "inputs", "issue", "device", "logprobs", "results")


def batches(engine: Engine, lines: list[str], budget: int) -> list[list]:
    toks = [
        engine.tokenize(request_from_proto(json_format.Parse(x, pb.ScoreDocsRequest()), "b")) for x in lines
    ]
    out, cur, n = [], [], 0
    for t in toks:
        k = t.tokens
        if cur and n + k > budget:
            out.append(cur)
            cur, n = [], 0
        cur.append(t)
        n += k
    return out + ([cur] if cur else [])


@torch.inference_mode()
def staged(engine: Engine, batch: list) -> dict[str, float]:
    """One ``score_batch``, stage by stage, synchronised at each boundary (ms)."""
    times, dev = {}, engine.device
    t = time.perf_counter()

    def lap(name: str, wait: bool = True) -> None:
        nonlocal t
        if wait:
            sync(dev)
        now = time.perf_counter()
        times[name] = (now - t) * 1e3
        t = now

    plan = engine.plan(batch)
    lap("plan")
    ordered = [batch[i] for i in plan.requests]
    ids, positions = logical_tokens(ordered, dev)
    lap("inputs")
    rows = engine.runner.forward(plan, ids, positions)
    lap("issue", wait=False)
    lap("device")
    flat = readout.label_logprobs(engine.runner.model, rows, ordered).tolist()
    lap("logprobs")
    readout.results(ordered, plan.requests, flat)
    lap("results")
    return times


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=Path, required=True, help="JSONL from loadtest.gen (token ids)")
    ap.add_argument("--budget", type=int, default=16384, help="tokens per batch (the server's default)")
    ap.add_argument("--batches", type=int, default=20)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--graph-max-tokens", type=int, default=16384)
    ap.add_argument("--model-kernels", default="auto")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", type=Path, default=Path("out"))
    a = ap.parse_args(argv)
    device = torch.device(a.device)
    config = ModelConfig.from_hf({**QWEN3_06B, "num_hidden_layers": a.layers})
    backend = make_backend(
        "auto", HeadSpec(config.num_heads, config.num_kv_heads, config.head_dim, torch.bfloat16, device)
    )
    model = build_model(device, a.layers, model_kernels(a.model_kernels, backend.name, device.type))
    engine = Engine(ModelRunner(model, backend, a.graph_max_tokens), embedded_tokenizer())
    engine.runner.capture_graphs()
    todo = batches(engine, a.requests.read_text().splitlines(), a.budget)[: a.batches + 2]
    for b in todo[:2]:  # warm-up: first-use setup of every bucket and wrapper touched
        staged(engine, b)
    rows = [staged(engine, b) for b in todo[2:]]
    walls = []
    for b in todo[2:]:
        sync(device)
        t0 = time.perf_counter()
        engine.score_batch(b)
        walls.append((time.perf_counter() - t0) * 1e3)
    sync(device)
    t0, waiting = time.perf_counter(), None
    for b in todo[2:]:  # as the server runs them: the next batch launched before the last is collected
        launched = engine.launch(b)
        if waiting is not None:
            waiting()
        waiting = launched
    if waiting is not None:
        waiting()
    pipelined = (time.perf_counter() - t0) * 1e3 / max(len(todo) - 2, 1)
    median = {s: statistics.median(r[s] for r in rows) for s in STAGES}
    result = {
        "env": environment(device),
        "config": vars(a) | {"requests": str(a.requests), "out": str(a.out)},
        "calls_per_batch": statistics.median(len(b) for b in todo[2:]),
        "tokens_per_batch": statistics.median(sum(t.tokens for t in b) for b in todo[2:]),
        "stages_ms_median": median,
        "staged_total_ms": sum(median.values()),
        "score_batch_ms_median": statistics.median(walls),
        "pipelined_ms_per_batch": pipelined,
        "model_kernels": "flashinfer" if model.fused else "torch",
        "backend": backend.name,
    }
    print(json.dumps({k: v for k, v in result.items() if k != "env"}, indent=1))
    write_json(a.out / "batch_breakdown.json", result)


if __name__ == "__main__":
    main()
