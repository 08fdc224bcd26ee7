"""Geva et al. (2021), faithfully: every measurement with the released code's settings, into a results directory.

What "faithful" means here (FIELD.md, "How Geva et al. measured, in their released code"):

- one trigger per sentence (``kind="top_doc"`` when the atlas is per-document), top-25 kept;
- next-token ranks pooled over every kept trigger of a neuron, and given for the top-1 trigger;
- the ``raw`` projection (the output embedding, no final norm) beside ``final_norm``;
- section 5 as released: the top token of residual + FFN output against every memory's top token;
- signed FFNs read as two memories per neuron (top triggers with +v, bottom triggers with -v), each
  side reported apart; ReLU/GELU models keep the positive side;
- nulls that keep token frequencies (exact within-layer permutation expectation, shuffled-value
  ranks with a paired test), bootstrap intervals on every per-layer figure, and 1/|V| only as a
  reference;
- the model's perplexity and next-token accuracy on the scanned text, per BOS choice, beside them.

The results directory (:mod:`kvmem.experiments.results`) holds one parquet + json per frame; the
notebook ``notebooks/geva2021.ipynb`` draws every figure from it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import pandas as pd

from kvmem.experiments.argument_checks import conventions_for
from kvmem.experiments.atlas_inputs import as_atlas, model_for_atlas
from kvmem.experiments.results import save_results

if TYPE_CHECKING:
    from kvmem.atlas import Atlas
    from kvmem.models import Model

__all__ = ["RESULT_NAMES", "reproduce_geva2021"]

RESULT_NAMES = {
    "lm_quality": "perplexity and next-token accuracy per BOS choice (kvmem.experiments.lm_quality)",
    "agreement": "per convention, side and layer (kvmem.experiments.agreement)",
    "next_token_rank": "per convention, side and layer: pooled and top-1 medians, paired test (summarize_ranks)",
    "next_token_ranks": "one row per (convention, side, neuron, trigger) (next_token_ranks)",
    "token_removal": "per side and layer (summarize_token_removal)",
    "token_removal_samples": "one row per sampled (side, neuron, trigger) (token_removal_samples)",
    "active_memories": "per layer (active_memories)",
    "layer_vs_memories": "per convention and layer (layer_vs_memories)",
    "timings": "seconds per step",
}


def reproduce_geva2021(atlas: Atlas | str | os.PathLike, model: Model | str | None = None, *,
                       out: str | os.PathLike, corpus: Any = None, convention: str | Sequence[str] | None = None,
                       sides: str | Sequence[str] | None = None, kind: str | None = None, neurons_per_layer: int = 10,
                       triggers: int = 3, positions: int = 400, bos: Sequence[Any] | str = ("default",),
                       quality_tokens: int | None = 50_000,
                       layers: Sequence[int] | None = None, n_boot: int = 1000, seed: int = 0,
                       overwrite: bool = False, progress: bool = False) -> pd.DataFrame:
    """Run every Geva et al. measurement on ``atlas`` and save the frames into the directory ``out``.

    ``model``: the atlas's own when None (fingerprint checked). ``kind``: None takes ``top_doc`` when the
    atlas is per-document (one trigger per sentence, as Geva et al.), else ``top``. ``convention``: None
    reports both ``raw`` and ``final_norm``. ``sides``: None reads signed FFNs as two memories per neuron.
    ``neurons_per_layer`` × ``triggers``: the token-removal sample; ``positions``: the random positions of
    section 5. ``bos``: the BOS choices whose perplexity is reported (e.g. ``("default", "<|endoftext|>")``),
    on the first ``quality_tokens`` scanned tokens (None: all of them; one forward per BOS choice each).
    Returns the index of what was written (result, rows, seconds); :func:`load_results` reads it back.
    """
    from kvmem import experiments as E

    atlas = as_atlas(atlas)
    model = model_for_atlas(atlas, model)
    if kind is None:
        kind = "top_doc" if atlas.manifest.scan.get("per_document") else "top"
    conventions = conventions_for(convention)
    frames: dict[str, pd.DataFrame] = {}
    seconds: dict[str, float] = {}

    def step(name: str, compute) -> None:
        started = time.perf_counter()
        if progress:
            print(f"geva2021: {name} ...", flush=True)
        frames[name] = compute()
        seconds[name] = time.perf_counter() - started

    step("lm_quality", lambda: E.lm_quality(model, corpus, atlas=atlas, bos=bos, max_tokens=quality_tokens,
                                            n_boot=n_boot, seed=seed))
    step("agreement", lambda: E.agreement(atlas, model=model, convention=conventions, sides=sides, kind=kind,
                                          layers=layers, n_boot=n_boot, seed=seed))
    step("next_token_ranks", lambda: E.next_token_ranks(atlas, model, convention=conventions, sides=sides, kind=kind,
                                                        layers=layers, seed=seed))
    step("next_token_rank", lambda: E.summarize_ranks(frames["next_token_ranks"], n_boot=n_boot, seed=seed))
    step("token_removal_samples", lambda: E.token_removal_samples(
        atlas, model, corpus, neurons_per_layer=neurons_per_layer, triggers=triggers, kind=kind, sides=sides,
        layers=layers, seed=seed))
    step("token_removal", lambda: E.summarize_token_removal(frames["token_removal_samples"], n_boot=n_boot, seed=seed))
    step("active_memories", lambda: E.active_memories(model, corpus, atlas=atlas, positions=positions, layers=layers,
                                                      n_boot=n_boot, seed=seed))

    def layer_vs() -> pd.DataFrame:
        parts = []
        for name in conventions:
            part = E.layer_vs_memories(model, corpus, atlas=atlas, positions=positions, convention=name, layers=layers,
                                       sides=sides, n_boot=n_boot, seed=seed)
            part.insert(0, "convention", name)
            parts.append(part)
        frame = pd.concat(parts, ignore_index=True)
        frame.attrs = {**parts[0].attrs, "conventions": conventions}
        return frame

    step("layer_vs_memories", layer_vs)
    frames["timings"] = pd.DataFrame({"step": list(seconds), "seconds": list(seconds.values())})
    frames["timings"].attrs = {"experiment": "timings"}
    settings = {"atlas": str(atlas.path), "model": model.name, "fingerprint": model.fingerprint, "kind": kind,
                "conventions": conventions, "sides": None if sides is None else list(sides),
                "neurons_per_layer": neurons_per_layer, "triggers": triggers, "positions": positions,
                "bos": [str(b) for b in ([bos] if isinstance(bos, str) else bos)], "quality_tokens": quality_tokens,
                "n_boot": n_boot, "seed": seed,
                "layers": None if layers is None else list(layers)}
    save_results(frames, out, overwrite=overwrite, extra={"experiment": "geva2021", "settings": settings,
                                                          "descriptions": RESULT_NAMES})
    index = pd.DataFrame({"result": list(frames), "rows": [len(f) for f in frames.values()],
                          "seconds": [seconds.get(name, 0.0) for name in frames]})
    index.attrs = {"experiment": "geva2021", "out": str(out), "settings": settings}
    return index
