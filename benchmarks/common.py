"""Shared helpers for the benchmark scripts: machine description, timing, peak memory, corpus batches."""

from __future__ import annotations

import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def machine() -> str:
    import torch

    cpu = platform.processor() or "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return (f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__} ({torch.get_num_threads()} threads), "
            f"{gpu}, Python {platform.python_version()}")


def peak_rss_mb() -> float:
    """Peak resident memory of this process so far (MB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_isolated(script: str, *args: str) -> dict:
    """Run ``python script args`` in a fresh process (clean peak RSS); it prints one JSON line last."""
    out = subprocess.run([sys.executable, str(HERE / script), *args], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def token_batches(model, n_tokens: int, *, window: int = 256, batch_size: int = 8, corpus: str = "pydoc"):
    """Real-text input ids [batch, window + 1] (BOS first), enough for n_tokens scored tokens."""
    import torch

    from kvmem.corpus import open_corpus
    from kvmem.plan import StreamPosition, TokenPlan, iterate_batches

    plan = TokenPlan(window=window, bos_token_id=model.bos_token_id)
    rows, total = [], 0
    stream = iterate_batches(open_corpus(corpus), model.tokenizer, plan, StreamPosition())
    for item in (w for batch in stream for w in batch.windows):
        if len(item.tokens) < window:
            continue
        rows.append([model.bos_token_id, *item.tokens])
        total += window
        if total >= n_tokens:
            break
    return [torch.tensor(rows[i:i + batch_size]) for i in range(0, len(rows), batch_size)]


class Timer:
    def __enter__(self):
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.start


def tiny_llama_dir(root: Path, *, positions: int = 128, init: float = 0.02) -> Path:
    """A 2-layer gated Llama (SwiGLU) with the real GPT-2 tokenizer and RMSNorm gains drawn from [0.5, 1.5];
    ``positions``: its context; ``init``: the standard deviation of its weights at initialisation."""
    path = root / ("tiny-llama" if (positions, init) == (128, 0.02) else f"tiny-llama-n{positions}-i{init:g}")
    if path.exists():
        return path
    import torch
    from transformers import GPT2TokenizerFast, LlamaConfig, LlamaForCausalLM

    from kvmem.builtin import gpt2_tokenizer_dir

    tokenizer = GPT2TokenizerFast.from_pretrained(gpt2_tokenizer_dir())
    config = LlamaConfig(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, hidden_size=64, intermediate_size=96,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=positions, initializer_range=init)
    torch.manual_seed(1)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def gpt2_standin_dir(root: Path, *, n_layer: int, n_embd: int, n_head: int, n_positions: int, like_embd: int) -> Path:
    """A small random-init GPT-2 whose FFN pre-activations have the spread of one of width ``like_embd``:
    at initialisation the FFN reads a LayerNorm output (unit variance per component) through weights of
    standard deviation r, so its pre-activations have standard deviation r·sqrt(d); r = 0.02 ·
    sqrt(like_embd / n_embd) gives GPT-2's 0.02·sqrt(like_embd) (0.55 for GPT-2 small), and with it
    as many coefficients near GELU's floor (about -0.17) as the full-size model has."""
    init = 0.02 * (like_embd / n_embd) ** 0.5
    path = root / f"gpt2-standin-L{n_layer}-d{n_embd}-like{like_embd}"
    if path.exists():
        return path
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, GPT2TokenizerFast

    from kvmem.builtin import gpt2_tokenizer_dir

    tokenizer = GPT2TokenizerFast.from_pretrained(gpt2_tokenizer_dir())
    config = GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_positions=n_positions,
                        vocab_size=len(tokenizer), initializer_range=init)
    torch.manual_seed(0)
    GPT2LMHeadModel(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
