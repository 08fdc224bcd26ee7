"""Projection throughput: every value of a model through the vocabulary with top and bottom k,
as achieved FLOP/s, against a plain GEMM of the same shapes measured in the same run.

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

    def gemm():
        with torch.inference_mode():
            for v in values:
                for start in range(0, v.shape[0], args.block):
                    v[start:start + args.block] @ unembedding

    def kvmem_projection():
        for v in values:
            project_rows(v, unembedding, args.top_n, block=args.block)

    gemm()  # warm-up
    times = {"gemm": [], "kvmem": []}
    for _ in range(3):
        for name, fn in (("gemm", gemm), ("kvmem", kvmem_projection)):
            with Timer() as t:
                fn()
            times[name].append(t.seconds)
    best = {name: min(values) for name, values in times.items()}
    result = {"model": args.model, "rows": rows, "vocab": model.vocab_size, "top_n": args.top_n,
              "gemm_gflops": round(flops / best["gemm"] / 1e9, 1), "kvmem_gflops": round(flops / best["kvmem"] / 1e9, 1),
              "ratio": round(best["gemm"] / best["kvmem"], 3), "kvmem_seconds": round(best["kvmem"], 2),
              "machine": machine()}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
