"""``kvmem report``: export neuron reports (formats from :data:`kvmem.report.formats.FORMATS`) with an index.

    kvmem report --atlas DIR L N [L N ...] --out DIR
    kvmem report --atlas DIR --layer L --top M [--by max|mean|frac_positive] --format md --out DIR
"""

from __future__ import annotations

import argparse

from kvmem.errors import KvmemError


def add_arguments(parser: argparse.ArgumentParser, command: str) -> None:
    from kvmem.report.export import RANKINGS
    from kvmem.report.formats import FORMATS

    parser.add_argument("neurons", nargs="*", type=_integer, metavar="L N",
                        help="layer and neuron pairs, e.g. 3 17 5 200 (or use --layer with --top)")
    parser.add_argument("--atlas", required=True, help="atlas directory written by kvmem scan")
    parser.add_argument("--layer", type=_integer, default=None, help="with --top: report the best neurons of this layer")
    parser.add_argument("--top", type=_integer, default=None, help="with --layer: how many neurons")
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
    """(layer, neuron) pairs from positional ``L N`` pairs or from ``--layer/--top/--by``."""
    from kvmem.report import select_neurons

    ranked = args.layer is not None or args.top is not None
    if args.neurons and ranked:
        raise KvmemError("give either L N pairs or --layer L --top M, not both")
    if ranked:
        if args.layer is None or args.top is None:
            raise KvmemError("--layer and --top go together: e.g. --layer 3 --top 10")
        return select_neurons(atlas, args.layer, top=args.top, by=args.by)
    if not args.neurons:
        raise KvmemError("nothing to report: give L N pairs (e.g. 3 17) or --layer L --top M")
    if len(args.neurons) % 2:
        raise KvmemError(f"neurons come in L N pairs; got {len(args.neurons)} number(s) "
                         f"({' '.join(map(str, args.neurons))})")
    return list(zip(args.neurons[0::2], args.neurons[1::2]))


def run(args: argparse.Namespace) -> int:
    from kvmem.atlas import open_atlas
    from kvmem.report import export_many

    atlas = open_atlas(args.atlas)
    pairs = pairs_from_args(args, atlas)
    index = export_many(atlas, pairs, format=args.format, out=args.out, progress=not args.no_progress,
                        overwrite=args.overwrite)
    print(f"wrote {len(dict.fromkeys(pairs))} {args.format} report(s) and {index}")
    return 0
