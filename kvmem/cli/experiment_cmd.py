"""``kvmem experiment NAME --atlas DIR``: a Geva et al. (2021) measurement as a per-layer table.

NAME is one of agreement, next-token-rank, token-removal, active-memories, layer-vs-memories.
The model is the one named in the atlas manifest unless ``--model`` is given; its fingerprint is
compared with the atlas's and a mismatch is reported. ``agreement`` needs no model.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

from kvmem.conventions import CONVENTIONS, DEFAULT_CONVENTION
from kvmem.errors import KvmemError

NAMES = ("agreement", "next-token-rank", "token-removal", "active-memories", "layer-vs-memories")
NEEDS_MODEL = {"next-token-rank", "token-removal", "active-memories", "layer-vs-memories"}
OUTPUTS = (".csv", ".parquet", ".json")


def add_arguments(parser: argparse.ArgumentParser, command: str) -> None:
    parser.add_argument("name", choices=NAMES, metavar="NAME", help=f"the measurement: {', '.join(NAMES)}")
    parser.add_argument("--atlas", required=True, help="atlas directory written by kvmem scan")
    parser.add_argument("--model", default=None,
                        help="model to use instead of the atlas's (name, HF directory or hub id); fingerprint checked")
    parser.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    parser.add_argument("--corpus", default=None,
                        help="the scanned corpus, when the manifest's cannot be re-opened (token-removal, "
                             "active-memories, layer-vs-memories)")
    parser.add_argument("--convention", default=DEFAULT_CONVENTION, choices=list(CONVENTIONS),
                        help="value projection convention (agreement, next-token-rank, layer-vs-memories)")
    parser.add_argument("--kind", default="top", choices=("top", "top_doc"),
                        help="trigger kind: top-k positions, or one per document (needs a --per-document atlas)")
    parser.add_argument("--top-triggers", default=None, help="agreement: comma-separated k values (default 1,5,25)")
    parser.add_argument("--triggers", type=int, default=None,
                        help="triggers per key (next-token-rank: default 1; token-removal: default 3)")
    parser.add_argument("--keys-per-layer", type=int, default=10, help="token-removal: keys sampled per layer")
    parser.add_argument("--positions", type=int, default=None,
                        help="corpus positions sampled (active-memories: default 500; layer-vs-memories: 300)")
    parser.add_argument("--threshold", type=float, default=0.0, help="active when m_i > threshold")
    parser.add_argument("--abs-threshold", type=float, default=0.1, help="active when |m_i| > this (gated FFNs)")
    parser.add_argument("--top-memories", type=int, default=10, help="layer-vs-memories: heaviest memories compared")
    parser.add_argument("--layers", default=None, help="layers, e.g. 0,5,10-12 (default: all)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed")
    parser.add_argument("--out", default=None, help=f"also write the table ({', '.join(OUTPUTS)})")
    parser.add_argument("--plot", default=None, help="also save the plot (e.g. plot.png)")


def parse_layers(text: str | None) -> list[int] | None:
    """'0,5,10-12' -> [0, 5, 10, 11, 12]."""
    if text is None:
        return None
    layers: set[int] = set()
    try:
        for part in text.split(","):
            low, _, high = part.strip().partition("-")
            layers.update(range(int(low), int(high or low) + 1))
    except ValueError:
        raise KvmemError(f"--layers expects comma-separated layers or ranges like 0,5,10-12, got {text!r}") from None
    if not layers:
        raise KvmemError(f"--layers names no layer: {text!r}")
    return sorted(layers)


def _top_triggers(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(k) for k in text.split(",") if k.strip()]
    except ValueError:
        raise KvmemError(f"--top-triggers expects comma-separated integers like 1,5,25, got {text!r}") from None


def _compute(args: argparse.Namespace, atlas, model):
    from kvmem import experiments

    layers = parse_layers(args.layers)
    if args.name == "agreement":
        return experiments.agreement(atlas, model=model, convention=args.convention, kind=args.kind, layers=layers,
                                     top_triggers=_top_triggers(args.top_triggers), seed=args.seed)
    if args.name == "next-token-rank":
        return experiments.next_token_rank(atlas, model, convention=args.convention, kind=args.kind, layers=layers,
                                           triggers=args.triggers or 1, seed=args.seed)
    if args.name == "token-removal":
        return experiments.token_removal(atlas, model, args.corpus, keys_per_layer=args.keys_per_layer,
                                         triggers=args.triggers or 3, kind=args.kind, layers=layers, seed=args.seed)
    if args.name == "active-memories":
        return experiments.active_memories(model, args.corpus, atlas=atlas, positions=args.positions or 500,
                                           threshold=args.threshold, abs_threshold=args.abs_threshold, layers=layers,
                                           seed=args.seed)
    return experiments.layer_vs_memories(model, args.corpus, atlas=atlas, positions=args.positions or 300,
                                         convention=args.convention, top_memories=args.top_memories,
                                         threshold=args.threshold, abs_threshold=args.abs_threshold, layers=layers,
                                         seed=args.seed)


def _write(frame, path: Path) -> None:
    if path.suffix not in OUTPUTS:
        raise KvmemError(f"--out {path}: unsupported file type; use one of {', '.join(OUTPUTS)}")
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".csv":
        frame.to_csv(path, index=False)
    elif path.suffix == ".parquet":
        frame.to_parquet(path, index=False)
    else:
        data = {"provenance": frame.attrs, "rows": json.loads(frame.to_json(orient="records"))}
        path.write_text(json.dumps(data, indent=2, default=str) + "\n")


def run(args: argparse.Namespace) -> int:
    from kvmem.cli.output import print_table
    from kvmem.experiments import EXPERIMENTS
    from kvmem.experiments.common import FingerprintWarning, as_atlas, model_for_atlas

    atlas = as_atlas(args.atlas)
    if args.out is not None and Path(args.out).suffix not in OUTPUTS:
        raise KvmemError(f"--out {args.out}: unsupported file type; use one of {', '.join(OUTPUTS)}")
    model = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", FingerprintWarning)
        if args.name in NEEDS_MODEL or args.model is not None:
            model = model_for_atlas(atlas, args.model, device=args.device)
        frame = _compute(args, atlas, model)
    mismatch = [w for w in caught if issubclass(w.category, FingerprintWarning)]
    for w in mismatch:
        print(f"kvmem: warning: {w.message}", file=sys.stderr)
    for w in caught:
        if not issubclass(w.category, FingerprintWarning):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    a = frame.attrs
    check = ("" if model is None else
             "; model fingerprint matches the atlas" if not mismatch else "; MODEL FINGERPRINT DIFFERS FROM THE ATLAS")
    print(f"{args.name}: model {a.get('model')!r}, corpus {a.get('corpus')!r}"
          f"{', convention ' + a['convention'] if 'convention' in a else ''}{check}")
    floats = {c: "{:.4f}" for c in frame.columns if frame[c].dtype.kind == "f"}
    for c in floats:
        if c in ("median", "q1", "q3", "median_shuffled", "active"):
            floats[c] = "{:.4g}"
        elif c.startswith("random_") or c == "max_abs_error":
            floats[c] = "{:.2e}"
    print_table(frame, floats=floats)
    if args.out is not None:
        _write(frame, Path(args.out))
        print(f"wrote {args.out}")
    if args.plot is not None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        from kvmem import experiments

        ax = getattr(experiments, EXPERIMENTS[args.name][1])(frame)
        ax.figure.tight_layout()
        ax.figure.savefig(args.plot, dpi=120)
        plt.close(ax.figure)
        print(f"wrote {args.plot}")
    return 0
