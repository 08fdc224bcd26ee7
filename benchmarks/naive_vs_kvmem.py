"""The naive way against kvmem's streaming pass: tokens/s and peak memory.

naive: TransformerLens ``run_with_cache`` on every ``hook_post``, concatenated over the corpus,
then ``torch.topk`` (top and bottom 25) per layer. kvmem: ``kvmem.scanning.runner.stream`` with
the same k, statistics and histograms, over the same corpus (``pydoc``: long documents, so both read
full 256-token windows). Each run is a fresh process, so peak RSS is its own.

    python benchmarks/naive_vs_kvmem.py --mode naive|kvmem --tokens 10000 [--model gpt2-random]
"""

from __future__ import annotations

import argparse
import json

import torch
from common import Timer, machine, peak_rss_mb, token_batches

import kvmem


def naive(model, tokens: int) -> None:
    batches = token_batches(model, tokens)
    names = {model.hook_name(layer) for layer in range(model.n_layers)}
    kept: dict[int, list[torch.Tensor]] = {layer: [] for layer in range(model.n_layers)}
    with torch.inference_mode():
        for ids in batches:
            _, cache = model.bridge.run_with_cache(ids, names_filter=lambda name: name in names)
            for layer in kept:
                kept[layer].append(cache[model.hook_name(layer)][:, 1:].reshape(-1, model.d_ff).clone())
            del cache
        for layer in list(kept):  # one layer at a time, freeing as it goes
            acts = torch.cat(kept.pop(layer))  # [tokens, d_ff]
            torch.topk(acts, 25, dim=0), torch.topk(acts, 25, dim=0, largest=False)
            del acts


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["naive", "kvmem"], required=True)
    parser.add_argument("--tokens", type=int, default=10_000)
    parser.add_argument("--model", default="gpt2-random")
    args = parser.parse_args()
    model = kvmem.load_model(args.model)
    baseline = peak_rss_mb()
    with Timer() as timer:
        if args.mode == "naive":
            naive(model, args.tokens)
        else:
            from kvmem.scanning.runner import stream

            state = stream(model, "pydoc", max_tokens=args.tokens, top_k=25, window=256, batch_size=8)
            assert 0 < state.tokens <= args.tokens  # scored; each window's first token is read, not scored
    result = {"mode": args.mode, "model": args.model, "tokens": args.tokens,
              "tok_s": round(args.tokens / timer.seconds, 1), "seconds": round(timer.seconds, 1),
              "peak_rss_mb": round(peak_rss_mb(), 1), "rss_after_load_mb": round(baseline, 1), "machine": machine()}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
