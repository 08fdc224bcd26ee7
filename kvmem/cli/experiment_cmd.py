"""``kvmem experiment NAME --atlas DIR``: a Geva et al. (2021) measurement as a per-layer table.

NAME is any experiment of the registry (:data:`kvmem.experiments.registry.EXPERIMENTS`); its choices
and help come from there. Each option is passed to the experiment's function parameter of the same
name (``--neurons-per-layer`` -> ``neurons_per_layer``), only when given, so the function's defaults
apply; an option the function does not take is a user error. The model is the one named in the atlas
manifest unless ``--model`` is given; its fingerprint is compared with the atlas's and a mismatch is
reported. ``geva2021`` runs every measurement and writes a results directory (``--out DIR``).
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import warnings
from pathlib import Path

from kvmem.cli.options import add_layers_option, parse_layers
from kvmem.cli.printing import print_table
from kvmem.devices import device_help
from kvmem.errors import KvmemError
from kvmem.experiments.registry import EXPERIMENTS

OUTPUTS = (".csv", ".parquet", ".json")


def _list(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _ints(option: str, example: str):
    def parse(text: str) -> list[int]:
        try:
            return [int(k) for k in _list(text)]
        except ValueError:
            raise KvmemError(f"{option} expects comma-separated integers like {example}, got {text!r}") from None
    return parse


def _bos(text: str) -> list:
    return [int(part) if part.isdigit() else part for part in _list(text)]


# option dest -> (parser of the option's text or None, function parameter)
CONVERTERS = {
    "convention": (_list, "convention"),
    "sides": (_list, "sides"),
    "kind": (None, "kind"),
    "top_triggers": (_ints("--top-triggers", "1,5,25"), "top_triggers"),
    "triggers": (None, "triggers"),
    "neurons_per_layer": (None, "neurons_per_layer"),
    "positions": (None, "positions"),
    "threshold": (None, "threshold"),
    "abs_threshold": (None, "abs_threshold"),
    "top_memories": (None, "top_memories"),
    "layers": (parse_layers, "layers"),
    "seed": (None, "seed"),
    "n_boot": (None, "n_boot"),
    "bos": (_bos, "bos"),
    "corpus": (None, "corpus"),
    "overwrite": (None, "overwrite"),
}


def add_arguments(parser: argparse.ArgumentParser, command: str) -> None:
    names = ", ".join(f"{e.name} ({e.help})" for e in EXPERIMENTS.values())
    parser.add_argument("name", choices=list(EXPERIMENTS), metavar="NAME", help=f"the measurement: {names}")
    parser.add_argument("--atlas", required=True, help="atlas directory written by kvmem scan")
    parser.add_argument("--model", default=None,
                        help="model to use instead of the atlas's (name, HF directory or hub id); fingerprint checked")
    parser.add_argument("--device", default=None, help=device_help())
    parser.add_argument("--corpus", default=None, help="the scanned corpus, when the manifest's cannot be re-opened")
    parser.add_argument("--convention", default=None,
                        help="value projection convention(s), comma-separated: raw (Geva et al.'s), final_norm "
                             "(default: both where the experiment reports several)")
    parser.add_argument("--sides", default=None,
                        help="memory sides, comma-separated: positive, negative (default: both for gated FFNs, "
                             "positive for ReLU/GELU)")
    parser.add_argument("--kind", default=None, choices=("top", "top_doc"),
                        help="trigger kind: top-k positions, or one per document (needs a --per-document atlas)")
    parser.add_argument("--top-triggers", default=None, help="agreement: comma-separated k values (default 1,5,25)")
    parser.add_argument("--triggers", type=int, default=None,
                        help="triggers per neuron (next-token-rank: default all kept; token-removal: default 3)")
    parser.add_argument("--neurons-per-layer", "--keys-per-layer", dest="neurons_per_layer", type=int, default=None,
                        help="token-removal: neurons sampled per layer and side")
    parser.add_argument("--positions", type=int, default=None, help="corpus positions sampled (sections 4 and 5)")
    parser.add_argument("--threshold", type=float, default=None, help="active when m_i > threshold")
    parser.add_argument("--abs-threshold", type=float, default=None, help="active when |m_i| > this (gated FFNs)")
    parser.add_argument("--top-memories", type=int, default=None, help="layer-vs-memories: heaviest memories compared")
    add_layers_option(parser, "layers (default: all the atlas holds)")
    parser.add_argument("--seed", type=int, default=None, help="sampling and bootstrap seed (default 0)")
    parser.add_argument("--n-boot", type=int, default=None, help="bootstrap replicates (default 1000)")
    parser.add_argument("--bos", default=None,
                        help="lm-quality, geva2021: BOS choices, comma-separated (default, none, a token such as "
                             "<|endoftext|>, or an id)")
    parser.add_argument("--overwrite", action="store_true", default=None, help="geva2021: replace an existing --out")
    parser.add_argument("--out", default=None,
                        help=f"also write the table ({', '.join(OUTPUTS)}); geva2021: the results directory (required)")
    parser.add_argument("--plot", default=None, help="also save the plot (e.g. plot.png)")


def call_arguments(args: argparse.Namespace, function, atlas, model) -> dict:
    """The keyword arguments for ``function`` from the parsed options: each given option to its parameter."""
    parameters = inspect.signature(function).parameters
    kwargs = {"atlas": atlas}
    if "model" in parameters:
        kwargs["model"] = model
    if "out" in parameters:
        if args.out is None:
            raise KvmemError(f"{args.name} writes a results directory: pass --out DIR")
        kwargs["out"] = args.out
    for dest, (convert, parameter) in CONVERTERS.items():
        value = getattr(args, dest)
        if value is None:
            continue
        if parameter not in parameters:
            raise KvmemError(f"--{dest.replace('_', '-')} does not apply to {args.name}; see kvmem experiment --help")
        kwargs[parameter] = convert(value) if convert is not None else value
    return kwargs


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
    from kvmem.experiments.atlas_inputs import FingerprintWarning, as_atlas, model_for_atlas

    experiment = EXPERIMENTS[args.name]
    function = experiment.load()
    writes_directory = "out" in inspect.signature(function).parameters
    atlas = as_atlas(args.atlas)
    if args.out is not None and not writes_directory and Path(args.out).suffix not in OUTPUTS:
        raise KvmemError(f"--out {args.out}: unsupported file type; use one of {', '.join(OUTPUTS)}")
    if args.plot is not None and experiment.plot is None:
        raise KvmemError(f"{args.name} has no plot; drop --plot")
    model = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", FingerprintWarning)
        if experiment.needs_model or args.model is not None:
            model = model_for_atlas(atlas, args.model, device=args.device)
        frame = function(**call_arguments(args, function, atlas, model))
    mismatch = [w for w in caught if issubclass(w.category, FingerprintWarning)]
    for w in mismatch:
        print(f"kvmem: warning: {w.message}", file=sys.stderr)
    for w in caught:
        if not issubclass(w.category, FingerprintWarning):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    a = frame.attrs
    check = ("" if model is None else
             "; model fingerprint matches the atlas" if not mismatch else "; MODEL FINGERPRINT DIFFERS FROM THE ATLAS")
    conventions = a.get("settings", {}).get("conventions") or ([a["convention"]] if "convention" in a else [])
    print(f"{args.name}: model {a.get('model')!r}, corpus {a.get('corpus')!r}"
          f"{', convention ' + ', '.join(conventions) if conventions else ''}{check}")
    floats = {c: "{:.4f}" for c in frame.columns if frame[c].dtype.kind == "f"}
    for c in floats:
        if c.startswith(("median", "q1", "q3", "wilcoxon_w", "perplexity", "seconds")) or c == "active":
            floats[c] = "{:.4g}"
        elif c.startswith(("chance_", "wilcoxon_p", "sign_p")) or c == "max_abs_error":
            floats[c] = "{:.2e}"
    print_table(frame, floats=floats)
    if args.out is not None:
        if not writes_directory:
            _write(frame, Path(args.out))
        print(f"wrote {args.out}")
    if args.plot is not None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        ax = experiment.load_plot()(frame)
        ax.figure.tight_layout()
        ax.figure.savefig(args.plot, dpi=120)
        plt.close(ax.figure)
        print(f"wrote {args.plot}")
    return 0
