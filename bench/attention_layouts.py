"""One attention layer of a batch of long-prompt calls, by K/V layout: the engine's paged pool
(``page_size = 1``: each request's keys through a page table, FA3's sparse loads) against
contiguous K/V (FlashInfer's ragged-KV wrapper: no page table, FA3's TMA loads).

Each of ``calls`` identical calls has a prompt of P tokens and N docs of S tokens. Rows are laid
out as the cascade scheme lays them, [every prompt, every doc], so that a level's keys are one
contiguous run per request:

* ``ragged/paged``: what the engine runs for B and C (the ragged scheme): one request per prompt
  (causal) and one per doc (its prompt's keys and its own, causal);
* ``cascade/paged`` and ``cascade/contiguous``: three calls and a merge, the prompts causal, the
  docs of each call against their prompt (non-causal, the shared level), each doc causal on itself
  (the unique level), merged by log-sum-exp;
* ``ragged/duplicated``: the ragged scheme's requests on contiguous K/V, each doc's keys laid out
  as [its prompt, itself] in a second buffer (the prompt's K/V copied before every doc), gathered
  in the timed function (``+copy``) or before it (``only``): what FA3's TMA loads would buy C;
* ``unique level/contiguous``: each doc causal on itself alone (a floor for the docs' part).

Every variant is checked against ``ragged/paged`` on FA2 (bf16: 2e-2 relative), then timed with
CUDA events (median of ``--iters``), FA2 and FA3. GPU only.

    python -m bench.attention_layouts --out DIR [--shapes B,C,A] [--iters 50]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from .timing import time_ms

SHAPES = {  # name: (prompt tokens, docs, doc tokens, calls in a batch)
    "B": (2000, 100, 100, 1),
    "C": (100, 50, 400, 1),
    "A": (300, 10, 50, 20),
    "D": (8000, 32, 4, 2),
}
HEADS = {"0.6b": (16, 8), "8b": (32, 8)}
HEAD_DIM = 128


def indptr(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *lens], dtype=torch.int32).cumsum(0).to(torch.int32)


class Layer:
    """The rows and index arrays of one batch of calls in the cascade layout."""

    def __init__(self, p: int, n: int, s: int, calls: int) -> None:
        self.p, self.n, self.s, self.calls = p, n, s, calls
        self.prompts = calls * p
        self.total = self.prompts + calls * n * s
        self.doc_rows = [self.prompts + (c * n + i) * s for c in range(calls) for i in range(n)]

    def ragged_requests(self) -> tuple[list[int], list[torch.Tensor]]:
        """Query lengths and key slots of the ragged scheme: prompts, then docs."""
        q, kv = [], []
        for c in range(self.calls):
            q.append(self.p)
            kv.append(torch.arange(c * self.p, (c + 1) * self.p))
        for j, row in enumerate(self.doc_rows):
            c = j // self.n
            q.append(self.s)
            prompt = torch.arange(c * self.p, (c + 1) * self.p)
            kv.append(torch.cat([prompt, torch.arange(row, row + self.s)]))
        return q, kv

    def flops(self, heads: int, part: str = "all") -> float:
        """Useful FLOPs of the layer: QK^T and PV over the visible keys; ``part`` "shared": the
        docs' queries on their prompt's keys alone, "unique": each doc on its own keys alone."""
        docs = self.calls * self.n * self.s
        work = {
            "all": self.calls * self.p * self.p / 2 + docs * (self.p + self.s / 2),
            "shared": docs * self.p,
            "unique": docs * self.s / 2,
        }[part]
        return 4 * heads * HEAD_DIM * work


def wrapper(ws, backend: str, q_lens: list[int], kv: list, causal: bool, heads: tuple[int, int]):
    """A planned FlashInfer prefill wrapper: ``kv`` a list of slot tensors (the paged pool,
    ``page_size = 1``) or of key counts (contiguous K/V, the ragged-KV wrapper)."""
    import flashinfer

    paged = isinstance(kv[0], torch.Tensor)
    kv_lens = [len(x) for x in kv] if paged else kv
    cls = (
        flashinfer.BatchPrefillWithPagedKVCacheWrapper
        if paged
        else flashinfer.BatchPrefillWithRaggedKVCacheWrapper
    )
    w = cls(ws, "NHD", backend=backend)
    table = (
        (torch.cat(kv).to(torch.int32).cuda(), torch.ones(len(q_lens), dtype=torch.int32).cuda())
        if paged
        else ()
    )
    pages = (1,) if paged else ()
    w.plan(indptr(q_lens).cuda(), indptr(kv_lens).cuda(), *table, heads[0], heads[1], HEAD_DIM, *pages,
           causal=causal, q_data_type=torch.bfloat16)  # fmt: skip
    return w


def variants(lay: Layer, heads: tuple[int, int], backend: str, ws: list[torch.Tensor]):
    """name -> a function running the layer into ``out``."""
    import flashinfer

    docs = slice(lay.prompts, lay.total)
    q_lens, kv = lay.ragged_requests()
    rag = wrapper(ws[0], backend, q_lens, kv, True, heads)
    prompt_q = [lay.p] * lay.calls
    prompt_kv = [torch.arange(c * lay.p, (c + 1) * lay.p) for c in range(lay.calls)]
    shared_q = [lay.n * lay.s] * lay.calls
    unique_q = [lay.s] * (lay.calls * lay.n)
    unique_kv = [torch.arange(r, r + lay.s) for r in lay.doc_rows]
    pp = wrapper(ws[1], backend, prompt_q, prompt_kv, True, heads)
    ps = wrapper(ws[2], backend, shared_q, prompt_kv, False, heads)
    pu = wrapper(ws[3], backend, unique_q, unique_kv, True, heads)
    cp = wrapper(ws[4], backend, prompt_q, prompt_q, True, heads)
    cs = wrapper(ws[5], backend, shared_q, prompt_q, False, heads)
    cu = wrapper(ws[6], backend, unique_q, unique_q, True, heads)

    def ragged_paged(q, k, v, out):
        rag.run(q, (k.unsqueeze(1), v.unsqueeze(1)), out=out)

    def cascade_paged(q, k, v, out):
        kc, vc = k.unsqueeze(1), v.unsqueeze(1)
        pp.run(q[: lay.prompts], (kc, vc), out=out[: lay.prompts])
        o1, s1 = ps.run(q[docs], (kc, vc), return_lse=True)
        o2, s2 = pu.run(q[docs], (kc, vc), return_lse=True)
        flashinfer.merge_state_in_place(o1, s1, o2, s2)
        out[docs] = o1

    def cascade_contiguous(q, k, v, out):
        kp, vp = k[: lay.prompts], v[: lay.prompts]
        cp.run(q[: lay.prompts], kp, vp, out=out[: lay.prompts])
        o1, s1 = cs.run(q[docs], kp, vp, return_lse=True)
        o2, s2 = cu.run(q[docs], k[docs], v[docs], return_lse=True)
        flashinfer.merge_state_in_place(o1, s1, o2, s2)
        out[docs] = o1

    dup = torch.cat(
        [torch.arange(lay.prompts)]
        + [torch.cat([prompt_kv[j // lay.n], torch.arange(r, r + lay.s)]) for j, r in enumerate(lay.doc_rows)]
    ).cuda()
    dr = wrapper(ws[7], backend, q_lens, [len(x) for x in kv], True, heads)
    kd = torch.empty(len(dup), heads[1], HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    vd = torch.empty_like(kd)

    def ragged_dup_copy(q, k, v, out):
        torch.index_select(k, 0, dup, out=kd)
        torch.index_select(v, 0, dup, out=vd)
        dr.run(q, kd, vd, out=out)

    def ragged_dup_only(q, k, v, out):  # kd, vd as ragged_dup_copy left them
        dr.run(q, kd, vd, out=out)

    def unique_contiguous(q, k, v, out):
        cu.run(q[docs], k[docs], v[docs], out=out[docs])

    def shared_paged(q, k, v, out):  # the shared level alone
        ps.run(q[docs], (k.unsqueeze(1), v.unsqueeze(1)), out=out[docs])

    def shared_contiguous(q, k, v, out):
        cs.run(q[docs], k[: lay.prompts], v[: lay.prompts], out=out[docs])

    return {
        "ragged/paged": ragged_paged,
        "cascade/paged": cascade_paged,
        "cascade/contiguous": cascade_contiguous,
        "ragged/duplicated+copy": ragged_dup_copy,
        "ragged/duplicated only": ragged_dup_only,
        "unique level/contiguous": unique_contiguous,
        "shared level/paged": shared_paged,
        "shared level/contiguous": shared_contiguous,
    }


def measure(model: str, name: str, iters: int, ws: list[torch.Tensor]) -> list[dict]:
    """Every variant of one shape on FA2 and FA3, checked against ragged/paged on FA2, timed."""
    heads, lay = HEADS[model], Layer(*SHAPES[name])
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (
        torch.randn(lay.total, h, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=g)
        for h in (heads[0], heads[1], heads[1])
    )
    ref = torch.empty_like(q)
    variants(lay, heads, "fa2", ws)["ragged/paged"](q, k, v, ref)
    records = []
    for kernel in ("fa2", "fa3"):
        for label, fn in variants(lay, heads, kernel, ws).items():
            out = torch.zeros_like(q)
            fn(q, k, v, out)
            err = None
            if not label.startswith(("shared", "unique")):
                err = float((out.float() - ref.float()).norm() / ref.float().norm())
                assert err < 2e-2, (model, name, label, kernel, err)
            ms = time_ms(lambda fn=fn, out=out: fn(q, k, v, out), iters)
            flops = lay.flops(heads[0], label.split(" ")[0] if err is None else "all")
            records.append(
                {
                    "model": model,
                    "shape": name,
                    "variant": label,
                    "kernel": kernel,
                    "ms": ms,
                    "tflops": flops / ms / 1e9,
                    "rel_err": err,
                }
            )
            r, e = records[-1], "-" if err is None else f"{err:.1e}"
            print(
                f"| {model} | {name} | {label} | {kernel} | {ms:.3f} | {r['tflops']:.0f} | {e} |", flush=True
            )
    return records


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("out"))
    ap.add_argument("--shapes", default="B,C,A,D")
    ap.add_argument("--models", default="0.6b,8b")
    ap.add_argument("--iters", type=int, default=50)
    a = ap.parse_args(argv)
    ws = [torch.empty(256 << 20, dtype=torch.uint8, device="cuda") for _ in range(8)]
    print("| model | shape | variant | kernel | ms/layer | TFLOP/s | rel err vs ragged/paged fa2 |")
    print("|---|---|---|---|---:|---:|---:|")
    records = [
        r for m in a.models.split(",") for n in a.shapes.split(",") for r in measure(m, n, a.iters, ws)
    ]
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "attention_layouts.json").write_text(json.dumps({"records": records}, indent=1))


if __name__ == "__main__":
    main()
