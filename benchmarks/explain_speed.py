"""Speed of the tokens explainer with detection and simulation scores (their derangement baselines included).

    python benchmarks/explain_speed.py --atlas ATLAS [--layers 0,5] [--neurons-per-layer 1536]

Times ``kvmem.explain`` (tokens) and ``kvmem.score`` (detection, simulation; tokens judge; 1,000
bootstrap replicates; derangement baselines) on a copy of the atlas, and prints seconds per neuron
and the time for all 46,080 neurons of smollm2-135m at that rate (30 layers x 1,536; the target is at
most 10 minutes on 2 cores). Without --atlas it scans smollm2-135m (layers 0 and 15, 20,000 pydoc
tokens, 200 random samples) into a temporary directory first.
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


def main(argv=None) -> int:
    import torch

    import kvmem

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--atlas", default=None)
    parser.add_argument("--layers", default=None, help="layers to explain (default: all of the atlas)")
    parser.add_argument("--neurons-per-layer", type=int, default=None, help="first N neurons of each layer")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="kvmem-explain-speed-"))
    try:
        if args.atlas is None:
            model = kvmem.load_model("smollm2-135m", device="cpu")
            kvmem.scan(model, "pydoc", out=work / "source", max_tokens=20000, layers=[0, 15], random_samples=200,
                       progress=False)
            source = work / "source"
        else:
            source = Path(args.atlas)
        atlas_dir = work / "atlas"
        shutil.copytree(source, atlas_dir, ignore=shutil.ignore_patterns("explanations*", "*.random-init*"))
        atlas = kvmem.open(atlas_dir)
        layers = [int(x) for x in args.layers.split(",")] if args.layers else atlas.layers
        per_layer = args.neurons_per_layer or atlas.d_ff
        neurons = [(layer, n) for layer in layers for n in range(per_layer)]
        start = time.perf_counter()
        rows = kvmem.explain(atlas, neurons=neurons)
        explained = time.perf_counter() - start
        start = time.perf_counter()
        kvmem.score(atlas, scorers="detection,simulation")
        scored = time.perf_counter() - start
        per_neuron = (explained + scored) / len(neurons)
        print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch threads "
              f"{torch.get_num_threads()}, python {platform.python_version()}")
        print(f"atlas: {atlas.manifest.model['name']}, {len(neurons):,} neurons ({len(rows):,} sides) of layers {layers}")
        print(f"explain (tokens): {explained:.1f} s; score (detection + simulation, baselines): {scored:.1f} s")
        print(f"per neuron: {1000 * per_neuron:.1f} ms (explain {1000 * explained / len(neurons):.1f}, "
              f"score {1000 * scored / len(neurons):.1f})")
        print(f"all {SMOLLM2_NEURONS:,} smollm2-135m neurons at this rate: {per_neuron * SMOLLM2_NEURONS / 60:.1f} min "
              f"(target <= 10 min on 2 cores)")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
