"""Speed of the tokens explainer with detection and simulation scores (their derangement baselines included).

    python benchmarks/explain_speed.py [--atlas ATLAS] [--tokens 20000] [--layers 0,5] [--neurons-per-layer 1536]

Times ``kvmem.explain`` (tokens) and ``kvmem.score`` (detection, simulation; tokens judge; 1,000
bootstrap replicates; derangement baselines) on a copy of the atlas, and prints seconds per neuron,
the time for all 46,080 neurons of smollm2-135m at that rate (30 layers x 1,536; the target is at
most 10 minutes on 2 cores), and the actual total when the run covered them all. Without --atlas it
first scans smollm2-135m (all 30 layers, ``--tokens`` tokens of the built-in ``pydoc`` corpus, 200
random samples per layer, other settings default) into a temporary directory; the scan is not timed.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path

SMOLLM2_NEURONS = 30 * 1536


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _load() -> str:
    try:
        return " ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "unknown"


def main(argv=None) -> int:
    import torch

    import kvmem

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--atlas", default=None)
    parser.add_argument("--tokens", type=int, default=20000, help="tokens to scan without --atlas (default 20000)")
    parser.add_argument("--layers", default=None, help="layers to explain (default: all of the atlas)")
    parser.add_argument("--neurons-per-layer", type=int, default=None, help="first N neurons of each layer")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="kvmem-explain-speed-"))
    try:
        if args.atlas is None:
            model = kvmem.load_model("smollm2-135m", device="cpu")
            kvmem.scan(model, "pydoc", out=work / "source", max_tokens=args.tokens, random_samples=200, progress=False)
            source = work / "source"
        else:
            source = Path(args.atlas)
        atlas_dir = work / "atlas"
        shutil.copytree(source, atlas_dir, ignore=shutil.ignore_patterns("explanations*", "*.random-init*"))
        atlas = kvmem.open(atlas_dir)
        layers = [int(x) for x in args.layers.split(",")] if args.layers else atlas.layers
        per_layer = args.neurons_per_layer or atlas.d_ff
        neurons = [(layer, n) for layer in layers for n in range(per_layer)]
        load_before = _load()
        start = time.perf_counter()
        rows = kvmem.explain(atlas, neurons=neurons)
        explained = time.perf_counter() - start
        start = time.perf_counter()
        scored = kvmem.score(atlas, scorers="detection,simulation")
        scoring = time.perf_counter() - start
        total = explained + scoring
        per_neuron = total / len(neurons)
        print(f"machine: {_cpu()}, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}, python "
              f"{platform.python_version()}; load average before {load_before}, after {_load()}")
        print(f"atlas: {atlas.manifest.model['name']}, {atlas.manifest.tokens:,} tokens of "
              f"the {atlas.manifest.corpus.get('spec', '?')} corpus, kvmem {atlas.manifest.kvmem_version}; "
              f"{len(neurons):,} neurons ({len(rows):,} sides) of {len(layers)} layer(s)")
        print(f"explain (tokens): {explained:.1f} s; score (detection + simulation, derangement baselines, "
              f"1,000 bootstrap replicates): {scoring:.1f} s; detection mean {scored.detection.mean():.3f}")
        print(f"per neuron: {1000 * per_neuron:.2f} ms (explain {1000 * explained / len(neurons):.2f}, "
              f"score {1000 * scoring / len(neurons):.2f})")
        if len(neurons) == SMOLLM2_NEURONS and atlas.manifest.model["name"] == "smollm2-135m":
            print(f"all {SMOLLM2_NEURONS:,} smollm2-135m neurons: {total / 60:.2f} min measured "
                  f"(target <= 10 min on 2 cores)")
        else:
            print(f"all {SMOLLM2_NEURONS:,} smollm2-135m neurons at this rate: {per_neuron * SMOLLM2_NEURONS / 60:.2f} "
                  f"min, extrapolated (target <= 10 min on 2 cores)")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
