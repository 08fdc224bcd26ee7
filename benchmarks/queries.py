"""Query latency on an atlas of GPT-2-small size (12 × 3,072 slots, k=25).

Builds the atlas once (a scan of the GPT-2 small architecture at random init over real text),
then times ``atlas.neuron(l, i)``, ``atlas.triggers(l, i)`` (trigger rows joined to their texts
in the contexts table), ``atlas.top_neurons(token=...)`` on random slots / tokens, and
``atlas.search(regex)``.

    python benchmarks/queries.py [--atlas DIR] [--samples 50]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

from common import machine

import kvmem


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--atlas", default=str(Path(tempfile.gettempdir()) / "kvmem-bench-gpt2-atlas"))
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--samples", type=int, default=50)
    args = parser.parse_args()
    if not Path(args.atlas, "manifest.json").exists():
        model = kvmem.load_model("gpt2-random")
        kvmem.scan(model, "stdlib-docs", out=args.atlas, overwrite=True, max_tokens=args.tokens, top_k=25,
                   context_activations=False, progress=False)
    rng = random.Random(0)
    atlas = kvmem.open(args.atlas)
    start = time.perf_counter()
    atlas.neuron(0, 0)
    first = time.perf_counter() - start
    latencies = {"neuron": [], "triggers": [], "top_neurons_value": [], "top_neurons_trigger": [], "search": []}
    tokens = atlas.values(5, 5).token_id.tolist()
    for _ in range(args.samples):
        layer, neuron = rng.choice(atlas.layers), rng.randrange(atlas.d_ff)
        t = time.perf_counter()
        atlas.neuron(layer, neuron)
        latencies["neuron"].append(time.perf_counter() - t)
        t = time.perf_counter()
        atlas.triggers(layer, neuron)
        latencies["triggers"].append(time.perf_counter() - t)
        token = rng.choice(tokens)
        for by in ("value", "trigger"):
            t = time.perf_counter()
            atlas.top_neurons(token=token, by=by)
            latencies[f"top_neurons_{by}"].append(time.perf_counter() - t)
        t = time.perf_counter()
        atlas.search(rng.choice([r"\bthe\b", r"[0-9]+", r"def ", r"(?i)python"]), limit=50)
        latencies["search"].append(time.perf_counter() - t)
    result = {name: round(statistics.median(v) * 1000, 2) for name, v in latencies.items()}
    result["spread_ms"] = {name: [round(min(v) * 1000, 2), round(max(v) * 1000, 2)] for name, v in latencies.items()}
    result.update({"first_neuron_ms": round(first * 1000, 1), "slots": len(atlas.neurons),
                   "trigger_rows": len(atlas.table("triggers", ["layer"])),
                   "context_rows": len(atlas.table("contexts", ["doc"])),
                   "atlas_bytes": sum(f.stat().st_size for f in Path(args.atlas).iterdir() if f.is_file()),
                   "machine": machine()})
    print(json.dumps(result))


if __name__ == "__main__":
    main()
