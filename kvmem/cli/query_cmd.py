"""``kvmem info``, ``kvmem top`` and ``kvmem neuron``: read an atlas from the shell.

    kvmem info --atlas DIR
    kvmem top --atlas DIR --token " Paris" [--by value|trigger]      (or --token-id 6342)
    kvmem neuron --atlas DIR 20:100 [21:7 ...]
"""

from __future__ import annotations

import argparse

import kvmem
from kvmem.cli.options import add_atlas_option, add_neurons_option, neuron_id, parse_neurons
from kvmem.cli.printing import print_table
from kvmem.conventions import CONVENTIONS, DEFAULT_CONVENTION
from kvmem.schema import KEY_VECTOR_NAMES, KEY_VECTOR_ROWS

_CONVENTION_HELP = f"value projection convention (default {DEFAULT_CONVENTION} if the atlas has it)"


def add_arguments(parser: argparse.ArgumentParser, command: str) -> None:
    add_atlas_option(parser)
    if command == "info":
        return
    if command == "top":
        token = parser.add_mutually_exclusive_group(required=True)
        token.add_argument("--token", help="one token's text, e.g. ' Paris' (mind the leading space)")
        token.add_argument("--token-id", type=int, help="one token id")
        parser.add_argument("--by", default="value", choices=["value", "trigger"],
                            help="value: memories whose value promotes the token; trigger: memories that fire "
                                 "right before it")
        parser.add_argument("-k", type=int, default=10, help="how many memories")
        parser.add_argument("--convention", default=None, choices=list(CONVENTIONS), help=_CONVENTION_HELP)
        parser.add_argument("--model", default=None, help="tokenize --token with this model's tokenizer")
    else:  # neuron
        add_neurons_option(parser, "the neurons to show", positional=True)
        parser.add_argument("--convention", default=None, choices=list(CONVENTIONS), help=_CONVENTION_HELP)
        parser.add_argument("-n", type=int, default=10, help="rows per section")
        parser.add_argument("--model", default=None,
                            help="the scanned model, for projections the atlas does not hold (default: the one the "
                                 "manifest names, loaded when needed)")


def run(args: argparse.Namespace) -> int:
    neurons = parse_neurons(args.neurons) if args.command == "neuron" else None  # checked before the atlas opens
    model = kvmem.load_model(args.model) if args.command == "neuron" and args.model else None
    atlas = kvmem.open(args.atlas, model=model)
    if args.command == "info":
        m = atlas.manifest
        print(atlas)
        print(f"model: {m.model['name']} ({m.model['fingerprint']}), {m.model['activation']}, "
              f"{'gated' if m.model['gated'] else 'plain'} FFN")
        print(f"corpus: {m.corpus['spec']} ({m.corpus['documents']:,} documents), window {m.tokenization['window']}, "
              f"first {m.tokenization.get('skip_first', 0)} token(s) of each window read, not scored")
        print(f"conventions: {', '.join(m.projection['conventions'])}; projection tables: "
              f"{'written' if atlas.has_projections else 'none (computed per neuron on demand; kvmem project writes them)'}"
              f"; kvmem {m.kvmem_version}")
        summary = atlas.neurons.groupby("layer").agg(mean=("mean", "mean"), max=("max", "max"),
                                                      active=("frac_positive", "mean"), value_norm=("value_norm", "mean"))
        print_table(summary.reset_index(), floats={"active": "{:.1%}"})
        return 0
    if args.command == "top":
        tokenizer = kvmem.load_model(args.model).tokenizer if args.model else None
        token = args.token_id if args.token is None else args.token
        frame = atlas.top_neurons(token=token, by=args.by, k=args.k, convention=args.convention, tokenizer=tokenizer)
        if frame.empty:
            print(f"no memory in this atlas lists {token!r} ({args.by})")
            return 0
        frame.insert(0, "id", [neuron_id(layer, n) for layer, n in zip(frame.layer, frame.neuron)])
        print_table(frame)
        return 0
    for layer, neuron in neurons:
        atlas.check(layer, neuron)
    for i, (layer, neuron) in enumerate(neurons):
        if i:
            print("\n" + "=" * 40 + "\n")
        _print_neuron(atlas, layer, neuron, args)
    return 0


def _print_neuron(atlas, layer: int, neuron: int, args: argparse.Namespace) -> None:
    record = atlas.neuron(layer, neuron, convention=args.convention)
    print(record)
    convention = record.provenance["convention"]
    values = atlas.values(layer, neuron, convention=convention)
    for kind in ("promote", "suppress"):
        print(f"\nvalue, {'promoted' if kind == 'promote' else 'suppressed'} tokens ({convention}):")
        print_table(values[values.kind == kind][["rank", "token", "score"]].head(args.n))
    keys = atlas.keys(layer, neuron)
    if keys.empty:
        print("\nkey projections: not in this atlas (scanned with key_projections off)")
    for vector in dict.fromkeys(keys.get("vector", [])):
        part = keys[keys.vector == vector]
        name = f"{KEY_VECTOR_NAMES[vector]} ({KEY_VECTOR_ROWS[vector]})" if vector in KEY_VECTOR_NAMES else vector
        for kind in dict.fromkeys(part.kind):
            print(f"\n{name}, tokens whose input embedding it "
                  f"{'matches' if kind == 'promote' else 'opposes'} most ({kind}):")
            print_table(part[part.kind == kind][["rank", "token", "score"]].head(args.n))
    for kind in ("top", "bottom"):
        print(f"\n{kind} triggers (the trigger token in [[ ]]):")
        frame = record.triggers[record.triggers.kind == kind].head(args.n)
        for row in frame.itertuples():
            marked = f"{row.context[:row.span_start]}[[{row.context[row.span_start:row.span_end]}]]{row.context[row.span_end:]}"
            print(f"  {row.rank:>3}  {row.activation:9.4f}  {row.doc_id}@{row.pos}  {marked!r} -> {row.next_token!r}")
    _print_explanations(atlas, layer, neuron)


def _print_explanations(atlas, layer: int, neuron: int) -> None:
    from kvmem.autointerp.display import explanation_lines

    lines = explanation_lines(atlas.explanations(layer, neuron), population=atlas.explanations(layer))
    if lines:
        print("\nexplanations (score [95% interval], p under the side's permutation null, on held-out examples):")
        print("\n".join(lines))
