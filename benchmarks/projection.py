"""Projection throughput, as achieved FLOP/s beside a plain float32 GEMM of the same shapes in the same run,
and the cost of a neuron's projections on demand.

1. Every value of a model (raw) through the unembedding with top and bottom n, blocks of the same
   rows: float32 GEMM (what the screen costs at least) and kvmem's ``project_rows``, at each ``--blocks`` size.
2. ``--cold``: a model's whole projection tables as ``kvmem project`` (or an eager scan) computes them
   (``projection_tables``: values under every convention, keys and gates, all layers, the four passes for
   smollm2-135m), ``--repeat`` times, with the mean candidates rescored per row and the rows rescored in full.
3. ``--on-demand``: one neuron's rows of both tables as ``Atlas.values`` / ``Atlas.keys`` compute them for an
   atlas without the tables (``NeuronProjector``): the first call (which prepares the bases) and the median of
   the next ones.

    python benchmarks/projection.py [--model gpt2-random] [--top-n 20] [--cold] [--on-demand]
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
from kvmem.scanning.projection import NeuronProjector, projected_vectors, projection_tables
from kvmem.scanning.projection_screen import BLOCK, METHOD, prepare_basis, project_rows


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
    """Part 1: float32 GEMM and kvmem's projection over the same blocks (best of 3)."""
    unembedding = model.unembedding().float().contiguous()  # [d_model, vocab]
    values = [model.values(layer).float() for layer in range(model.n_layers)]
    rows = sum(v.shape[0] for v in values)
    flops = 2 * rows * model.d_model * model.vocab_size
    basis = prepare_basis(unembedding)
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
    kvmem_projection(block)
    runs = {"gemm": lambda: gemm(values, unembedding),
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
    return {"rows": rows, "vocab": model.vocab_size, "top_n": args.top_n, "method": METHOD, "block": fastest,
            "gemm_gflops": round(flops / best["gemm"] / 1e9, 1),
            "kvmem_gflops": round(flops / best[f"kvmem_{fastest}"] / 1e9, 1),
            "kvmem_gflops_by_block": {size: round(flops / best[f"kvmem_{size}"] / 1e9, 1) for size in args.blocks},
            "spread_seconds": {name: [round(min(v), 3), round(max(v), 3)] for name, v in times.items()},
            "ratio": round(best["gemm"] / best[f"kvmem_{fastest}"], 3),
            "kvmem_seconds": round(best[f"kvmem_{fastest}"], 2), "stats": stats.to_dict()}


def cold(model, args) -> list[dict]:
    """Part 2: a model's whole projection tables (all four passes), ``--repeat`` times."""
    config = ScanConfig(top_n=args.top_n)
    layers = list(range(model.n_layers))
    projected = projected_vectors(model, layers, config)
    rows = sum(v.shape[0] for _, _, v in projected.values + projected.keys)
    flops = 2 * rows * model.d_model * model.vocab_size
    out = []
    for run in range(args.repeat):
        load = os.getloadavg()[0]
        started = time.perf_counter()
        tables = projection_tables(model, layers, config, projected=projected)
        seconds = time.perf_counter() - started
        out.append({"run": run + 1, "seconds": round(seconds, 2), "rows": rows,
                    "passes": len(projected.values + projected.keys) // len(layers),
                    "gflops": round(flops / seconds / 1e9, 1), **tables.stats.to_dict(),
                    "load_average_before": round(load, 2), "peak_rss_mb": round(peak_rss_mb())})
        print(json.dumps(out[-1]), flush=True)
    return out


def on_demand(model, args) -> dict:
    """Part 3: one neuron's values and keys rows, as an atlas without the tables computes them."""
    projector = NeuronProjector(model, ScanConfig(top_n=args.top_n))
    neurons = [(layer, (7919 * (layer + 1)) % model.d_ff) for layer in range(model.n_layers)]
    seconds = []
    for layer, neuron in neurons:
        started = time.perf_counter()
        projector.tables(layer, [neuron])
        seconds.append(time.perf_counter() - started)
    later = sorted(seconds[1:])
    return {"first_call_seconds": round(seconds[0], 3), "median_ms": round(1000 * later[len(later) // 2], 1),
            "max_ms": round(1000 * later[-1], 1), "neurons": len(neurons)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="gpt2-random")
    parser.add_argument("--top-n", type=int, default=20)
    parser.add_argument("--blocks", default=None, help="rows per block for part 1, comma-separated (first: the GEMMs')")
    parser.add_argument("--cold", action="store_true", help="also time a model's whole projection tables, all passes")
    parser.add_argument("--on-demand", action="store_true", help="also time one neuron's projections on demand")
    parser.add_argument("--repeat", type=int, default=2, help="runs for --cold")
    parser.add_argument("--skip-blocks", action="store_true", help="only --cold")
    args = parser.parse_args(argv)
    args.blocks = [int(b) for b in args.blocks.split(",")] if args.blocks else [BLOCK]
    model = kvmem.load_model(args.model)
    result = {"model": args.model, "cpu": cpu_model(), "machine": machine(),
              "load_average": [round(x, 2) for x in os.getloadavg()]}
    if not args.skip_blocks:
        result.update(same_blocks(model, args))
    if args.cold:
        result["cold"] = cold(model, args)
    if args.on_demand:
        result["on_demand"] = on_demand(model, args)
    result["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
