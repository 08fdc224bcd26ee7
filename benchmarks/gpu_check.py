"""Check kvmem on one CUDA GPU in one unattended run (about 5 minutes on one H200 by estimate) and keep every result.

Random-init models only (nothing to download): GPT-2 small's and medium's architectures with the
real GPT-2 tokenizer, and a small gated Llama (SwiGLU, RMSNorm gains away from 1). The steps, in order:

0. models: the random-init models are built (or found in kvmem's cache);
1. throughput: GPT-2 small, float32, ``--tokens`` (6M) tokens, 256 windows of 256 tokens a forward:
   the bare HF forward (with logits)
   over the scan's own batches against the whole ``kvmem.scan`` (target: whole / bare tokens/s >= 0.8),
   with the peak GPU memory of each (first, so that no budget skips it);
2. agreement: each model scanned on CUDA against the same scan on the CPU, float32, window 128, batch
   8, top-k 8, layers first / middle / last, criteria of ``gpu_criteria.py`` (a row per model, each
   written when its model is done);
3. bf16: GPT-2 small in bfloat16 on CUDA against float32 on CUDA (looser tolerances);
4. per-document: CUDA against CPU with ``per_document=True``, the per-document bests included;
5. two CUDA runs of ``kvmem scan`` (one in a process of its own, one in the check's process, through
   ``kvmem.cli.main``) write byte-identical tables;
6. resume: a ``kvmem scan --checkpoint-every`` on CUDA killed with SIGKILL after its first
   checkpoint, then ``--resume``, writes the tables of the uninterrupted run (every run of steps
   5-7 takes the same checkpoints, which the manifest records);
7. torchrun: ``torchrun --nproc-per-node 1 -m kvmem scan --device cuda`` (nccl, one rank) writes
   the same tables, and NCCL reports its communicator.

Each row goes to ``--out``/rows.jsonl (flushed and synced) and ``--out``/table.md as soon as it is
measured, so a crash loses nothing measured; a step that fails records its error and the next one
runs; a step that would start after ``--budget-s`` is skipped. Exit status 1 if any step failed.
On CUDA, float32 products are pinned to float32 (TF32 off, also for every child process through
``NVIDIA_TF32_OVERRIDE=0``), and ``machine.txt`` and the first line say so.

Without a CUDA device it says so in one line and exits 0. ``--device cpu`` lets the CPU stand in
for the GPU, on the GPU's code path (the torch streaming ops, the one path on every device):

- ``--device cpu --scale full``, the rehearsal: every step with the GPU run's models, shapes and
  settings, over a small token budget (:data:`SIZES`); run it before handing the check to a GPU;
- ``--device cpu``, the quick dry run the test suite runs: a 2-layer, d_model 64 stand-in for GPT-2
  small whose FFN pre-activations spread like GPT-2 small's (so GELU's floor ties its bottom triggers
  as it does the full model's; no medium, whose code is the same), and fewer tokens.

    python benchmarks/gpu_check.py --out DIR [--device cuda|cpu] [--scale full|tiny] [--tokens 10000000]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import pandas as pd
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import gpt2_standin_dir, tiny_llama_dir  # noqa: E402  (beside this script)
from gpu_criteria import compare, compare_bf16, judged  # noqa: E402

SHAPES = {  # name -> GPT-2 shape; "tiny": the dry run's stand-in, its pre-activations spread like GPT-2 small's
    "full": {"GPT-2 small": dict(n_layer=12, n_embd=768, n_head=12, n_positions=1024),
             "GPT-2 medium": dict(n_layer=24, n_embd=1024, n_head=16, n_positions=1024)},
    "tiny": {"GPT-2 small": dict(n_layer=2, n_embd=64, n_head=4, n_positions=1024, like_embd=768)},  # medium: the same code
}
LLAMA = dict(positions=1024, init=0.06)  # the gated stand-in: a context past every window, SmolLM2's spread (0.02·sqrt(576/64))


@contextlib.contextmanager
def torch_path(switch: bool):
    """The streaming step's one path (torch ops on any device): nothing to switch; kept so the steps read as before."""
    yield


def tables(atlas) -> dict[str, pd.DataFrame]:
    """The tables :func:`compare` reads."""
    return {name: atlas.table(name) for name in ("neurons", "histograms", "triggers", "values")}


def same_tables(a: Path, b: Path) -> list[str]:
    """Tables whose parquet bytes differ between two atlases ('manifest' if they differ but for timing)."""
    import kvmem.schema

    differ = [t for t in kvmem.schema.TABLES if (a / f"{t}.parquet").read_bytes() != (b / f"{t}.parquet").read_bytes()]
    ma, mb = (json.loads((x / "manifest.json").read_text()) for x in (a, b))
    ma.pop("timing"), mb.pop("timing")
    return differ + (["manifest"] if ma != mb else [])


def write_corpus(path: Path, tokens: int) -> Path:
    """A JSONL corpus of at least ``tokens`` GPT-2 tokens: the running Python's pydoc topics
    (kvmem's built-in ``pydoc``, about 110,000 tokens) cut into documents of about 1,000 characters,
    repeated as often as needed (4 characters a token)."""
    from kvmem.corpus import open_corpus

    texts = [d.text[i:i + 1000] for d in open_corpus("pydoc") for i in range(0, len(d.text), 1000)]
    chars = sum(len(t) for t in texts)
    repeats = max(1, -(-tokens * 4 // chars) + 1)
    with open(path, "w") as f:
        for r in range(repeats):
            for i, text in enumerate(texts):
                f.write(json.dumps({"text": text, "id": f"{r}-{i}"}) + "\n")
    return path


def cpu_seconds() -> float:
    """CPU time of this process and of its finished children (user + system): the work a step did,
    whatever else shared the machine."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


class Check:
    """Runs the steps, writing each row as soon as it is measured."""

    def __init__(self, out: Path, device: str, budget_s: float):
        self.out, self.device, self.budget_s = out, device, budget_s
        self.started = time.perf_counter()
        self.rows: list[dict] = []
        out.mkdir(parents=True, exist_ok=True)
        (out / "rows.jsonl").write_text("")

    def peak(self) -> str:
        return f"{torch.cuda.max_memory_allocated() / 2**30:.2f}" if self.device == "cuda" else "-"

    def reset_peak(self) -> None:
        if self.device == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()

    def step(self, name: str, function, *args) -> None:
        """Run ``function`` (returns or yields its rows); each row is on disk as soon as it is given."""
        self.cpu_began = cpu_seconds()
        began = time.perf_counter()
        if began - self.started > self.budget_s:
            self.write(name, dict(result="SKIP", details=f"time budget of {self.budget_s:.0f} s spent", peak_gib="-"),
                       began)
            return
        self.reset_peak()
        try:
            for row in function(*args):
                self.write(name, row, began)
                began, self.cpu_began = time.perf_counter(), cpu_seconds()
        except Exception as error:  # recorded; the next step runs
            last = traceback.format_exception_only(type(error), error)[-1].strip()
            self.write(name, dict(result="FAIL", details=f"{last[:400]}", peak_gib=self.peak()), began)
            traceback.print_exc()

    def write(self, name: str, row: dict, began: float) -> None:
        row = {"step": name, **row, "seconds": round(time.perf_counter() - began, 1),
               "cpu_seconds": round(cpu_seconds() - self.cpu_began, 1)}
        self.rows.append(row)
        with open(self.out / "rows.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()
            os.fsync(f.fileno())
        print(self.markdown_row(row), flush=True)
        text = self.header() + "\n" + "\n".join(self.markdown_row(r) for r in self.rows) + "\n"
        (self.out / "table.md.tmp").write_text(text)
        os.replace(self.out / "table.md.tmp", self.out / "table.md")

    @staticmethod
    def markdown_row(row: dict) -> str:
        return (f"| {row['step']} | {row['result']} | {row['details']} | {row['peak_gib']} | {row['seconds']} | "
                f"{row.get('cpu_seconds', '-')} |")

    def header(self) -> str:
        return "| step | result | details | peak GPU GiB | s | CPU s |\n|---|---|---|---|---|---|"


class Steps:
    """The check's steps (each yields its rows)."""

    def __init__(self, check: Check, args, root: Path):
        import kvmem

        self.kvmem, self.check, self.args, self.root = kvmem, check, args, root
        self.device = args.device
        self.dry = self.device == "cpu"
        self.full = args.scale == "full"
        self.window = 128
        self.agree = dict(max_tokens=args.agree_tokens, top_k=8, window=self.window, top_n=5, batch_size=8,
                          progress=False, projections="eager")  # the values table is compared too
        self.sources: dict[str, Path] = {}
        self.cache: dict[str, object] = {}
        self.models: dict[tuple, object] = {}

    def build_models(self):
        """The random-init models, built (or found in kvmem's cache) here, inside a step."""
        from kvmem.builtin import gpt2_random_dir

        for name, shape in SHAPES[self.args.scale].items():
            label = f"{name} (L{shape['n_layer']} d{shape['n_embd']})"
            if "like_embd" in shape:
                self.sources[label + f" stand-in, spread of d{shape['like_embd']}"] = gpt2_standin_dir(self.root, **shape)
            else:
                self.sources[label] = gpt2_random_dir(**shape)
        self.sources["tiny Llama (gated)"] = tiny_llama_dir(self.root, **LLAMA)
        self.small = next(iter(self.sources))
        self.small_dir = self.sources[self.small]
        yield dict(result="ok", peak_gib="-", details="; ".join(f"{label}: {path.name}" for label, path in
                                                                  self.sources.items()))

    def model(self, source, device: str, dtype: str = "float32"):
        """Each model loaded once per device and dtype."""
        if (source, device, dtype) not in self.models:
            self.models[source, device, dtype] = self.kvmem.load_model(source, device=device, dtype=dtype)
        return self.models[source, device, dtype]

    def layers(self, model) -> list[int]:
        n = model.n_layers
        return sorted({0, n // 2, n - 1})

    def scan(self, source, name: str, *, device: str, dtype: str = "float32", **settings):
        model = self.model(source, device, dtype)
        with torch_path(self.dry and device == self.device):  # a CPU run checks the GPU's code path on the CPU
            atlas = self.kvmem.scan(model, "pydoc", out=self.root / name, overwrite=True,
                                    **{**self.agree, "layers": self.layers(model), **settings})
        return atlas

    def agreement(self):
        for label, source in self.sources.items():
            cpu = tables(self.scan(source, f"{label}-cpu", device="cpu"))
            device_atlas = self.scan(source, f"{label}-device", device=self.device)
            if label == self.small:
                self.cache["small-float32"] = tables(device_atlas)
            result, details = judged(compare(cpu, tables(device_atlas)))
            yield dict(result=result, details=f"{label}: {details}", peak_gib=self.check.peak())
            for key in [k for k in self.models if k[0] == source and label != self.small]:
                del self.models[key]  # keep GPT-2 small for the later steps
            self.check.reset_peak()

    def bf16(self):
        reference = self.cache.get("small-float32") or tables(self.scan(self.small_dir, "small-float32",
                                                                          device=self.device))
        bf16 = tables(self.scan(self.small_dir, "small-bf16", device=self.device, dtype="bfloat16"))
        result, details = judged(compare_bf16(reference, bf16))
        yield dict(result=result, details=f"{self.small}, bfloat16 against float32 on {self.device}: {details}",
                   peak_gib=self.check.peak())

    def per_document(self):
        cpu = tables(self.scan(self.small_dir, "doc-cpu", device="cpu", per_document=True))
        device = tables(self.scan(self.small_dir, "doc-device", device=self.device, per_document=True))
        result, details = judged(compare(cpu, device, kinds=("top", "bottom", "top_doc", "bottom_doc")))
        yield dict(result=result, details=f"{self.small}, per_document=True (top_doc, bottom_doc included): {details}",
                   peak_gib=self.check.peak())

    # the steps that run `kvmem scan` in their own processes
    def cli(self, out: Path, *extra: str) -> list[str]:
        return ["-m", "kvmem", "scan", "--model", str(self.small_dir), "--corpus", str(self.corpus),
                "--device", self.device, "--max-tokens", str(self.args.cli_tokens), "--window", str(self.window),
                "--batch-size", "16", "--top-k", "8", "--top-n", "5", "--block-documents",
                "16" if self.full else "1", "--quiet", "--projections", "eager",
                "--checkpoint-every", str(max(1, self.args.cli_tokens // 4)), "--out", str(out), *extra]

    def in_process(self, arguments: list[str]) -> None:
        """``kvmem scan`` in this process (``kvmem.cli.main``): a second run that shares no process with the first."""
        from kvmem.cli import main as kvmem_main

        with torch_path(self.dry), contextlib.redirect_stdout(io.StringIO()):  # its closing lines are not rows
            code = kvmem_main(arguments[2:])
        if code != 0:
            raise RuntimeError(f"kvmem {' '.join(arguments[2:4])} ... exited {code}")

    def env(self) -> dict:
        env = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())}  # the same threads in every process
        return env

    @property
    def timeout(self) -> float:
        """Seconds a `kvmem scan` process may take: 300 on the GPU (the command's limit), an hour on a CPU."""
        return 3600 if self.dry else 300

    def run(self, command: list[str], **kw) -> subprocess.CompletedProcess:
        done = subprocess.run(command, env=kw.pop("env", self.env()), capture_output=True, text=True,
                              timeout=self.timeout, **kw)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(command[:4])} ... exited {done.returncode}: {done.stderr.strip()[-300:]}")
        return done

    @property
    def corpus(self) -> Path:
        path = self.root / "cli-corpus.jsonl"
        return path if path.exists() else write_corpus(path, self.args.cli_tokens)

    def reference_run(self) -> Path:
        """The uninterrupted one-process `kvmem scan` the resumed and torchrun scans must equal."""
        if not (self.root / "run-a" / "manifest.json").exists():
            if self.full:
                self.run([sys.executable, *self.cli(self.root / "run-a", "--overwrite")])
            else:  # the quick dry run saves a process start (most of its time)
                self.in_process(self.cli(self.root / "run-a", "--overwrite"))
        return self.root / "run-a"

    def two_runs(self):
        self.reference_run()
        self.in_process(self.cli(self.root / "run-b"))
        differ = same_tables(self.root / "run-a", self.root / "run-b")
        how = "a process of its own, then in this process" if self.full else "both in this process"
        yield dict(result="ok" if not differ else "FAIL", peak_gib="-",
                   details=f"{self.small}, {self.args.cli_tokens:,} tokens, two `kvmem scan --device {self.device}` "
                           f"runs ({how}): {'every table byte-identical' if not differ else 'differ in ' + ', '.join(differ)}")

    def resume(self):
        out = self.root / "resumed"
        checkpoint = out.with_name(out.name + ".checkpoint") / "state.json"
        command = [sys.executable, *self.cli(out)]
        process = subprocess.Popen(command, env=self.env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + self.timeout
        while not checkpoint.exists() and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        with contextlib.suppress(ProcessLookupError):  # it may have ended (a failure, or too few tokens)
            os.kill(process.pid, signal.SIGKILL)
        code = process.wait()
        if code != -signal.SIGKILL or out.exists() or not checkpoint.exists():
            raise RuntimeError(f"the scan was not killed after a checkpoint (exit {code}, atlas written: {out.exists()}, "
                               f"checkpoint: {checkpoint.exists()}): {process.stderr.read().decode()[-300:]}")
        saved = json.loads(checkpoint.read_text())["tokens"]
        self.in_process(self.cli(out, "--resume"))
        differ = same_tables(self.reference_run(), out)
        yield dict(result="ok" if not differ else "FAIL", peak_gib="-",
                   details=f"SIGKILL after the checkpoint at {saved:,} of {self.args.cli_tokens:,} tokens, then "
                           f"--resume: {'tables byte-identical to the uninterrupted run' if not differ else 'differ in ' + ', '.join(differ)}")

    def torchrun(self):
        backend = "gloo" if self.dry else "nccl"
        env = {**self.env(), "NCCL_DEBUG": "INFO"}
        done = self.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
                         *self.cli(self.root / "torchrun")], env=env)
        differ = same_tables(self.reference_run(), self.root / "torchrun")
        nccl = sum("Init COMPLETE" in line for line in (done.stdout + done.stderr).splitlines())
        seen = f", NCCL communicator inits reported: {nccl}" if not self.dry else ""
        yield dict(result="ok" if not differ else "FAIL", peak_gib="-",
                   details=f"torchrun --nproc-per-node 1 ({backend}): "
                           f"{'tables byte-identical to one process' if not differ else 'differ in ' + ', '.join(differ)}{seen}")

    def throughput(self):
        from whole_scan import bare_forward

        corpus = str(write_corpus(self.root / "throughput.jsonl", self.args.tokens))
        model = self.model(self.small_dir, self.device)
        batch = self.args.throughput_batch
        with torch_path(self.dry):
            self.kvmem.scan(model, corpus, out=self.root / "warm-up", overwrite=True,
                            max_tokens=min(self.args.tokens, 20_000), batch_size=batch, progress=False)  # projections
            self.check.reset_peak()
            bare = bare_forward(model, corpus, self.args.tokens, batch_size=batch)
            bare_peak = self.check.peak()
            self.check.reset_peak()
            started = time.perf_counter()
            atlas = self.kvmem.scan(model, corpus, out=self.root / "throughput", overwrite=True,
                                    max_tokens=self.args.tokens, batch_size=batch, progress=False)
            whole = time.perf_counter() - started
        tokens = atlas.manifest.tokens
        ratio = bare / whole
        phases = ", ".join(f"{k} {v:.1f} s" for k, v in atlas.manifest.timing["phases"].items())
        yield dict(result=f"{ratio:.2f} ({'meets' if ratio >= 0.8 else 'BELOW'} the 0.8 target)",
                   peak_gib=f"bare {bare_peak}, scan {self.check.peak()}",
                   details=f"{self.small}, float32, {tokens:,} tokens, batch {batch}: bare forward "
                           f"{tokens / bare:,.0f} tok/s ({bare:.1f} s), whole scan {tokens / whole:,.0f} tok/s "
                           f"({whole:.1f} s; {phases}); default scan settings")


# --tokens, --agree-tokens, --cli-tokens, --throughput-batch per run: the GPU's, the CPU rehearsal's, the dry run's
# (the rehearsal's throughput: two batches of 16 windows, a dense first and a sparse second; 256 windows of
# 256 tokens would hold 13 GB of logits on the CPU)
SIZES = {"gpu": dict(tokens=6_000_000, agree_tokens=4_000, cli_tokens=100_000, throughput_batch=256),
         "rehearsal": dict(tokens=8_192, agree_tokens=1_000, cli_tokens=10_000, throughput_batch=16),
         "dry": dict(tokens=1_000, agree_tokens=600, cli_tokens=2_000, throughput_batch=8)}


def float32_settings() -> str:
    """How this process multiplies float32 matrices (TF32 off is pinned on CUDA before any work)."""
    parts = [f"float32 matmul precision {torch.get_float32_matmul_precision()}"]
    if torch.cuda.is_available():
        parts += [f"cuda.matmul.allow_tf32 {torch.backends.cuda.matmul.allow_tf32}",
                  f"cudnn.allow_tf32 {torch.backends.cudnn.allow_tf32}"]
    parts.append(f"NVIDIA_TF32_OVERRIDE={os.environ.get('NVIDIA_TF32_OVERRIDE', 'unset')}")
    return ", ".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Check kvmem on one CUDA GPU (see the module docstring).")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                        help="cpu: the CPU stands in for the GPU (the quick dry run, or with --scale full the rehearsal)")
    parser.add_argument("--out", default=None, help="folder for rows.jsonl and table.md (default: a new temporary folder)")
    parser.add_argument("--tokens", type=int, default=None, help="throughput tokens (GPU 6,000,000)")
    parser.add_argument("--agree-tokens", type=int, default=None, help="tokens of each agreement scan (GPU 4,000)")
    parser.add_argument("--cli-tokens", type=int, default=None,
                        help="tokens of the resume / identical / torchrun scans (GPU 100,000)")
    parser.add_argument("--throughput-batch", type=int, default=None, help="windows per forward (GPU 256)")
    parser.add_argument("--scale", choices=["full", "tiny"], default=None,
                        help="full: GPT-2 small and medium shapes (default on cuda; on cpu the rehearsal); "
                             "tiny: a small stand-in (the default dry run on cpu)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="steps starting after this many seconds are skipped (default on cuda 420: a device "
                             "command may run 600 s; none on cpu)")
    parser.add_argument("--only", default=None, help="comma-separated steps to run (default: all; models always)")
    args = parser.parse_args(argv)
    args.scale = args.scale or ("tiny" if args.device == "cpu" else "full")
    if args.budget_s is None:
        args.budget_s = 420 if args.device == "cuda" else float("inf")
    sizes = SIZES["gpu" if args.device == "cuda" else "rehearsal" if args.scale == "full" else "dry"]
    for name, value in sizes.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; nothing to check (run it on a machine with an NVIDIA GPU)")
        return 0
    if args.device == "cuda":  # CUDA against CPU at 1e-4: float32 products in float32, here and in every child
        os.environ["NVIDIA_TF32_OVERRIDE"] = "0"
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.set_float32_matmul_precision("highest")

    from common import machine

    import kvmem

    root = Path(tempfile.mkdtemp(prefix="kvmem-gpu-check-"))
    out = Path(args.out) if args.out else root / "result"
    check = Check(out, args.device, args.budget_s)
    about = (f"kvmem {kvmem.__version__} on {machine()}; device {args.device}, scale {args.scale}; "
             f"{float32_settings()}; rows in {out}")
    print(about, flush=True)
    (out / "machine.txt").write_text(about + "\n")
    print(check.header(), flush=True)
    steps = Steps(check, args, root)
    order = [("models", steps.build_models), ("throughput", steps.throughput), ("agreement", steps.agreement),
             ("bf16", steps.bf16), ("per-document", steps.per_document), ("two runs", steps.two_runs),
             ("resume after SIGKILL", steps.resume), ("torchrun", steps.torchrun)]
    wanted = set(args.only.split(",")) | {"models"} if args.only else None
    for name, function in order:
        if wanted is None or name in wanted:
            check.step(name, function)
    print(f"total {time.perf_counter() - check.started:.0f} s", flush=True)
    if args.out:  # the models, corpora and atlases the steps wrote (GBs at full scale); the rows are in --out
        shutil.rmtree(root, ignore_errors=True)
    return 1 if any(r["result"] in ("FAIL",) for r in check.rows) else 0


if __name__ == "__main__":
    sys.exit(main())
