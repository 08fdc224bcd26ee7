"""``kvmem export``: write an atlas's neurons in another tool's format (formats: :data:`kvmem.export.FORMATS`).

    kvmem export --atlas A --format neuron-explainer --out DIR [--layers 0,5,10-12] [--neurons 3:17,5:2] [--model M]
"""

from __future__ import annotations

import argparse

from kvmem.cli.options import add_atlas_option, add_layers_option, add_neurons_option, parse_layers, parse_neurons
from kvmem.devices import device_help


def add_arguments(parser: argparse.ArgumentParser, command: str) -> None:
    from kvmem.export import FORMATS

    formats = "; ".join(f"{name}: {fmt.description}" for name, fmt in FORMATS.items())
    add_atlas_option(parser)
    parser.add_argument("--format", required=True, choices=list(FORMATS), help=formats)
    parser.add_argument("--out", required=True, help="output directory (refused if it exists, unless --overwrite)")
    add_layers_option(parser, "export every neuron of these layers")
    add_neurons_option(parser, "export these neurons (with --layers: both; neither: the whole atlas)")
    parser.add_argument("--model", default=None,
                        help="the scanned model, for context coefficients of quantile samples "
                             "(default: load the model named in the atlas manifest)")
    parser.add_argument("--corpus", default=None, help="the scanned corpus, if the manifest's spec cannot reopen it")
    parser.add_argument("--no-quantiles", action="store_true",
                        help="write random_sample_by_quantile and quantile_boundaries as null (no model needed)")
    parser.add_argument("--per-band", type=int, default=5, help="samples per quantile band (default 5)")
    parser.add_argument("--device", default=None, help="for --model: " + device_help())
    parser.add_argument("--overwrite", action="store_true", help="replace a previous export in --out")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")


def run(args: argparse.Namespace) -> int:
    from kvmem.atlas import open_atlas
    from kvmem.export import export_atlas

    layers, neurons = parse_layers(args.layers), parse_neurons(args.neurons)
    atlas = open_atlas(args.atlas)
    model = None
    if args.model is not None:
        from kvmem.loading import load_model

        model = load_model(args.model, device=args.device, dtype=atlas.manifest.model.get("dtype"))
    out = export_atlas(atlas, format=args.format, out=args.out, layers=layers, neurons=neurons,
                       model=model, corpus=args.corpus, overwrite=args.overwrite, progress=not args.no_progress,
                       quantiles=not args.no_quantiles, per_band=args.per_band)
    print(f"wrote {args.format} export of {len(list((out / 'kvmem').glob('*/*.json')))} neuron(s) to {out}")
    return 0
