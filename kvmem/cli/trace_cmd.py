"""``kvmem trace`` (which memories build a prediction) and ``kvmem generate`` (continuations with edits).

    kvmem trace --model smollm2-135m --top 3 "The capital of France is"
    kvmem generate --model smollm2-135m --set 27:1234=8 --set 28:99=8 "I feel"
"""

from __future__ import annotations

import argparse
import re

from kvmem.cli.printing import print_table
from kvmem.conventions import CONVENTIONS, DEFAULT_CONVENTION
from kvmem.devices import device_help
from kvmem.errors import KvmemError
from kvmem.intervention import greedy_continuation, intervene
from kvmem.loading import load_model
from kvmem.tracing import trace

_SET = re.compile(r"^\s*(\d+)\s*:\s*(\d+)\s*=\s*([^\s]+)\s*$")


def parse_set(text: str) -> tuple[tuple[int, int], float]:
    """``"12:301=3.0"`` -> ((12, 301), 3.0), i.e. ((layer, neuron), value); a one-line KvmemError otherwise."""
    match = _SET.match(text)
    value = None
    if match is not None:
        try:
            value = float(match.group(3))
        except ValueError:
            pass
    if value is None:
        raise KvmemError(f"--set expects LAYER:NEURON=VALUE (e.g. 12:301=3.0), got {text!r}")
    return (int(match.group(1)), int(match.group(2))), value


def add_arguments(parser: argparse.ArgumentParser, command: str) -> None:
    parser.add_argument("--model", required=True,
                        help="built-in name (smollm2-135m, gpt2-random), local HF directory or hub id")
    parser.add_argument("--device", default="cpu", help=device_help("cpu"))
    parser.add_argument("--prepend-bos", action="store_true", help="put the tokenizer's BOS token before the prompt")
    if command == "trace":
        parser.add_argument("--position", type=int, default=-1, help="token position to trace (default -1, the last)")
        parser.add_argument("--top", type=int, default=5, help="sub-updates shown per layer (default 5)")
        parser.add_argument("--convention", default=DEFAULT_CONVENTION, choices=list(CONVENTIONS),
                            help=f"how values are projected to tokens (default {DEFAULT_CONVENTION})")
        parser.add_argument("text", help="the prompt")
    else:
        parser.add_argument("--set", dest="edits", action="append", default=[], metavar="LAYER:NEURON=VALUE",
                            help="edit the coefficient of one neuron (see --mode); repeat for several")
        parser.add_argument("--mode", default="set", choices=["set", "scale", "add"],
                            help="set (m = VALUE), scale (m *= VALUE) or add (m += VALUE); default set")
        parser.add_argument("--position", dest="positions", type=int, action="append", default=None,
                            help="edit only this absolute token position (repeatable; default all)")
        parser.add_argument("--max-new-tokens", type=int, default=20, help="tokens to generate (default 20)")
        parser.add_argument("prompt", help="the prompt")


def run(args: argparse.Namespace) -> int:
    return _run_trace(args) if args.command == "trace" else _run_generate(args)


def _run_trace(args: argparse.Namespace) -> int:
    model = load_model(args.model, device=args.device)
    result = trace(model, args.text, position=args.position, top=args.top, convention=args.convention,
                   prepend_bos=args.prepend_bos)
    a = result.attrs
    print(model)
    print(f"prompt tokens: {a['tokens']}")
    print(f"position {a['position']} ({a['position_token']!r}); final prediction {a['final_token']!r}; "
          f"values projected as {a['convention']}: {a['convention_formula']}")
    layers = result.layers[["layer", "top_before", "top_after", "changed", "final_rank_before", "final_rank_after",
                            "final_prob_after", "ffn_norm"]]
    print_table(layers, floats={"final_prob_after": "{:.3f}", "ffn_norm": "{:.3g}"})
    print()
    print(f"top {args.top} sub-updates per layer, by |m|*||v|| (update_tokens: what m*v promotes)")
    table = result.sub_updates[["layer", "rank", "neuron", "coefficient", "weight", "final_token_logit",
                                "update_tokens"]].copy()
    print_table(table, floats={"coefficient": "{:+.3g}", "weight": "{:.3g}", "final_token_logit": "{:+.3g}"})
    return 0


def _run_generate(args: argparse.Namespace) -> int:
    edits = dict(parse_set(text) for text in args.edits)  # parsed before the model loads: fast errors

    model = load_model(args.model, device=args.device)
    with intervene(model, edits, positions=args.positions, mode=args.mode):  # validates before generating
        pass
    plain = greedy_continuation(model, args.prompt, max_new_tokens=args.max_new_tokens, prepend_bos=args.prepend_bos)
    with intervene(model, edits, positions=args.positions, mode=args.mode):
        edited = greedy_continuation(model, args.prompt, max_new_tokens=args.max_new_tokens,
                                     prepend_bos=args.prepend_bos)
    print(model)
    described = ", ".join(f"L{layer}:{neuron}={value:g}" for (layer, neuron), value in edits.items()) or "none"
    print(f"edits ({args.mode}): {described}; positions: {'all' if args.positions is None else args.positions}")
    print(f"prompt:       {args.prompt!r}")
    print(f"without:      {plain!r}")
    print(f"with edits:   {edited!r}")
    print(f"changed: {plain != edited}")
    return 0
