"""Independent oracles for the scan's tests: plain HF forwards with a torch pre-hook on the down
projection (W2), the window rule of ``kvmem.plan`` re-derived by hand, the documented histogram bins
from their edges, and the sampling keys (splitmix64) in plain Python integers.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class Window:
    """One window as the model read it: document ``doc``, positions ``start..start+len(ids)-1``."""

    doc: int
    start: int
    ids: list[int]
    coefficients: dict[int, np.ndarray]  # layer -> [len(ids), d_ff], the input of the down projection


def windows(model, docs: list[str], *, window: int, bos: bool = True) -> list[Window]:
    """Every window of ``docs`` under kvmem's rule (each document tokenized alone without special tokens,
    window k = ids[k*W:(k+1)*W], the model reads [BOS] + window), with its coefficients captured by a
    forward pre-hook on each layer's HF down projection (c_proj / down_proj), unwrapped from the bridge."""
    spec = model.spec
    captured: dict[int, torch.Tensor] = {}
    handles = []
    for layer in range(model.n_layers):
        module = model.hf_model.get_submodule(f"{spec.layers}.{layer}.{spec.mlp}.{spec.value}")
        module = getattr(module, "original_component", module)
        handles.append(module.register_forward_pre_hook(
            lambda mod, args, layer=layer: captured.__setitem__(layer, args[0].detach().clone())))
    out = []
    try:
        with torch.no_grad():
            for doc, text in enumerate(docs):
                ids = model.tokenizer(text, add_special_tokens=False)["input_ids"]
                for start in range(0, len(ids), window):
                    chunk = ids[start:start + window]
                    model.hf_model(torch.tensor([([model.bos_token_id] if bos else []) + chunk]))
                    offset = 1 if bos else 0
                    out.append(Window(doc, start, chunk, {layer: captured[layer][0, offset:].float().numpy()
                                                          for layer in range(model.n_layers)}))
    finally:
        for handle in handles:
            handle.remove()
    return out


def positions(model, docs: list[str], *, window: int, bos: bool = True, skip: int = 1):
    """-> (codes [T] int64 ``doc << 32 | pos`` in reading order, {layer: m [T, d_ff]}) of the scored positions:
    every window's tokens but its first ``skip`` (a scan's default skips the first token of each window)."""
    read = windows(model, docs, window=window, bos=bos)
    codes = np.array([(w.doc << 32) | (w.start + j) for w in read for j in range(skip, len(w.ids))], np.int64)
    return codes, {layer: np.concatenate([w.coefficients[layer][skip:] for w in read]) for layer in range(model.n_layers)}


def histogram_bins(values: np.ndarray, edges: list[float]) -> np.ndarray:
    """Bin of each value from the documented edges: [e_b, e_b+1) on the non-negative side,
    (e_b, e_b+1] on the negative side (-0.0 counts as negative)."""
    edges = np.asarray(edges, np.float64)
    values = np.asarray(values, np.float32).astype(np.float64)
    right = np.searchsorted(edges, values, side="right") - 1
    left = np.searchsorted(edges, values, side="left") - 1
    return np.where(np.signbit(values), left, right)


_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def sampling_key(code: int, seed: int) -> int:
    """splitmix64 of (code, seed), top 53 bits: the key ``kvmem.scanning.ordering`` documents."""
    x = (code ^ (seed * _GOLDEN)) & _MASK
    x = (x + _GOLDEN) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    x ^= x >> 31
    return x >> 11
