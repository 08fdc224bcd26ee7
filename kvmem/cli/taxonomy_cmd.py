"""``kvmem taxonomy``: the neuron taxonomy table, from an atlas (``--atlas A``) or from the weights (``--model M``)."""

from __future__ import annotations

import argparse

from kvmem.atlas_origin import load_scanned_model
from kvmem.devices import device_help
from kvmem.errors import KvmemError
from kvmem.loading import load_model


def add_arguments(parser: argparse.ArgumentParser, command: str) -> None:
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--atlas", help="atlas directory: writes ATLAS/taxonomy.parquet (loads the model its manifest names)")
    source.add_argument("--model", help="weights only: smollm2-135m, gpt2-random, a local HF directory or a hub id")
    parser.add_argument("--out", help="output .parquet (required with --model; default ATLAS/taxonomy.parquet)")
    parser.add_argument("--convention", default=None,
                        help="value projection the self-suppression rank reads (default: the atlas's default)")
    parser.add_argument("--block", type=int, default=512, help="neurons per product of the vocabulary statistics")
    parser.add_argument("--device", default="cpu", help=device_help("cpu"))
    parser.add_argument("--revision", default=None, help="hub revision with --model")


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from kvmem.taxonomy.table import FILE, build_taxonomy, write_taxonomy

    if args.block < 1:
        raise KvmemError(f"--block must be at least 1, got {args.block}")
    if args.atlas is not None:
        from kvmem.atlas import open_atlas

        atlas = open_atlas(args.atlas)
        if args.convention is not None and args.convention not in atlas.conventions:
            raise KvmemError(f"convention {args.convention!r} is not in this atlas; it has {', '.join(atlas.conventions)}")
        model = load_scanned_model(atlas, device=args.device)
        out = Path(args.out) if args.out else atlas.path / FILE
    else:
        if args.out is None:
            raise KvmemError("--model needs --out FILE.parquet (where to write the weights-only taxonomy)")
        if args.convention is not None:
            raise KvmemError("--convention applies to --atlas only (the self-suppression rank reads the atlas's values)")

        atlas = None
        model = load_model(args.model, device=args.device, revision=args.revision)
        out = Path(args.out)
    frame, metadata = build_taxonomy(model, atlas=atlas, convention=args.convention, block=args.block)
    path = write_taxonomy(frame, metadata, out)
    timing = metadata["timing_seconds"]
    print(f"wrote {path} ({len(frame):,} neurons, {frame.layer.nunique()} layers; null space k = "
          f"{metadata['null_space_dim']}) in {timing['total']:.1f} s (vocabulary statistics {timing.get('vocab', 0):.1f} s)")
    print(f"prediction {int(frame.prediction.sum()):,}, suppression {int(frame.suppression.sum()):,}, "
          f"entropy candidates {int(frame.entropy_candidate.sum()):,}"
          + (f", dead {int(frame.dead.sum()):,}, rare {int(frame.rare.sum()):,}" if "dead" in frame else ""))
    return 0
