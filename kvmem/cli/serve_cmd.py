"""``kvmem serve``: explore an atlas in the browser (neuron pages, search, traces and edits).

    kvmem serve --atlas atlas                 # http://127.0.0.1:8000/, the manifest's model loads in the background
    kvmem serve --atlas atlas --no-model      # atlas pages only
"""

from __future__ import annotations

import argparse

from kvmem.devices import device_help


def add_arguments(parser: argparse.ArgumentParser, command: str) -> None:
    parser.add_argument("--atlas", required=True, help="atlas directory (kvmem scan --out)")
    parser.add_argument("--model", default=None,
                        help="model for the trace page: built-in name, local HF directory or hub id (default: the one "
                             "the manifest names, fingerprint-checked)")
    parser.add_argument("--no-model", action="store_true", help="serve the atlas pages only; load no model")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default 127.0.0.1, this machine only; anything else warns)")
    parser.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one)")
    parser.add_argument("--device", default="cpu", help=device_help("cpu"))


def run(args: argparse.Namespace) -> int:
    from kvmem.explorer.server import serve

    return serve(args.atlas, host=args.host, port=args.port, model=args.model, device=args.device,
                 load_model=not args.no_model)
