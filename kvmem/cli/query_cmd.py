"""``kvmem info``, ``kvmem top`` and ``kvmem neuron``: read an atlas from the shell."""

from __future__ import annotations

import argparse

from kvmem.conventions import CONVENTIONS, DEFAULT_CONVENTION

_CONVENTION_HELP = f"value projection convention (default {DEFAULT_CONVENTION} if the atlas has it)"


def add_arguments(parser: argparse.ArgumentParser, command: str) -> None:
    if command == "info":
        parser.add_argument("atlas", help="atlas directory")
        return
    parser.add_argument("--atlas", required=True, help="atlas directory")
    if command == "top":
        parser.add_argument("--token", required=True, help="one token, e.g. ' Paris' (mind the leading space)")
        parser.add_argument("--by", default="value", choices=["value", "trigger"])
        parser.add_argument("-k", type=int, default=10, help="how many memories")
        parser.add_argument("--convention", default=None, choices=list(CONVENTIONS), help=_CONVENTION_HELP)
        parser.add_argument("--model", default=None, help="tokenize --token with this model's tokenizer")
    else:  # neuron
        parser.add_argument("layer", type=int)
        parser.add_argument("neuron", type=int)
        parser.add_argument("--convention", default=None, choices=list(CONVENTIONS), help=_CONVENTION_HELP)
        parser.add_argument("-n", type=int, default=10, help="rows per section")


def run(args: argparse.Namespace) -> int:
    import kvmem
    from kvmem.cli.output import print_table

    atlas = kvmem.open(args.atlas)
    if args.command == "info":
        m = atlas.manifest
        print(atlas)
        print(f"model: {m.model['name']} ({m.model['fingerprint']}), {m.model['activation']}, "
              f"{'gated' if m.model['gated'] else 'plain'} FFN")
        print(f"corpus: {m.corpus['spec']} ({m.corpus['documents']:,} documents), window {m.tokenization['window']}")
        print(f"conventions: {', '.join(m.projection['conventions'])}; kvmem {m.kvmem_version}")
        summary = atlas.neurons.groupby("layer").agg(mean=("mean", "mean"), max=("max", "max"),
                                                      active=("frac_positive", "mean"), value_norm=("value_norm", "mean"))
        print_table(summary.reset_index(), floats={"active": "{:.1%}"})
        return 0
    if args.command == "top":
        tokenizer = kvmem.load_model(args.model).tokenizer if args.model else None
        token = int(args.token) if args.token.isdigit() else args.token
        frame = atlas.top_neurons(token=token, by=args.by, k=args.k, convention=args.convention, tokenizer=tokenizer)
        if frame.empty:
            print(f"no memory in this atlas lists {args.token!r} ({args.by})")
            return 0
        print_table(frame)
        return 0
    record = atlas.neuron(args.layer, args.neuron, convention=args.convention)
    print(record)
    convention = record.provenance["convention"]
    values = atlas.values(args.layer, args.neuron, convention=convention)
    for kind in ("promote", "suppress"):
        print(f"\nvalue, {'promoted' if kind == 'promote' else 'suppressed'} tokens ({convention}):")
        print_table(values[values.kind == kind][["rank", "token", "score"]].head(args.n))
    for kind in ("top", "bottom"):
        print(f"\n{kind} triggers (the trigger token in [[ ]]):")
        frame = record.triggers[record.triggers.kind == kind].head(args.n)
        for row in frame.itertuples():
            marked = f"{row.context[:row.span_start]}[[{row.context[row.span_start:row.span_end]}]]{row.context[row.span_end:]}"
            print(f"  {row.rank:>3}  {row.activation:9.4f}  {row.doc_id}@{row.pos}  {marked!r} -> {row.next_token!r}")
    _print_explanations(atlas, args.layer, args.neuron)
    return 0


def _print_explanations(atlas, layer: int, neuron: int) -> None:
    from kvmem.autointerp.display import explanation_lines

    lines = explanation_lines(atlas.explanations(layer, neuron), population=atlas.explanations(layer))
    if lines:
        print("\nexplanations (score [95% interval], p under the side's permutation null, on held-out examples):")
        print("\n".join(lines))
