"""Projection throughput: every value of a model through the vocabulary with top and bottom k,
as achieved FLOP/s, against plain float32 and bfloat16 GEMMs of the same shapes in the same run
(the bfloat16 figure is what a low-precision screen could reach on this CPU).

    python benchmarks/projection.py [--model gpt2-random] [--top-n 20]
"""

from __future__ import annotations

import argparse
import json

import torch
from common import Timer, machine

import kvmem
from kvmem.scanning.projection import project_rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="gpt2-random")
    parser.add_argument("--top-n", type=int, default=20)
    parser.add_argument("--block", type=int, default=512)
    args = parser.parse_args()
    model = kvmem.load_model(args.model)
    unembedding = model.unembedding().float().contiguous()  # [d_model, vocab]
    values = [model.values(layer).float() for layer in range(model.n_layers)]
    rows = sum(v.shape[0] for v in values)
    flops = 2 * rows * model.d_model * model.vocab_size

    def gemm(vectors, basis):
        with torch.inference_mode():
            for v in vectors:
                for start in range(0, v.shape[0], args.block):
                    v[start:start + args.block] @ basis

    low = [v.bfloat16() for v in values]
    low_basis = unembedding.bfloat16()

    def kvmem_projection():
        for v in values:
            project_rows(v, unembedding, args.top_n, block=args.block)

    gemm(values, unembedding)  # warm-up
    gemm(low, low_basis)
    times = {"gemm": [], "gemm_bf16": [], "kvmem": []}
    runs = (("gemm", lambda: gemm(values, unembedding)), ("gemm_bf16", lambda: gemm(low, low_basis)),
            ("kvmem", kvmem_projection))
    for _ in range(3):
        for name, fn in runs:
            with Timer() as t:
                fn()
            times[name].append(t.seconds)
    best = {name: min(values) for name, values in times.items()}
    result = {"model": args.model, "rows": rows, "vocab": model.vocab_size, "top_n": args.top_n,
              "gemm_gflops": round(flops / best["gemm"] / 1e9, 1),
              "gemm_bf16_gflops": round(flops / best["gemm_bf16"] / 1e9, 1),
              "kvmem_gflops": round(flops / best["kvmem"] / 1e9, 1), "spread_seconds": {
                  name: [round(min(v), 3), round(max(v), 3)] for name, v in times.items()},
              "ratio": round(best["gemm"] / best["kvmem"], 3), "kvmem_seconds": round(best["kvmem"], 2),
              "machine": machine()}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
