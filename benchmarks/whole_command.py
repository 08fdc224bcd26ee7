"""All of what a user waits for: the ``kvmem scan`` command from the shell against a bare command.

- command: ``python -m kvmem scan --model M --corpus C --max-tokens N --out ... --overwrite --quiet``,
  from Python's start to the process's end (imports, model load, scan, writing the atlas, exit);
- bare: a fresh Python that imports torch and transformers, loads the same model directory with
  ``AutoModelForCausalLM`` (HF's own attention implementation, no TransformerLens) and runs its forward
  *with logits* over exactly the batches the scan reads, then exits the usual way, as a user's own
  script would. The batches' token ids are computed once beforehand (``whole_scan.scan_batches``) and
  read from a file, so the bare command does not even tokenize.

The two alternate, ``--rounds`` times each, every one in a fresh process; medians are reported (the
machine's drift hits both alike). The projection cache and the compiled kernels are assumed warm: run
the command once before (``--warm-up``, on by default, does) or the first round pays for them.

    python benchmarks/whole_command.py --model smollm2-135m --tokens 2000 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import HERE, machine

ROOT = HERE.parent


def bare_main(directory: str, batches: str) -> None:
    """The bare command's body (run with ``--bare`` in a fresh process): no kvmem import."""
    import torch
    from transformers import AutoModelForCausalLM
    from whole_scan import forward_seconds

    forward_seconds(AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval(), torch.load(batches))


def prepare_bare(model_name: str, corpus: str, tokens: int, folder: Path) -> tuple[str, Path]:
    """-> (the model's HF directory, a file holding the scan's batches), computed once in this process."""
    import torch
    from whole_scan import scan_batches

    import kvmem

    model = kvmem.load_model(model_name)
    batches = folder / "batches.pt"
    torch.save(scan_batches(model, corpus, tokens), batches)
    return model.source, batches


def timed(argv: list[str]) -> float:
    started = time.perf_counter()
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        sys.exit(f"{' '.join(argv[:4])} ... failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--corpus", default="pydoc")
    parser.add_argument("--tokens", type=int, default=2_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-warm-up", dest="warm_up", action="store_false",
                        help="do not run the command once first (its first round then fills the caches)")
    parser.add_argument("--bare", nargs=2, metavar=("DIRECTORY", "BATCHES"), help=argparse.SUPPRESS)  # the bare command
    args = parser.parse_args()
    if args.bare:
        bare_main(*args.bare)
        return

    folder = Path(tempfile.mkdtemp(prefix="kvmem-command-"))
    try:  # the atlas (about 300 MB at 2,000 tokens) and the batches go with the folder
        out = folder / "atlas"
        directory, batches = prepare_bare(args.model, args.corpus, args.tokens, folder)
        command = [sys.executable, "-m", "kvmem", "scan", "--model", args.model, "--corpus", args.corpus,
                   "--max-tokens", str(args.tokens), "--out", str(out), "--overwrite", "--quiet"]
        bare = [sys.executable, str(HERE / "whole_command.py"), "--bare", directory, str(batches)]
        if args.warm_up:
            timed(command)
        rounds = {"command": [], "bare": []}
        for _ in range(args.rounds):
            rounds["command"].append(round(timed(command), 2))
            rounds["bare"].append(round(timed(bare), 2))
        phases = json.loads((out / "manifest.json").read_text())["timing"]["phases"]  # the last command's scan
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    command_s, bare_s = statistics.median(rounds["command"]), statistics.median(rounds["bare"])
    result = {"model": args.model, "corpus": args.corpus, "tokens": args.tokens, "rounds": rounds,
              "command_seconds": command_s, "bare_seconds": bare_s, "ratio": round(bare_s / command_s, 3),
              "last_scan_phases": phases, "machine": machine()}
    print(f"{args.model}, {args.tokens:,} tokens: the kvmem scan command {command_s:.1f} s "
          f"(runs {rounds['command']}), a bare load + forward command {bare_s:.1f} s (runs {rounds['bare']}) "
          f"-> bare / command {result['ratio']:.2f}; the last scan's phases {phases}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
