"""Scan overhead: tokens/s of a full kvmem scan step against the bare forward over the same batches.

Full scan step = all layers hooked, top and bottom k=25 with context coefficients, moments, positive
counts, histograms and the default samples (`kvmem.scanning.step.fold_batch`, with the backend `select_backend` picks: KVMEM_KERNELS or --backend). This is the
streaming pass's bookkeeping alone: benchmarks/whole_scan.py measures the whole command. Bare forward = the model's own forward with logits, and
also the forward stopped after the last FFN's coefficients (what the scan computes).
The three are alternated batch by batch and repeated; the ratio is scan tok/s over bare tok/s.

    python benchmarks/scan_overhead.py [--model gpt2-random|smollm2-135m] [--tokens 8192]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from common import Timer, machine, token_batches

import kvmem
from kvmem.plan import pack
from kvmem.scanning.backends import BACKENDS, select_backend
from kvmem.scanning.capture import capture_coefficients
from kvmem.scanning.rules import position_keys
from kvmem.scanning.state import new_layer_state
from kvmem.scanning.step import fold_batch, window_context


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="gpt2-random")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-samples", action="store_true", help="without the random and per-bin samples")
    parser.add_argument("--backend", choices=list(BACKENDS), help="default: KVMEM_KERNELS, else numba on a CPU")
    args = parser.parse_args()

    model = kvmem.load_model(args.model)
    backend = select_backend(model.device, args.backend)
    batches = token_batches(model, args.tokens, batch_size=args.batch_size)
    layers = list(range(model.n_layers))
    device = model.device  # a GPU when one is present: bookkeeping stays on the device
    # the scan's defaults: k=25, 17 context coefficients, 20 random samples, 4 per histogram bin at rate 1/8
    samples = dict(random_samples=0, bin_samples=0) if args.no_samples else dict(random_samples=20, bin_samples=4)
    states = {layer: new_layer_state(model.d_ff, 25, per_document=False, context_width=17, device=device, **samples)
              for layer in layers}

    def bare(ids):
        with torch.inference_mode():
            model.bridge(ids.to(device))
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    def truncated(ids):
        capture_coefficients(model, ids, layers, lambda layer, m: None)

    def scan_step(ids):
        b, n = ids.shape
        flat = torch.arange(b * n, device=device).view(b, n)[:, 1:].reshape(-1)  # every position but BOS
        docs = torch.arange(b, device=device).repeat_interleave(n - 1) + scan_step.batches * b
        codes = pack(docs, flat % n)
        keys = position_keys(codes, 0)
        steps = torch.arange(-12, 5, device=device)
        first = (docs - scan_step.batches * b) * (n - 1)  # each row's window: the batch row it came from
        end = first + (n - 1)
        scan_step.batches += 1

        def on(layer, m):
            acts = m.reshape(-1, m.shape[-1]).index_select(0, flat)

            def context_fn(rows, neurons):  # the runner's: the neuron's coefficients around each row
                return window_context(acts, rows, neurons, steps, first, end)

            fold_batch(backend, states[layer], acts, codes, context_fn, docs=docs, keys=keys)

        capture_coefficients(model, ids, layers, on)
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    scan_step.batches = 0
    bare(batches[0]), truncated(batches[0]), scan_step(batches[0])  # warm-up
    seconds = {"bare": [], "truncated": [], "scan": []}
    tokens = sum(ids.shape[0] * (ids.shape[1] - 1) for ids in batches)
    for _ in range(args.repeats):
        totals = dict.fromkeys(seconds, 0.0)
        for ids in batches:  # alternate batch by batch so drift hits all three alike
            for name, fn in (("bare", bare), ("truncated", truncated), ("scan", scan_step)):
                with Timer() as t:
                    fn(ids)
                totals[name] += t.seconds
        for name in seconds:
            seconds[name].append(totals[name])
    rate = {name: tokens / statistics.median(values) for name, values in seconds.items()}
    result = {
        "model": args.model, "samples": not args.no_samples, "backend": backend.name, "tokens": tokens, "batch": list(batches[0].shape), "machine": machine(),
        "bare_tok_s": round(rate["bare"], 1), "truncated_tok_s": round(rate["truncated"], 1),
        "scan_tok_s": round(rate["scan"], 1),
        "ratio_vs_bare_forward": round(rate["scan"] / rate["bare"], 3),
        "ratio_vs_truncated_forward": round(rate["scan"] / rate["truncated"], 3),
    }
    print(f"{args.model}: bare forward {rate['bare']:.0f} tok/s, forward to last FFN {rate['truncated']:.0f} tok/s, "
          f"full scan {rate['scan']:.0f} tok/s -> ratio {result['ratio_vs_bare_forward']:.2f} vs bare, "
          f"{result['ratio_vs_truncated_forward']:.2f} vs truncated ({machine()})")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
