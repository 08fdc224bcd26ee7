"""``kvmem anatomy MODEL``: per-layer parameter table of a loaded model beside the formula."""

from __future__ import annotations

import argparse

from kvmem.cli.printing import print_table
from kvmem.loading import load_model


def add_arguments(parser: argparse.ArgumentParser, command: str) -> None:
    parser.add_argument("model", help="built-in name (smollm2-135m, gpt2-random), local HF directory or hub id")
    parser.add_argument("--revision", default=None, help="hub revision (branch, tag or commit)")


def run(args: argparse.Namespace) -> int:
    model = load_model(args.model, revision=args.revision, device="cpu")
    table = model.anatomy()
    print(model)
    print(f"fingerprint: {model.fingerprint}")
    print_table(table, floats={"ffn_share": "{:.3f}"})
    total_ffn = int(table.ffn_params.sum())
    total_attention = int(table.attention_params.sum())
    print(f"total: FFN {total_ffn:,} params, attention {total_attention:,}, "
          f"FFN share {total_ffn / (total_ffn + total_attention):.3f}; "
          f"formula matches every layer: {bool((table.ffn_params == table.ffn_formula).all())}")
    return 0
