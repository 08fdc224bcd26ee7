"""Check kvmem on a CUDA machine in one unattended run (a few minutes) and print one table.

What it checks:

1. tiny GPT-2 (plain GELU FFN) and tiny Llama (SwiGLU) atlases scanned on CUDA against the same
   scans on the CPU, float32, 2,000 tokens of ``pydoc``:
   - statistics (mean, std, min, max) within rtol 1e-4 (atol 1e-5);
   - histogram counts: at most 0.1% of all counts in another bin (values on a bin edge may flip);
   - triggers: the top-1 position of every (layer, neuron, kind) agrees for at least 99% of them
     (GPU and CPU kernels round differently, so near-ties may swap), and kept activations agree
     within 1e-4 where the positions agree;
   - value projections: the same top token for at least 99.9% of (layer, neuron, convention) rows;
2. ``smollm2-135m``: the whole ``kvmem.scan`` against the bare forward (with logits) over the same
   batches, in float32 and bfloat16, 100,000 tokens, batch 32;
3. peak GPU memory of each scan (``torch.cuda.max_memory_allocated``).

Without a CUDA device it says so in one line and exits 0. ``--device cpu`` is a dry run: the CPU
stands in for the GPU, running the GPU's code path (torch ops, not the compiled CPU kernels), so
every step runs (the test suite runs it to keep the script working).

    python benchmarks/gpu_check.py [--tokens 100000] [--skip-smollm2] [--device cuda|cpu]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


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


def tiny_llama_dir(root: Path) -> Path:
    from transformers import GPT2TokenizerFast, LlamaConfig, LlamaForCausalLM

    from kvmem.builtin import gpt2_tokenizer_dir

    tokenizer = GPT2TokenizerFast.from_pretrained(gpt2_tokenizer_dir())
    config = LlamaConfig(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, hidden_size=64, intermediate_size=96,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=128)
    torch.manual_seed(1)
    model = LlamaForCausalLM(config)
    path = root / "tiny-llama"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def compare(cpu, gpu) -> dict:
    """Agreement figures of two atlases of the same scan."""
    a, b = cpu.neurons, gpu.neurons
    stats_ok = all(np.allclose(a[c], b[c], rtol=1e-4, atol=1e-5, equal_nan=True) for c in ("mean", "std", "min", "max"))
    ha = np.stack(cpu.table("histograms").counts.to_numpy())
    hb = np.stack(gpu.table("histograms").counts.to_numpy())
    moved = np.abs(ha - hb).sum() / 2 / max(ha.sum(), 1)
    ta, tb = cpu.table("triggers"), gpu.table("triggers")
    key = ["layer", "neuron", "kind"]
    first_a = ta[ta["rank"] == 0].set_index(key)
    first_b = tb[tb["rank"] == 0].set_index(key)
    joined = first_a.merge(first_b, left_index=True, right_index=True, suffixes=("", "_gpu"))
    same = (joined.doc == joined.doc_gpu) & (joined.pos == joined.pos_gpu)
    act_ok = np.allclose(joined.activation[same], joined.activation_gpu[same], rtol=1e-4, atol=1e-5)
    va, vb = cpu.table("values"), gpu.table("values")
    va, vb = (v[(v["rank"] == 0) & (v.kind == "promote")].set_index(["layer", "neuron", "convention"]) for v in (va, vb))
    top_same = (va.token_id == vb.token_id.reindex(va.index)).mean()
    return {"stats": stats_ok, "hist_moved": moved, "top1_same": float(same.mean()), "acts": act_ok,
            "value_top_same": float(top_same),
            "ok": stats_ok and moved <= 1e-3 and same.mean() >= 0.99 and act_ok and top_same >= 0.999}


def reset_peak(device: str) -> None:
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()


def peak_gib(device: str) -> str:
    return f"{torch.cuda.max_memory_allocated() / 2**30:.2f}" if device == "cuda" else "-"


def whole_scan_ratio(model, tokens: int, batch_size: int, out: Path) -> dict:
    from whole_scan import bare_forward

    import kvmem

    kvmem.scan(model, "pydoc", out=out / "warm-up", max_tokens=min(tokens, 5000), batch_size=batch_size,
               progress=False)  # fills the projection cache and the kernels' caches
    bare = bare_forward(model, "pydoc", tokens, batch_size=batch_size)
    device = str(model.device).split(":")[0]
    reset_peak(device)
    started = time.perf_counter()
    atlas = kvmem.scan(model, "pydoc", out=out / "scan", overwrite=True, max_tokens=tokens, batch_size=batch_size,
                       progress=False)
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    return {"bare_s": bare, "scan_s": seconds, "ratio": bare / seconds, "peak_gb": peak_gib(device),
            "phases": atlas.manifest.timing["phases"]}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=100_000)
    parser.add_argument("--skip-smollm2", action="store_true")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                        help="cpu: a dry run, the CPU standing in for the GPU")
    args = parser.parse_args()
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; nothing to check (run it on a machine with an NVIDIA GPU)")
        return 0

    from common import machine

    import kvmem
    from kvmem.builtin import gpt2_random_dir

    rows = []
    root = Path(tempfile.mkdtemp(prefix="kvmem-gpu-check-"))
    settings = dict(max_tokens=2000, top_k=8, window=64, top_n=5, progress=False)
    for name, source in (("tiny GPT-2", gpt2_random_dir(n_layer=2, n_embd=64, n_head=4, n_positions=128)),
                         ("tiny Llama", tiny_llama_dir(root))):
        cpu = kvmem.scan(kvmem.load_model(source, device="cpu"), "pydoc", out=root / f"{name}-reference", **settings)
        reset_peak(device)
        with torch_path(device == "cpu"):  # a dry run checks the GPU's code path (torch ops) on the CPU
            gpu = kvmem.scan(kvmem.load_model(source, device=device), "pydoc", out=root / f"{name}-checked", **settings)
        result = compare(cpu, gpu)
        rows.append((f"{name} {device.upper()} vs CPU", "ok" if result["ok"] else "FAIL",
                     f"stats {'ok' if result['stats'] else 'differ'}, histogram moved {result['hist_moved']:.2e}, "
                     f"top-1 trigger same {result['top1_same']:.2%}, value top token same {result['value_top_same']:.2%}",
                     peak_gib(device)))
    if not args.skip_smollm2:
        for dtype in ("float32", "bfloat16"):
            model = kvmem.load_model("smollm2-135m", device=device, dtype=dtype)
            r = whole_scan_ratio(model, args.tokens, 32, root / dtype)
            phases = ", ".join(f"{k} {v:.1f}" for k, v in r["phases"].items())
            rows.append((f"smollm2-135m {dtype}, {args.tokens:,} tok", f"{r['ratio']:.2f}",
                         f"whole scan {r['scan_s']:.1f} s vs bare forward {r['bare_s']:.1f} s ({phases})",
                         r["peak_gb"]))
            del model
            if device == "cuda":
                torch.cuda.empty_cache()
    print(f"\nkvmem {kvmem.__version__} on {machine()}\n")
    print("| check | result (ratio: bare / whole scan) | details | peak GPU GiB |")
    print("|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    return 0 if all(r[1] != "FAIL" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
