"""Check kvmem on one CUDA GPU in one unattended run (under 8 minutes on one H200) and keep every result.

Random-init models only (nothing to download): GPT-2 small's and medium's architectures with the
real GPT-2 tokenizer, and a tiny gated Llama (SwiGLU, RMSNorm gains away from 1). The steps:

1. agreement: each model scanned on CUDA against the same scan on the CPU, float32, criteria
   :data:`AGREEMENT` (tolerances in :func:`compare`);
2. bf16: GPT-2 small in bfloat16 on CUDA against float32 on CUDA (looser tolerances, :data:`BF16`);
3. per-document: CUDA against CPU with ``per_document=True``, the per-document bests included;
4. two CUDA runs of ``kvmem scan`` (one in a process of its own, one in the check's process, through
   ``kvmem.cli.main``) write byte-identical tables;
5. resume: a ``kvmem scan --checkpoint-every`` on CUDA killed with SIGKILL after its first
   checkpoint, then ``--resume``, writes the tables of the uninterrupted run (every run of steps
   4-6 takes the same checkpoints, which the manifest records);
6. torchrun: ``torchrun --nproc-per-node 1 -m kvmem scan --device cuda`` (nccl, one rank) writes
   the same tables, and NCCL reports its communicator;
7. throughput: GPT-2 small, float32, ``--tokens`` (10M) tokens: the bare HF forward (with logits)
   over the scan's own batches against the whole ``kvmem.scan`` (target: whole / bare tokens/s >= 0.8),
   with the peak GPU memory of each.

Each step's row goes to ``--out``/rows.jsonl (flushed and synced) and ``--out``/table.md as soon as
the step ends, so a crash loses nothing measured; a step that fails records its error and the next
one runs. Exit status 1 if any step failed.

Without a CUDA device it says so in one line and exits 0. ``--device cpu`` is a dry run: the CPU
stands in for the GPU and runs the GPU's code path (the torch streaming ops, not the compiled CPU
kernels), with small stand-in models (GPT-2 small's stand-in: 2 layers, d_model 64; no medium,
whose code is the same) and token counts, so that every step's code runs in CI.

    python benchmarks/gpu_check.py --out DIR [--device cuda|cpu] [--tokens 10000000]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pandas as pd
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import tiny_llama_dir  # noqa: E402  (beside this script)

# CUDA against CPU, float32: |gpu - cpu| <= ATOL + RTOL * |cpu| for statistics, kept activations and scores
RTOL, ATOL = 1e-4, 1e-5
HIST_MOVED = 1e-3  # at most this fraction of histogram counts in another bin (a value on a bin edge may flip)
MIN_TIE_FREE = 0.5  # positions / tokens compared must be at least this fraction of all (else the check is vacuous)
AGREEMENT = ("statistics", "histogram", "trigger positions", "trigger activations", "value top tokens")
# bfloat16 against float32 (8 significant bits): per-neuron std and max within BF16_RTOL for >= BF16_SHARE of neurons
BF16_RTOL, BF16_SHARE = 5e-2, 0.95

SHAPES = {  # name -> gpt2_random_dir arguments; "tiny": the dry run's stand-ins
    "full": {"GPT-2 small": dict(n_layer=12, n_embd=768, n_head=12, n_positions=1024),
             "GPT-2 medium": dict(n_layer=24, n_embd=1024, n_head=16, n_positions=1024)},
    "tiny": {"GPT-2 small": dict(n_layer=2, n_embd=64, n_head=4, n_positions=128)},  # medium: the same code
}


class Criterion(NamedTuple):
    name: str
    measured: str
    limit: str
    ok: bool


@contextlib.contextmanager
def torch_path(switch: bool):
    """With ``switch``, the streaming step runs as torch ops (the path a GPU takes), not the CPU kernels."""
    from kvmem.scanning.backends import ENV

    saved = os.environ.get(ENV)
    if switch:
        os.environ[ENV] = "torch"  # read by select_backend, once per scan
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = saved


def tables(atlas) -> dict[str, pd.DataFrame]:
    """The tables :func:`compare` reads."""
    return {name: atlas.table(name) for name in ("neurons", "histograms", "triggers", "values")}


def _tolerance(values) -> np.ndarray:
    return ATOL + RTOL * np.abs(np.asarray(values, dtype=np.float64))


def _tie_free(frame: pd.DataFrame, key: list[str], column: str) -> pd.Series:
    """Rows (sorted by ``key`` + rank) whose ``column`` is farther than twice the tolerance from both
    neighbours in rank; the last rank is never tie-free (what came after it is not kept)."""
    grouped = frame.groupby(key, sort=False)[column]
    value = frame[column].to_numpy(np.float64)
    before = grouped.shift(1).to_numpy(np.float64)
    after = grouped.shift(-1).to_numpy(np.float64)
    gap = 2 * _tolerance(value)
    free = (np.isnan(before) | (np.abs(value - before) > gap)) & ~np.isnan(after) & (np.abs(value - after) > gap)
    return pd.Series(free, index=frame.index)


def compare(cpu: dict[str, pd.DataFrame], gpu: dict[str, pd.DataFrame],
            kinds: tuple[str, ...] = ("top", "bottom")) -> list[Criterion]:
    """The agreement criteria (:data:`AGREEMENT`, in order) of two scans of one model: ``cpu`` the reference.

    - statistics: the same count per neuron, mean / std / min / max within ATOL + RTOL |cpu|;
    - histogram: at most HIST_MOVED of all counts in another bin;
    - trigger positions: for every kept trigger of ``kinds`` without a near-tie (its activation farther
      than twice the tolerance from the ranks before and after it), the same (doc, pos) at the same
      rank; at least MIN_TIE_FREE of the triggers are tie-free;
    - trigger activations: where the positions agree, activations within ATOL + RTOL |cpu|;
    - value top tokens: the same top promoted token of every (layer, neuron, convention) whose top two
      scores are farther apart than twice the tolerance; at least MIN_TIE_FREE of the rows are tie-free.
    """
    out = []
    a, b = cpu["neurons"].set_index(["layer", "neuron"]), gpu["neurons"].set_index(["layer", "neuron"])
    b = b.reindex(a.index)
    worst = max(float(np.nanmax(np.abs(a[c].to_numpy(np.float64) - b[c].to_numpy(np.float64)) / _tolerance(a[c])))
                for c in ("mean", "std", "min", "max"))
    same_count = bool((a["count"] == b["count"]).all())
    out.append(Criterion("statistics", f"worst {worst:.2f} of tolerance, counts {'equal' if same_count else 'DIFFER'}",
                         f"<= 1 (rtol {RTOL:g}, atol {ATOL:g})", same_count and worst <= 1))

    ha, hb = (np.stack(t["histograms"].sort_values(["layer", "neuron"]).counts.to_numpy()) for t in (cpu, gpu))
    moved = float(np.abs(ha - hb).sum() / 2 / max(ha.sum(), 1))
    out.append(Criterion("histogram", f"{moved:.2e} of counts moved", f"<= {HIST_MOVED:g}", moved <= HIST_MOVED))

    key = ["layer", "neuron", "kind"]
    ta = cpu["triggers"][cpu["triggers"].kind.isin(kinds)].sort_values([*key, "rank"]).reset_index(drop=True)
    tb = gpu["triggers"][gpu["triggers"].kind.isin(kinds)].set_index([*key, "rank"])
    free = _tie_free(ta, key, "activation")
    tb = tb.reindex(pd.MultiIndex.from_frame(ta[[*key, "rank"]]))
    same = (ta.doc.to_numpy() == tb.doc.to_numpy()) & (ta.pos.to_numpy() == tb.pos.to_numpy())
    wrong, share = int((free & ~same).sum()), float(free.mean()) if len(free) else 0.0
    out.append(Criterion("trigger positions", f"{wrong} of {int(free.sum())} tie-free differ ({share:.0%} tie-free)",
                         f"0, >= {MIN_TIE_FREE:.0%} tie-free", wrong == 0 and share >= MIN_TIE_FREE))

    diff = np.abs(ta.activation.to_numpy(np.float64) - tb.activation.to_numpy(np.float64)) / _tolerance(ta.activation)
    worst_act = float(diff[same].max()) if same.any() else float("inf")
    out.append(Criterion("trigger activations", f"worst {worst_act:.2f} of tolerance at {int(same.sum())} agreeing",
                         "<= 1", worst_act <= 1))

    vkey = ["layer", "neuron", "convention"]
    va = cpu["values"][(cpu["values"].kind == "promote") & (cpu["values"]["rank"] <= 1)]
    va = va.sort_values([*vkey, "rank"]).reset_index(drop=True)
    first = va[va["rank"] == 0].reset_index(drop=True)
    second = va[va["rank"] == 1].set_index(vkey).score.reindex(pd.MultiIndex.from_frame(first[vkey]))
    free_v = np.abs(first.score.to_numpy(np.float64) - second.to_numpy(np.float64)) > 2 * _tolerance(first.score)
    vb = gpu["values"][(gpu["values"].kind == "promote") & (gpu["values"]["rank"] == 0)].set_index(vkey)
    token_b = vb.token_id.reindex(pd.MultiIndex.from_frame(first[vkey])).to_numpy()
    wrong_v, share_v = int((free_v & (first.token_id.to_numpy() != token_b)).sum()), float(free_v.mean())
    out.append(Criterion("value top tokens", f"{wrong_v} of {int(free_v.sum())} tie-free differ ({share_v:.0%} tie-free)",
                         f"0, >= {MIN_TIE_FREE:.0%} tie-free", wrong_v == 0 and share_v >= MIN_TIE_FREE))
    return out


def compare_bf16(reference: dict[str, pd.DataFrame], bf16: dict[str, pd.DataFrame]) -> list[Criterion]:
    """bfloat16 against float32: finite statistics, equal counts, std and max within BF16_RTOL for
    at least BF16_SHARE of the neurons, and the top-1 trigger shares reported (not judged)."""
    a, b = (t["neurons"].set_index(["layer", "neuron"]).sort_index() for t in (reference, bf16))
    finite = bool(np.isfinite(b[["mean", "std", "min", "max"]].to_numpy(np.float64)).all())
    out = [Criterion("finite, counts", f"{'finite' if finite else 'NOT FINITE'}, counts "
                     f"{'equal' if (a['count'] == b['count']).all() else 'DIFFER'}", "finite, equal",
                     finite and bool((a["count"] == b["count"]).all()))]
    for column in ("std", "max"):
        rel = np.abs(b[column] - a[column]) / np.maximum(np.abs(a[column]), 1e-6)
        share = float((rel <= BF16_RTOL).mean())
        out.append(Criterion(f"{column} within {BF16_RTOL:g}", f"{share:.1%} of neurons (median {float(rel.median()):.1e})",
                             f">= {BF16_SHARE:.0%}", share >= BF16_SHARE))
    return out


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


class Check:
    """Runs the steps, writing each one's row as soon as it ends."""

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
        began = time.perf_counter()
        if began - self.started > self.budget_s:
            rows = [dict(step=name, result="SKIP", details=f"time budget of {self.budget_s:.0f} s spent", peak_gib="-")]
        else:
            self.reset_peak()
            try:
                rows = function(*args)
            except Exception as error:  # recorded; the next step runs
                last = traceback.format_exception_only(type(error), error)[-1].strip()
                rows = [dict(step=name, result="FAIL", details=f"{last[:400]}", peak_gib=self.peak())]
                traceback.print_exc()
        for row in rows:
            row = {"step": name, **row, "seconds": round(time.perf_counter() - began, 1)}
            self.rows.append(row)
            with open(self.out / "rows.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")
                f.flush()
                os.fsync(f.fileno())
            print(self.markdown_row(row), flush=True)
        self.write_table()

    @staticmethod
    def markdown_row(row: dict) -> str:
        return f"| {row['step']} | {row['result']} | {row['details']} | {row['peak_gib']} | {row['seconds']} |"

    def header(self) -> str:
        return "| step | result | details | peak GPU GiB | s |\n|---|---|---|---|---|"

    def write_table(self) -> None:
        text = self.header() + "\n" + "\n".join(self.markdown_row(r) for r in self.rows) + "\n"
        (self.out / "table.md.tmp").write_text(text)
        os.replace(self.out / "table.md.tmp", self.out / "table.md")


def judged(criteria: list[Criterion]) -> tuple[str, str]:
    return ("ok" if all(c.ok for c in criteria) else "FAIL",
            "; ".join(f"{c.name}: {c.measured} ({c.limit}){'' if c.ok else ' FAIL'}" for c in criteria))


class Steps:
    """The check's steps (each returns its rows)."""

    def __init__(self, check: Check, args, root: Path):
        import kvmem
        from kvmem.builtin import gpt2_random_dir

        self.kvmem, self.check, self.args, self.root = kvmem, check, args, root
        self.device = args.device
        self.dry = self.device == "cpu"
        shapes = SHAPES[args.scale]
        self.sources = {f"{name} ({'L{n_layer} d{n_embd}'.format(**shape)})": gpt2_random_dir(**shape)
                        for name, shape in shapes.items()}
        self.sources["tiny Llama (gated)"] = tiny_llama_dir(root)
        self.small = next(iter(self.sources))
        self.small_dir = self.sources[self.small]
        self.window = 64 if args.scale == "tiny" else 128
        self.agree = dict(max_tokens=args.agree_tokens, top_k=8, window=self.window, top_n=5, batch_size=8,
                          progress=False)
        self.cache: dict[str, object] = {}
        self.models: dict[tuple, object] = {}

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
        with torch_path(self.dry and device == self.device):  # a dry run checks the GPU's code path on the CPU
            atlas = self.kvmem.scan(model, "pydoc", out=self.root / name, overwrite=True,
                                    **{**self.agree, "layers": self.layers(model), **settings})
        return atlas

    def agreement(self) -> list[dict]:
        rows = []
        for label, source in self.sources.items():
            cpu = tables(self.scan(source, f"{label}-cpu", device="cpu"))
            gpu_atlas = self.scan(source, f"{label}-device", device=self.device)
            if label == self.small:
                self.cache["small-float32"] = tables(gpu_atlas)
            result, details = judged(compare(cpu, tables(gpu_atlas)))
            rows.append(dict(result=result, details=f"{label}: {details}", peak_gib=self.check.peak()))
            for key in [k for k in self.models if k[0] == source and label != self.small]:
                del self.models[key]  # keep GPT-2 small for the later steps
            self.check.reset_peak()
        return rows

    def bf16(self) -> list[dict]:
        reference = self.cache.get("small-float32") or tables(self.scan(self.small_dir, "small-float32",
                                                                          device=self.device))
        bf16 = tables(self.scan(self.small_dir, "small-bf16", device=self.device, dtype="bfloat16"))
        result, details = judged(compare_bf16(reference, bf16))
        return [dict(result=result, details=f"{self.small}, bfloat16 against float32 on {self.device}: {details}",
                     peak_gib=self.check.peak())]

    def per_document(self) -> list[dict]:
        cpu = tables(self.scan(self.small_dir, "doc-cpu", device="cpu", per_document=True))
        gpu = tables(self.scan(self.small_dir, "doc-device", device=self.device, per_document=True))
        result, details = judged(compare(cpu, gpu, kinds=("top", "bottom", "top_doc", "bottom_doc")))
        return [dict(result=result, details=f"{self.small}, per_document=True (top_doc, bottom_doc included): {details}",
                     peak_gib=self.check.peak())]

    # the steps that run `kvmem scan` in their own processes
    def cli(self, out: Path, *extra: str) -> list[str]:
        return ["-m", "kvmem", "scan", "--model", str(self.small_dir), "--corpus", str(self.corpus),
                "--device", self.device, "--max-tokens", str(self.args.cli_tokens), "--window", str(self.window),
                "--batch-size", "16", "--top-k", "8", "--top-n", "5", "--block-documents", "1" if self.dry else "16", "--quiet",
                "--checkpoint-every", str(max(1, self.args.cli_tokens // 10)), "--out", str(out), *extra]

    def in_process(self, arguments: list[str]) -> None:
        """``kvmem scan`` in this process (``kvmem.cli.main``): a second run that shares no process with the first."""
        from kvmem.cli import main as kvmem_main

        with torch_path(self.dry), contextlib.redirect_stdout(io.StringIO()):  # its closing lines are not rows
            code = kvmem_main(arguments[2:])
        if code != 0:
            raise RuntimeError(f"kvmem {' '.join(arguments[2:4])} ... exited {code}")

    def env(self) -> dict:
        env = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())}  # the same threads in every process
        if self.dry:
            env["KVMEM_KERNELS"] = "torch"  # the GPU's code path
        return env

    def run(self, command: list[str], **kw) -> subprocess.CompletedProcess:
        done = subprocess.run(command, env=kw.pop("env", self.env()), capture_output=True, text=True, timeout=300, **kw)
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
            if self.dry:  # the dry run saves a process start (most of its time); the GPU run takes a process of its own
                self.in_process(self.cli(self.root / "run-a", "--overwrite"))
            else:
                self.run([sys.executable, *self.cli(self.root / "run-a", "--overwrite")])
        return self.root / "run-a"

    def two_runs(self) -> list[dict]:
        self.reference_run()
        self.in_process(self.cli(self.root / "run-b"))
        differ = same_tables(self.root / "run-a", self.root / "run-b")
        return [dict(result="ok" if not differ else "FAIL", peak_gib="-",
                     details=f"{self.small}, {self.args.cli_tokens:,} tokens, two `kvmem scan --device {self.device}` "
                             f"runs ({'both in this process' if self.dry else 'a process of its own, then in this process'}): {'every table byte-identical' if not differ else 'differ in ' + ', '.join(differ)}")]

    def resume(self) -> list[dict]:
        out = self.root / "resumed"
        checkpoint = out.with_name(out.name + ".checkpoint") / "state.json"
        command = [sys.executable, *self.cli(out)]
        process = subprocess.Popen(command, env=self.env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 300
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
        return [dict(result="ok" if not differ else "FAIL", peak_gib="-",
                     details=f"SIGKILL after the checkpoint at {saved:,} of {self.args.cli_tokens:,} tokens, then "
                             f"--resume: {'tables byte-identical to the uninterrupted run' if not differ else 'differ in ' + ', '.join(differ)}")]

    def torchrun(self) -> list[dict]:
        backend = "gloo" if self.dry else "nccl"
        env = {**self.env(), "NCCL_DEBUG": "INFO"}
        done = self.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
                         *self.cli(self.root / "torchrun")], env=env)
        differ = same_tables(self.reference_run(), self.root / "torchrun")
        nccl = sum("Init COMPLETE" in line for line in (done.stdout + done.stderr).splitlines())
        seen = f", NCCL communicator inits reported: {nccl}" if not self.dry else ""
        return [dict(result="ok" if not differ else "FAIL", peak_gib="-",
                     details=f"torchrun --nproc-per-node 1 ({backend}): "
                             f"{'tables byte-identical to one process' if not differ else 'differ in ' + ', '.join(differ)}{seen}")]

    def throughput(self) -> list[dict]:
        from whole_scan import bare_forward

        corpus = str(write_corpus(self.root / "throughput.jsonl", self.args.tokens))
        model = self.model(self.small_dir, self.device)
        batch = self.args.throughput_batch
        with torch_path(self.dry):
            self.kvmem.scan(model, corpus, out=self.root / "warm-up", overwrite=True, max_tokens=min(self.args.tokens, 20_000),
                            batch_size=batch, progress=False)  # fills the projection cache
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
        return [dict(result=f"{ratio:.2f} ({'meets' if ratio >= 0.8 else 'BELOW'} the 0.8 target)",
                     peak_gib=f"bare {bare_peak}, scan {self.check.peak()}",
                     details=f"{self.small}, float32, {tokens:,} tokens, batch {batch}: bare forward "
                             f"{tokens / bare:,.0f} tok/s ({bare:.1f} s), whole scan {tokens / whole:,.0f} tok/s "
                             f"({whole:.1f} s; {phases}); default scan settings")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Check kvmem on one CUDA GPU (see the module docstring).")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                        help="cpu: a dry run, the CPU standing in for the GPU with small models and token counts")
    parser.add_argument("--out", default=None, help="folder for rows.jsonl and table.md (default: a new temporary folder)")
    parser.add_argument("--tokens", type=int, default=None, help="throughput tokens (default 10,000,000; dry run 1,000)")
    parser.add_argument("--agree-tokens", type=int, default=None, help="tokens of each agreement scan (4,000; dry run 600)")
    parser.add_argument("--cli-tokens", type=int, default=None,
                        help="tokens of the resume / identical / torchrun scans (300,000; dry run 2,000)")
    parser.add_argument("--throughput-batch", type=int, default=None, help="windows per forward (64; dry run 8)")
    parser.add_argument("--scale", choices=["full", "tiny"], default=None,
                        help="full: GPT-2 small and medium shapes (default on cuda); tiny: small stand-ins (dry run)")
    parser.add_argument("--budget-s", type=float, default=300, help="steps starting after this many seconds are skipped")
    parser.add_argument("--only", default=None, help="comma-separated steps to run (default: all)")
    args = parser.parse_args(argv)
    dry = args.device == "cpu"
    for name, full, small in (("tokens", 10_000_000, 1_000), ("agree_tokens", 4_000, 600),
                              ("cli_tokens", 300_000, 2_000), ("throughput_batch", 64, 8)):
        if getattr(args, name) is None:
            setattr(args, name, small if dry else full)
    args.scale = args.scale or ("tiny" if dry else "full")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; nothing to check (run it on a machine with an NVIDIA GPU)")
        return 0

    from common import machine

    import kvmem

    root = Path(tempfile.mkdtemp(prefix="kvmem-gpu-check-"))
    out = Path(args.out) if args.out else root / "result"
    check = Check(out, args.device, args.budget_s)
    print(f"kvmem {kvmem.__version__} on {machine()}; device {args.device}, scale {args.scale}; rows in {out}", flush=True)
    (out / "machine.txt").write_text(f"kvmem {kvmem.__version__} on {machine()}\n")
    print(check.header(), flush=True)
    steps = Steps(check, args, root)
    order = [("agreement", steps.agreement), ("bf16", steps.bf16), ("per-document", steps.per_document),
             ("two runs", steps.two_runs), ("resume after SIGKILL", steps.resume), ("torchrun", steps.torchrun),
             ("throughput", steps.throughput)]
    wanted = set(args.only.split(",")) if args.only else None
    for name, function in order:
        if wanted is None or name in wanted:
            check.step(name, function)
    print(f"total {time.perf_counter() - check.started:.0f} s", flush=True)
    return 1 if any(r["result"] in ("FAIL",) for r in check.rows) else 0


if __name__ == "__main__":
    sys.exit(main())
