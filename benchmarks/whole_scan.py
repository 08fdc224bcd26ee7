"""What a user waits for: the whole ``kvmem.scan`` against the bare forward over the same windows.

Whole scan = ``kvmem.scan`` with default settings (streaming, trigger texts, context coefficients,
samples, projections, writing the atlas), timed from after the model load to the atlas on disk.
Bare forward = the HF model's own forward *with logits* over exactly the batches the scan reads
(the tokenization plan's batches), in the same process: ``Model.unbridged``, the HF modules as HF
runs them (its attention implementation, no TransformerLens component; tests/test_capture_ffn.py
checks it against a separately loaded HF model to the bit), without a KV cache. Both run twice (bare, scan, bare, scan);
the figure is the median of each. The ratio is bare seconds / scan seconds (1.0 = the scan costs
no more than reading the corpus with the model). The first scan of a model also fills the
per-model projection cache; it is reported apart (``--cold`` uses an empty cache for it).

    python benchmarks/whole_scan.py --model smollm2-135m --tokens 20000 [--cold]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
from pathlib import Path

import torch
from common import Timer, machine, peak_rss_mb

import kvmem
from kvmem.plan import StreamPosition, iterate_batches
from kvmem.scanning.config import ScanConfig
from kvmem.scanning.runner import token_plan
from kvmem.scanning.step import BatchRows


def scan_batches(model, corpus: str, tokens: int, *, batch_size: int = 8) -> list[torch.Tensor]:
    """The model inputs [batch, pos] of the batches a scan of ``tokens`` tokens reads, in order."""
    plan = token_plan(model, ScanConfig(max_tokens=tokens, batch_size=batch_size))
    return [BatchRows.build(batch, plan, context_before=0, context_after=0, seed=0, samples=False, device="cpu").ids
            for batch in iterate_batches(kvmem.corpus.open_corpus(corpus), model.tokenizer, plan, StreamPosition())]


def forward_seconds(hf_model, batches: list[torch.Tensor]) -> float:
    """Seconds of an HF model's forward with logits (no KV cache) over ``batches``."""
    device = next(hf_model.parameters()).device
    with Timer() as timer, torch.inference_mode():
        for ids in batches:
            hf_model(ids.to(device), use_cache=False)
        if device.type == "cuda":
            torch.cuda.synchronize()
    return timer.seconds


def bare_forward(model, corpus: str, tokens: int, *, batch_size: int = 8) -> float:
    """Seconds of the HF forward as HF runs it (with logits) over the scan's own batches."""
    return forward_seconds(model.unbridged, scan_batches(model, corpus, tokens, batch_size=batch_size))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--corpus", default="pydoc")
    parser.add_argument("--tokens", type=int, default=20_000)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--cold", action="store_true", help="first scan with an empty projection cache")
    args = parser.parse_args()

    model = kvmem.load_model(args.model)
    out = tempfile.mkdtemp(prefix="kvmem-bench-")
    cold = None
    if args.cold:
        cache = tempfile.mkdtemp(prefix="kvmem-bench-cache-")
        os.environ["KVMEM_CACHE"] = cache  # the model is loaded: only the projection cache starts empty
        with Timer() as timer:
            kvmem.scan(model, args.corpus, out=f"{out}/cold", max_tokens=args.tokens, progress=False)
        cold = round(timer.seconds, 1)
    bare, whole, phases = [], [], []
    for _ in range(args.repeats):
        bare.append(bare_forward(model, args.corpus, args.tokens))
        with Timer() as timer:
            atlas = kvmem.scan(model, args.corpus, out=f"{out}/warm", overwrite=True, max_tokens=args.tokens,
                               progress=False)
        whole.append(timer.seconds)
        phases.append(atlas.manifest.timing["phases"])
    atlas_mb = sum(f.stat().st_size for f in Path(out, "warm").iterdir()) / 1e6  # values/keys: linked from the cache
    shutil.rmtree(out, ignore_errors=True)
    bare_s, whole_s = statistics.median(bare), statistics.median(whole)
    result = {"model": args.model, "corpus": args.corpus, "tokens": args.tokens, "bare_seconds": round(bare_s, 2),
              "scan_seconds": round(whole_s, 2), "ratio": round(bare_s / whole_s, 3),
              "runs": {"bare": [round(x, 2) for x in bare], "scan": [round(x, 2) for x in whole]},
              "phases": phases[whole.index(sorted(whole)[len(whole) // 2])], "first_scan_cold_seconds": cold,
              "first_warm_scan": {"seconds": round(whole[0], 1), "phases": phases[0]},
              "projections": atlas.manifest.scan.get("projections"), "atlas_mb": round(atlas_mb, 1),
              "peak_rss_mb": round(peak_rss_mb(), 1), "machine": machine()}
    print(f"{args.model}, {args.tokens:,} tokens: whole scan {whole_s:.2f} s, bare forward {bare_s:.2f} s -> "
          f"ratio {result['ratio']:.2f}; phases {result['phases']}"
          + f"; the first warm scan in the process {whole[0]:.1f} s {phases[0]}"
          + (f"; first scan with an empty projection cache {cold} s" if cold else ""))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
