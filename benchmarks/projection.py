"""Projection throughput, as achieved FLOP/s beside plain float32 and bfloat16 GEMMs of the same
shapes in the same run.

1. Every value of a model (raw) through the unembedding with top and bottom n, blocks of the same
   rows: float32 GEMM, bfloat16 GEMM (what a screen costs at least), and kvmem's ``project_rows``
   (the method this machine picks, or ``--method``), at each ``--blocks`` size.
2. ``--cold``: a model's first projections as a first scan computes them (``projection_tables``:
   values under every convention, keys and gates, all layers, the four passes for smollm2-135m),
   for each of ``--methods`` (``fp32-topk`` is the first kvmem's plain float32 path), ``--repeat``
   times, with the mean candidates rescored per row and the rows rescored in full.

    python benchmarks/projection.py [--model gpt2-random] [--top-n 20] [--cold] [--methods fp32-topk,auto]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
from common import Timer, machine, peak_rss_mb

import kvmem
from kvmem.scanning.config import ScanConfig
from kvmem.scanning.projection import projected_vectors, projection_tables
from kvmem.scanning.projection_screen import BLOCK, bf16_units, prepare_basis, project_rows, select_method


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def same_blocks(model, args) -> dict:
    """Part 1: float32 GEMM, bfloat16 GEMM and kvmem's projection over the same blocks (best of 3)."""
    unembedding = model.unembedding().float().contiguous()  # [d_model, vocab]
    values = [model.values(layer).float() for layer in range(model.n_layers)]
    rows = sum(v.shape[0] for v in values)
    flops = 2 * rows * model.d_model * model.vocab_size
    low, low_basis = [v.bfloat16() for v in values], unembedding.T.contiguous().bfloat16()  # [vocab, d]
    method = select_method("cpu", args.method)
    basis = prepare_basis(unembedding, method=method)
    block = args.blocks[0]

    def gemm(vectors, matrix):
        with torch.inference_mode():
            for v in vectors:
                for start in range(0, v.shape[0], block):
                    v[start:start + block] @ matrix

    def kvmem_projection(size):
        stats = None
        for v in values:
            part = project_rows(v, basis, args.top_n, block=size).stats
            stats = part if stats is None else stats + part
        return stats

    gemm(values[:1], unembedding)  # warm-up
    gemm(low[:1], low_basis.T)
    kvmem_projection(block)
    runs = {"gemm": lambda: gemm(values, unembedding), "gemm_bf16": lambda: gemm(low, low_basis.T),
            **{f"kvmem_{size}": (lambda size=size: kvmem_projection(size)) for size in args.blocks}}
    times: dict[str, list[float]] = {name: [] for name in runs}
    stats = None
    for _ in range(3):
        for name, fn in runs.items():
            with Timer() as t:
                out = fn()
            times[name].append(t.seconds)
            stats = out if name.startswith("kvmem") else stats
    best = {name: min(v) for name, v in times.items()}
    fastest = min(args.blocks, key=lambda size: best[f"kvmem_{size}"])
    return {"rows": rows, "vocab": model.vocab_size, "top_n": args.top_n, "method": method, "block": fastest,
            "gemm_gflops": round(flops / best["gemm"] / 1e9, 1),
            "gemm_bf16_gflops": round(flops / best["gemm_bf16"] / 1e9, 1),
            "kvmem_gflops": round(flops / best[f"kvmem_{fastest}"] / 1e9, 1),
            "kvmem_gflops_by_block": {size: round(flops / best[f"kvmem_{size}"] / 1e9, 1) for size in args.blocks},
            "spread_seconds": {name: [round(min(v), 3), round(max(v), 3)] for name, v in times.items()},
            "ratio": round(best["gemm"] / best[f"kvmem_{fastest}"], 3),
            "kvmem_seconds": round(best[f"kvmem_{fastest}"], 2), "stats": stats.to_dict()}


def cold(model, args) -> list[dict]:
    """Part 2: the first scan's projections (all four passes), per method, ``--repeat`` times."""
    config = ScanConfig(top_n=args.top_n)
    layers = list(range(model.n_layers))
    projected = projected_vectors(model, layers, config)
    rows = sum(v.shape[0] for _, _, v in projected.values + projected.keys)
    flops = 2 * rows * model.d_model * model.vocab_size
    out = []
    for name in args.methods:
        method = select_method("cpu", None if name == "auto" else name)
        for run in range(args.repeat):
            load = os.getloadavg()[0]
            started = time.perf_counter()
            tables = projection_tables(model, layers, config, projected=projected, method=method)
            seconds = time.perf_counter() - started
            out.append({"method": method, "run": run + 1, "seconds": round(seconds, 2), "rows": rows,
                        "passes": len(projected.values + projected.keys) // len(layers),
                        "gflops": round(flops / seconds / 1e9, 1), **tables.stats.to_dict(),
                        "load_average_before": round(load, 2), "peak_rss_mb": round(peak_rss_mb())})
            print(json.dumps(out[-1]), flush=True)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="gpt2-random")
    parser.add_argument("--top-n", type=int, default=20)
    parser.add_argument("--method", default=None, help="project_rows's method in part 1 (default: this machine's)")
    parser.add_argument("--blocks", default=None, help="rows per block for part 1, comma-separated (first: the GEMMs')")
    parser.add_argument("--cold", action="store_true", help="also time a model's first projections, all passes")
    parser.add_argument("--methods", default="fp32-topk,auto", help="methods for --cold, comma-separated")
    parser.add_argument("--repeat", type=int, default=2, help="runs per method for --cold")
    parser.add_argument("--skip-blocks", action="store_true", help="only --cold")
    args = parser.parse_args(argv)
    args.methods = args.methods.split(",")
    args.blocks = [int(b) for b in args.blocks.split(",")] if args.blocks else [BLOCK[select_method("cpu",
                                                                                                  args.method)]]
    model = kvmem.load_model(args.model)
    result = {"model": args.model, "cpu": cpu_model(), "bf16_units": bf16_units(), "machine": machine(),
              "load_average": [round(x, 2) for x in os.getloadavg()]}
    if not args.skip_blocks:
        result.update(same_blocks(model, args))
    if args.cold:
        result["cold"] = cold(model, args)
    result["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
