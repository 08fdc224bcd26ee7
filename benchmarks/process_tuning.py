"""Does process tuning pay for a whole command? The ``kvmem`` command as it is, alternated with the same
command under a launcher that tunes the process the way kvmem's command once did.

The tuning the launcher applies (none of it is in kvmem):
- glibc keeps freed memory for reuse: ``mallopt(M_MMAP_THRESHOLD, 32 MiB)`` and
  ``mallopt(M_TRIM_THRESHOLD, 1 GiB)``, so a forward's temporaries are not faulted in again at every layer;
- the garbage collector freezes what survives each full collection (a callback on ``gc.callbacks``), and
  is paused while a model loads (its half a million objects would otherwise be walked several times);
- the process ends with ``os._exit`` after flushing stdout and stderr, skipping the interpreter's teardown.

Each round runs every command once per variant, each in a fresh process, variants alternated
(A B A B ...), so the machine's drift hits both alike; medians and the peak resident memory of each
process are printed. ``--baseline-source DIR`` adds a third variant: the ``kvmem`` command of another
checkout (``PYTHONPATH=DIR``), such as one that still tunes the process itself.

    python benchmarks/process_tuning.py --tokens 2000,20000 --rounds 3
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import HERE, machine

ROOT = HERE.parent
MMAP_THRESHOLD = 32 << 20  # glibc's largest allowed value
TRIM_THRESHOLD = 1 << 30
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (malloc.h)


def tuned_main(argv: list[str]) -> None:
    """The launcher (``--tuned ARGS``): tune the process, run ``kvmem ARGS``, exit without teardown."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)
        libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    except (OSError, AttributeError):
        pass  # not glibc

    def freeze_after_full_collection(phase: str, info: dict) -> None:
        if phase == "stop" and info["generation"] == 2:
            gc.freeze()

    gc.callbacks.append(freeze_after_full_collection)
    import kvmem.loading

    load_model = kvmem.loading.load_model

    def paused_load(*args, **kwargs):
        gc.disable()
        try:
            return load_model(*args, **kwargs)
        finally:
            gc.freeze()
            gc.enable()

    kvmem.loading.load_model = paused_load
    from kvmem.cli import main

    code = main(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def timed(argv: list[str], env: dict) -> tuple[float, float]:
    """(seconds, peak RSS in MB) of one command in a fresh process."""
    started = time.perf_counter()
    process = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(process.pid, 0)
    seconds = time.perf_counter() - started
    error = process.stderr.read().decode(errors="replace")
    process.stderr.close()
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode != 0:
        sys.exit(f"{' '.join(argv[-8:])} failed ({process.returncode}): {error.strip()[-2000:]}")
    return seconds, usage.ru_maxrss / 1024


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--corpus", default="pydoc")
    parser.add_argument("--tokens", default="2000", help="comma-separated scan sizes, e.g. 2000,20000")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--baseline-source", default=None,
                        help="a kvmem checkout whose own command is a third variant (PYTHONPATH=DIR)")
    parser.add_argument("--tuned", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)  # the launcher
    args = parser.parse_args()
    if args.tuned is not None:
        tuned_main(args.tuned)
        return

    here_env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    variants = {"plain": ([sys.executable, "-m", "kvmem"], here_env),
                "tuned": ([sys.executable, str(HERE / "process_tuning.py"), "--tuned"], here_env)}
    if args.baseline_source:
        source = str(Path(args.baseline_source).resolve())
        variants["baseline"] = ([sys.executable, "-m", "kvmem"],
                                {**os.environ, "PYTHONPATH": os.pathsep.join([source, os.environ.get("PYTHONPATH", "")])})
    folder = Path(tempfile.mkdtemp(prefix="kvmem-tuning-"))
    try:
        atlas = folder / "atlas"
        commands = {f"scan {n:,}": ["scan", "--model", args.model, "--corpus", args.corpus, "--max-tokens", str(n),
                                    "--out", str(atlas), "--overwrite", "--quiet"]
                    for n in map(int, args.tokens.split(","))}
        commands["info"] = ["info", "--atlas", str(atlas)]
        commands["neuron"] = ["neuron", "--atlas", str(atlas), "20", "100"]
        first = next(iter(commands))
        for prefix, env in variants.values():  # warm: the model converted, projections cached, kernels compiled
            timed([*prefix, *commands[first]], env)
        results = {command: {name: [] for name in variants} for command in commands}
        for _ in range(args.rounds):
            for command, words in commands.items():
                for name, (prefix, env) in variants.items():
                    results[command][name].append(timed([*prefix, *words], env))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    summary = {}
    for command, runs in results.items():
        row = {}
        for name, pairs in runs.items():
            seconds = [round(s, 2) for s, _ in pairs]
            row[name] = {"median_s": statistics.median(seconds), "runs_s": seconds,
                         "peak_rss_mb": round(statistics.median(r for _, r in pairs))}
        summary[command] = row
        print(f"{command:>12}: " + "; ".join(f"{name} {v['median_s']:.2f} s (runs {v['runs_s']}, peak RSS "
                                             f"{v['peak_rss_mb']} MB)" for name, v in row.items()))
    print(json.dumps({"model": args.model, "corpus": args.corpus, "rounds": args.rounds, "results": summary,
                      "machine": machine()}))


if __name__ == "__main__":
    main()
