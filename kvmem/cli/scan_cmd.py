"""``kvmem scan``, ``kvmem merge`` and ``kvmem project`` (an atlas's projection tables)."""

from __future__ import annotations

import argparse

import kvmem
from kvmem.cli.options import add_layers_option, parse_layers
from kvmem.conventions import CONVENTIONS
from kvmem.devices import device_help
from kvmem.plan import BATCH_SIZE_HELP
from kvmem.scanning import distributed
from kvmem.scanning.config import PROJECTIONS, ScanConfig, parse_shard
from kvmem.scanning.statistics import OPTIONAL


def add_arguments(parser: argparse.ArgumentParser, command: str) -> None:
    if command == "merge":
        parser.add_argument("atlases", nargs="+", help="shard atlas directories")
        parser.add_argument("--out", required=True, help="merged atlas directory")
        parser.add_argument("--overwrite", action="store_true", help="replace an existing --out")
        parser.add_argument("--quiet", action="store_true", help="no progress bars")
        return
    if command == "project":
        parser.add_argument("--atlas", required=True, help="the atlas to write the values and keys tables into")
        parser.add_argument("--model", default=None, help="the scanned model (default: the one the manifest names)")
        parser.add_argument("--device", default=None, help=device_help())
        parser.add_argument("--quiet", action="store_true", help="no progress bar")
        return
    parser.add_argument("--model", required=True,
                        help="a built-in (smollm2-135m, gpt2-random), a local HF directory or a hub id")
    parser.add_argument("--corpus", required=True, help="pydoc, stdlib-docs, a file or directory, or hf:NAME[:CONFIG][:SPLIT]")
    parser.add_argument("--out", required=True, help="atlas directory to write")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    parser.add_argument("--resume", action="store_true", help="continue from --out's checkpoint")
    add_layers_option(parser, "layers to scan (default: all)")
    parser.add_argument("--top-k", type=int, default=25)
    parser.add_argument("--per-document", action="store_true", help="also keep the best position of each document")
    parser.add_argument("--max-tokens", type=int, default=None, help="stop after this many tokens read")
    parser.add_argument("--window", type=int, default=None, help="tokens per window (default min(context, 256))")
    parser.add_argument("--batch-size", default="8", help=BATCH_SIZE_HELP)
    parser.add_argument("--no-bos", action="store_true", help="do not prepend the BOS token to windows")
    parser.add_argument("--skip-first", type=int, default=1, metavar="N",
                        help="tokens at the start of every window read but not scored (default 1: the first token "
                             "after BOS has no left context, and position artefacts such as massive activations "
                             "sit there; 0 scores every token)")
    parser.add_argument("--unit", default="document", choices=["document", "paragraph", "line", "sentence"])
    parser.add_argument("--text-field", default="text", help="JSONL field / parquet column holding the text")
    parser.add_argument("--top-n", type=int, default=20, help="tokens kept per value / key projection")
    parser.add_argument("--random-samples", type=int, default=None,
                        help="positions in each layer's uniform random sample, where the explanation scores find "
                             "their non-activating examples (default 100; 0 = none; docs/explanations.md)")
    parser.add_argument("--conventions", default=",".join(CONVENTIONS),
                        help=f"comma-separated value projection conventions (default: all, {','.join(CONVENTIONS)})")
    parser.add_argument("--no-key-projections", action="store_true",
                        help="skip projecting keys through the input embedding (saves vocabulary passes)")
    parser.add_argument("--projections", default="lazy", choices=list(PROJECTIONS),
                        help="lazy (default): no value/key projection tables; a neuron's are computed from the model "
                             "on demand, 'kvmem project' writes them all; eager: the scan writes them")
    parser.add_argument("--statistics", default="", metavar="NAME[,NAME]",
                        help=f"optional statistics to keep besides the default ones ({', '.join(OPTIONAL)})")
    parser.add_argument("--no-context-activations", action="store_true",
                        help="do not store each kept trigger's coefficients on its context tokens (they come from "
                             "the same forward; skipping them saves memory and atlas space)")
    parser.add_argument("--no-taxonomy-sums", action="store_true",
                        help="do not keep the neuron taxonomy's streaming sums (position correlation, gate/up "
                             "quadrant counts and each trigger's gate/up, unigram counts; docs/taxonomy.md)")
    parser.add_argument("--shard", default="0/1",
                        help="scan part i of N (blocks of --block-documents documents, block %% N == i); "
                             "then 'kvmem merge' the N atlases")
    parser.add_argument("--block-documents", type=int, default=None,
                        help="documents per block, the unit shards and torchrun ranks share out "
                             "(default 64; 2048 for paragraph, line and sentence units)")
    parser.add_argument("--no-length-sort", action="store_true",
                        help="read each block's windows in corpus order, not sorted by length (more padding)")
    parser.add_argument("--checkpoint-every", type=int, default=None, help="tokens between checkpoints")
    parser.add_argument("--device", default=None, help=device_help())
    parser.add_argument("--dtype", default=None, help="float32 (default), bfloat16, float16")
    parser.add_argument("--dist-timeout", type=float, default=None, metavar="SECONDS",
                        help="under torchrun: how long a rank waits for the others (default 7200, or "
                             "$KVMEM_DIST_TIMEOUT); ranks wait for the slowest one and for rank 0's atlas write")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    if args.command == "merge":
        atlas = kvmem.merge(args.atlases, out=args.out, overwrite=args.overwrite, progress=not args.quiet)
        print(atlas)
        print(closing_line(atlas.manifest).replace("scanned", "merged", 1))
        return 0
    if args.command == "project":
        atlas = kvmem.open(args.atlas)
        model = None
        if args.model is not None or args.device is not None:
            from kvmem.atlas_origin import load_scanned_model

            model = (kvmem.load_model(args.model, device=args.device) if args.model is not None
                     else load_scanned_model(atlas, device=args.device))
        done = atlas.project(model=model, progress=not args.quiet)
        if not done["written"]:
            print(f"{atlas.path} holds its values and keys tables already")
        else:
            print(f"wrote the values and keys tables of {atlas.path} ({done['method']}"
                  f"{', from the model cache' if done['cached'] else ''}) in {done['seconds']:.1f} s")
        return 0
    settings = dict(
        layers=parse_layers(args.layers), top_k=args.top_k, per_document=args.per_document,
        max_tokens=args.max_tokens, window=args.window, batch_size=args.batch_size, prepend_bos=not args.no_bos,
        skip_first=args.skip_first,
        top_n=args.top_n, conventions=tuple(c.strip() for c in args.conventions.split(",") if c.strip()),
        context_activations=not args.no_context_activations, key_projections=not args.no_key_projections, shard=parse_shard(args.shard),
        checkpoint_every=args.checkpoint_every, block_documents=args.block_documents,
        sort_by_length=not args.no_length_sort, taxonomy_sums=not args.no_taxonomy_sums,
        projections=args.projections,
        statistics=tuple(name.strip() for name in args.statistics.split(",") if name.strip()))
    if args.random_samples is not None:
        settings["random_samples"] = args.random_samples

    ScanConfig(**settings)  # validate before the model loads
    distributed.timeout_seconds(args.dist_timeout)
    model = kvmem.load_model(args.model, device=args.device, dtype=args.dtype)
    distributed.start(model.device, timeout_s=args.dist_timeout)  # under torchrun only
    atlas = kvmem.scan(model, args.corpus, out=args.out, overwrite=args.overwrite, resume=args.resume,
                       progress=not args.quiet, unit=args.unit, text_field=args.text_field, **settings)
    distributed.stop()  # a rank that fails skips this: torchrun then stops the others
    if atlas is None:  # a torchrun rank other than 0: rank 0 wrote the atlas
        return 0
    print(atlas)
    print(closing_line(atlas.manifest))
    return 0


def closing_line(manifest) -> str:
    """'scanned 20,000 tokens in 61.2 s wall (stream 52.1 s, texts 0.4 s, ...)' from a :class:`kvmem.manifest.Manifest`."""
    timing = manifest.timing
    phases = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in timing["phases"].items())
    cached = " (projections from the model's cache)" if timing.get("projections_cached") else ""
    return (f"scanned {manifest.tokens:,} tokens in {timing['total_seconds']:.1f} s wall "
            f"({phases}){cached}")
