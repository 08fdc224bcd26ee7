"""``kvmem report``: export neuron reports (formats from :data:`kvmem.report.formats.FORMATS`) with an index.

    kvmem report --atlas DIR --neurons 3:17,5:200 --out DIR
    kvmem report --atlas DIR --layers 3 --top M [--by max|mean|frac_positive] --format md --out DIR
"""

from __future__ import annotations

import argparse

from kvmem.cli.options import add_atlas_option, add_layers_option, add_neurons_option, parse_layers, parse_neurons
from kvmem.errors import KvmemError
from kvmem.report import export_many, select_neurons
from kvmem.report.formats import FORMATS
from kvmem.report.writing import RANKINGS


def add_arguments(parser: argparse.ArgumentParser, command: str) -> None:
    add_atlas_option(parser)
    add_neurons_option(parser, "report these neurons (or use --layers with --top)")
    add_layers_option(parser, "with --top: report the best neurons of each of these layers")
    parser.add_argument("--top", type=_integer, default=None, help="with --layers: how many neurons per layer")
    parser.add_argument("--by", default="max", choices=list(RANKINGS), help="ranking for --top (default: max coefficient)")
    described = "; ".join(f"{f.name}: {f.description}" for f in FORMATS.values())
    parser.add_argument("--format", default="html", choices=list(FORMATS),
                        help=f"report format (default html). {described}")
    parser.add_argument("--out", required=True, help="output directory (refused if it exists, unless --overwrite)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing report directory")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")


def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def pairs_from_args(args: argparse.Namespace, atlas) -> list[tuple[int, int]]:
    """(layer, neuron) pairs from ``--neurons`` or from ``--layers/--top/--by``."""

    neurons, layers = parse_neurons(args.neurons), parse_layers(args.layers)
    ranked = layers is not None or args.top is not None
    if neurons and ranked:
        raise KvmemError("give either --neurons or --layers L --top M, not both")
    if ranked:
        if layers is None or args.top is None:
            raise KvmemError("--layers and --top go together: e.g. --layers 3 --top 10")
        return [pair for layer in layers for pair in select_neurons(atlas, layer, top=args.top, by=args.by)]
    if not neurons:
        raise KvmemError("nothing to report: give --neurons (e.g. 3:17,5:2) or --layers L --top M")
    for layer, neuron in neurons:
        atlas.check(layer, neuron)
    return neurons


def run(args: argparse.Namespace) -> int:
    from kvmem.atlas import open_atlas

    atlas = open_atlas(args.atlas)
    pairs = pairs_from_args(args, atlas)
    index = export_many(atlas, pairs, format=args.format, out=args.out, progress=not args.no_progress,
                        overwrite=args.overwrite)
    print(f"wrote {len(dict.fromkeys(pairs))} {args.format} report(s) and {index}")
    return 0
