"""Scan overhead: tokens/s of a full kvmem scan step against the bare forward over the same batches.

Full scan step = all layers hooked, top and bottom k=25 with context coefficients, moments, positive
counts, histograms and the default samples (`kvmem.scanning.step.BatchStep`, the runner's step: the statistics
`kvmem.scanning.statistics.compose` builds from the settings).
It runs twice, without and with the neuron taxonomy's streaming sums (Σ m·position; on gated models the gate and
up hooks, their sign-quadrant counts and each kept entry's gate and up; unigram counts), and prints the sums'
cost as a share of the streaming step (`--no-taxonomy-sums` turns them off in a scan). This is the
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
from kvmem.plan import Batch, TokenPlan, WindowText
from kvmem.scanning.coefficients import capture_coefficients, has_gate_up
from kvmem.scanning.config import ScanConfig
from kvmem.scanning.statistics import ScanState, compose
from kvmem.scanning.step import BatchRows, BatchStep


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="gpt2-random")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-samples", action="store_true", help="without the random and per-bin samples")
    parser.add_argument("--statistics", default="", help="optional statistics to keep too (comma-separated)")
    args = parser.parse_args()

    model = kvmem.load_model(args.model)
    batches = token_batches(model, args.tokens, batch_size=args.batch_size)
    layers = list(range(model.n_layers))
    device = model.device  # a GPU when one is present: bookkeeping stays on the device
    # the scan's defaults: k=25, 17 context coefficients, 20 random samples, 4 per histogram bin at rate 1/8
    samples = dict(random_samples=0, bin_samples=0) if args.no_samples else dict(random_samples=20, bin_samples=4)
    gated = has_gate_up(model)

    optional = tuple(name for name in args.statistics.split(",") if name)

    def fresh(sums: bool) -> ScanState:
        config = ScanConfig(top_k=25, taxonomy_sums=sums, statistics=optional, **samples)
        statistics = compose(config, gated=gated)
        return statistics.new_state(layers, statistics.spec(model.d_ff, model.vocab_size, device, 17))

    states = {False: fresh(False), True: fresh(True)}  # without and with the taxonomy's sums
    plan = TokenPlan(window=batches[0].shape[1] - 1, bos_token_id=model.bos_token_id)

    def bare(ids):
        with torch.inference_mode():
            model.unbridged(ids.to(device), use_cache=False)  # the HF forward as HF runs it
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    def truncated(ids):
        capture_coefficients(model, ids, layers, lambda layer, m: None)

    def scan_step(ids, sums: bool):
        """The runner's step (kvmem.scanning.step.BatchStep): every window a document of its own."""
        windows = [WindowText(doc=scan_step.documents + row, doc_id=str(scan_step.documents + row), start=0,
                              tokens=tuple(ids[row, 1:].tolist()), following=-1, text="")
                   for row in range(ids.shape[0])]
        scan_step.documents += ids.shape[0]
        batch = Batch(block=0, windows=windows, tokens=sum(len(w.tokens) for w in windows))
        rows = BatchRows.build(batch, plan, context_before=12, context_after=4, seed=0, samples=not args.no_samples,
                               device=device)
        step = BatchStep(states[sums], rows, with_context=True, index=0)
        extra = {"on_gate_up": step.gate_up} if step.wants_gate_up else {}
        capture_coefficients(model, rows.ids, layers, step.layer, **extra)
        step.finish()
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    scan_step.documents = 0
    plain = lambda ids: scan_step(ids, False)  # noqa: E731
    with_sums = lambda ids: scan_step(ids, True)  # noqa: E731
    bare(batches[0]), truncated(batches[0]), plain(batches[0]), with_sums(batches[0])  # warm-up
    seconds = {"bare": [], "truncated": [], "scan": [], "scan_sums": []}
    tokens = sum(ids.shape[0] * (ids.shape[1] - 1) for ids in batches)
    for _ in range(args.repeats):
        totals = dict.fromkeys(seconds, 0.0)
        for ids in batches:  # alternate batch by batch so drift hits all four alike
            for name, fn in (("bare", bare), ("truncated", truncated), ("scan", plain), ("scan_sums", with_sums)):
                with Timer() as t:
                    fn(ids)
                totals[name] += t.seconds
        for name in seconds:
            seconds[name].append(totals[name])
    rate = {name: tokens / statistics.median(values) for name, values in seconds.items()}
    overhead = statistics.median(seconds["scan_sums"]) / statistics.median(seconds["scan"]) - 1
    result = {
        "model": args.model, "samples": not args.no_samples, "statistics": states[True].statistics.names,
        "tokens": tokens, "batch": list(batches[0].shape), "machine": machine(),
        "bare_tok_s": round(rate["bare"], 1), "truncated_tok_s": round(rate["truncated"], 1),
        "scan_tok_s": round(rate["scan"], 1), "scan_with_taxonomy_sums_tok_s": round(rate["scan_sums"], 1),
        "taxonomy_sums_overhead": round(overhead, 4), "gated": gated,
        "ratio_vs_bare_forward": round(rate["scan"] / rate["bare"], 3),
        "ratio_vs_truncated_forward": round(rate["scan"] / rate["truncated"], 3),
    }
    print(f"{args.model}: bare forward {rate['bare']:.0f} tok/s, forward to last FFN {rate['truncated']:.0f} tok/s, "
          f"full scan {rate['scan']:.0f} tok/s -> ratio {result['ratio_vs_bare_forward']:.2f} vs bare, "
          f"{result['ratio_vs_truncated_forward']:.2f} vs truncated ({machine()})")
    print(f"taxonomy sums (Σ m·p{', gate/up quadrants and trigger gate/up' if gated else ''}, unigram counts): "
          f"scan {rate['scan']:.0f} tok/s without, {rate['scan_sums']:.0f} tok/s with -> {100 * overhead:+.1f}% "
          f"of the streaming step")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
