"""What every experiment shares: atlas access, provenance, the model an atlas was made with, value tops.

Shapes use kvmem's vocabulary: ``layer``, ``d_model``, ``d_ff``, ``vocab``, ``batch``, ``pos``.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from kvmem import __version__, loading
from kvmem.conventions import CONVENTIONS, get_convention
from kvmem.corpus import open_corpus
from kvmem.errors import KvmemError
from kvmem.models import Model
from kvmem.scanned import FingerprintWarning, check_model, load_scanned_model, scanned_corpus
from kvmem.tracing import project

if TYPE_CHECKING:

    from kvmem.atlas import Atlas
    from kvmem.corpus import Corpus

__all__ = [
    "SIDES",
    "FingerprintWarning",
    "as_atlas",
    "atlas_layers",
    "check_convention",
    "check_fingerprint",
    "check_positive",
    "check_seed",
    "conventions_for",
    "memory_sides",
    "model_for_atlas",
    "provenance",
    "read_columns",
    "resolve_corpus",
    "finish_percent_axes",
    "single_cycle",
    "trigger_kind",
    "value_top_tokens",
]



def check_positive(name: str, value: Any, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise KvmemError(f"{name} must be an integer >= 1, got {value!r}")


def single_cycle(n: int, rng: np.random.Generator) -> np.ndarray:
    """A random permutation sigma of range(n) with a single cycle, so sigma[i] != i for every i when n > 1."""
    order = rng.permutation(n)
    sigma = np.empty(n, np.int64)
    sigma[order] = np.roll(order, -1)
    return sigma


def check_seed(seed: Any) -> None:
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise KvmemError(f"seed must be an integer >= 0, got {seed!r}")


def check_convention(convention: str, atlas: Atlas | None = None) -> None:
    if convention not in CONVENTIONS:
        get_convention(convention)  # the registry's one-line error naming the allowed conventions
    if atlas is not None and convention not in atlas.conventions:
        raise KvmemError(f"convention {convention!r} is not in atlas {atlas.path}; it has "
                         f"{', '.join(atlas.conventions)}: pick one of those or rescan with --conventions {convention}")


def conventions_for(convention: str | Sequence[str] | None, atlas: Atlas | None = None) -> list[str]:
    """The projection conventions to report: one name, several, or None for every known one (``raw`` first,
    Geva et al.'s reading). Each is checked (:func:`check_convention`); the one place that resolves them."""
    names = list(CONVENTIONS) if convention is None else [convention] if isinstance(convention, str) else list(convention)
    if not names:
        raise KvmemError(f"no projection convention given; choose from {', '.join(CONVENTIONS)}")
    for name in names:
        check_convention(name, atlas)
    return list(dict.fromkeys(names))


# side -> (trigger kind prefix, value kind, sign): a signed neuron is two memories (Geva et al. 2022 read m_i v_i)
SIDES = {
    "positive": ("top", "promote", 1),  # the top triggers (largest m_i) with +v: the value's promoted tokens
    "negative": ("bottom", "suppress", -1),  # the bottom triggers (most negative m_i) with -v: its suppressed tokens
}


def memory_sides(gated: bool, sides: str | Sequence[str] | None = None) -> tuple[str, ...]:
    """The memories a neuron is read as: ``("positive",)`` for ReLU/GELU FFNs (the paper's reading), both sides
    for signed (gated SwiGLU/GeGLU) ones. ``sides`` overrides the default (a name or several)."""
    if sides is None:
        return ("positive", "negative") if gated else ("positive",)
    chosen = (sides,) if isinstance(sides, str) else tuple(dict.fromkeys(sides))
    unknown = [s for s in chosen if s not in SIDES]
    if unknown or not chosen:
        raise KvmemError(f"unknown memory side(s) {unknown or '(none)'}; choose from {', '.join(SIDES)}")
    return chosen


def trigger_kind(side: str, kind: str) -> str:
    """The atlas trigger kind of a memory side: ``kind`` is ``top`` (top-k positions) or ``top_doc`` (one per
    document); the negative side reads the matching ``bottom`` / ``bottom_doc`` triggers."""
    if kind not in ("top", "top_doc"):
        raise KvmemError(f"kind must be 'top' or 'top_doc' (the negative side reads bottom / bottom_doc), got {kind!r}")
    return SIDES[side][0] + kind.removeprefix("top")


def as_atlas(atlas: Atlas | str | os.PathLike) -> Atlas:
    """An :class:`~kvmem.atlas.Atlas`, opening a directory path if given one."""
    from kvmem.atlas import Atlas

    return atlas if isinstance(atlas, Atlas) else Atlas(atlas)


def read_columns(atlas: Atlas, table: str, columns: list[str], filters: list | None = None) -> pd.DataFrame:
    """A few columns of an atlas table (through :meth:`Atlas.table`), rows kept where every filter holds.

    ``filters``: (column, op, value) triples, op one of ``=``, ``<``, ``<=``, ``>``, ``>=``, ``in``.
    """
    ops = {"=": np.equal, "<": np.less, "<=": np.less_equal, ">": np.greater, ">=": np.greater_equal}
    filters = list(filters or [])
    frame = atlas.table(table, sorted(set(columns) | {f[0] for f in filters}))
    keep = np.ones(len(frame), bool)
    for column, op, value in filters:
        data = frame[column].to_numpy()
        keep &= np.isin(data, list(value)) if op == "in" else ops[op](data, value)
    return frame.loc[keep, list(columns)].reset_index(drop=True)


def atlas_layers(atlas: Atlas, layers: Any = None) -> list[int]:
    """The requested layers (None: all the atlas holds), each checked against the atlas."""
    if layers is None:
        return atlas.layers
    chosen = sorted({int(layer) for layer in layers})
    missing = [layer for layer in chosen if layer not in atlas.layers]
    if missing or not chosen:
        raise KvmemError(f"layer(s) {missing or '(none)'} not in atlas {atlas.path}; it holds layers "
                         f"{atlas.layers[0]}..{atlas.layers[-1]}")
    return chosen


def check_fingerprint(atlas: Atlas, model: Model) -> bool:
    """True when ``model`` has the weights the atlas was scanned with; warns (FingerprintWarning) when not:
    the experiments' side of the one fingerprint policy (:func:`kvmem.scanned.check_model`)."""
    return check_model(atlas, model, on_mismatch="warn", stacklevel=3)


def model_for_atlas(atlas: Atlas | str | os.PathLike, model: Model | str | os.PathLike | None = None, *,
                    device: Any = None) -> Model:
    """The model to pair with an atlas: ``model`` if given (a Model or a name / path to load), else the atlas's own
    (:func:`kvmem.scanned.load_scanned_model`: name, dtype and hub revision from the manifest).

    The fingerprint is checked (:func:`check_fingerprint`) either way.
    """

    atlas = as_atlas(atlas)
    if model is None:
        return load_scanned_model(atlas, device=device, on_mismatch="warn")
    if not isinstance(model, Model):
        model = loading.load_model(model, device=device)
    check_fingerprint(atlas, model)
    return model


def resolve_corpus(atlas: Atlas | None, corpus: Any, unit: str) -> Corpus:
    """The text an experiment reads: the atlas's corpus (``corpus`` overrides where the manifest's cannot
    be reopened), else ``corpus`` opened with ``unit``."""

    if atlas is not None:
        return scanned_corpus(atlas, corpus)
    if corpus is None:
        raise KvmemError("pass a corpus (a built-in name, a path, a list of strings, ...) or an atlas to take it from")
    return open_corpus(corpus, unit=unit)


def finish_percent_axes(ax, *, ylabel: str, title: str):
    """The shared look of the per-layer percentage plots: 0-100 %, labels, a small legend."""
    ax.set_ylim(0, 100)
    ax.set_xlabel("layer")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize="small")
    return ax


def provenance(experiment: str, *, model: Model | None = None, atlas: Atlas | None = None, corpus: Any = None,
               convention: str | None = None, settings: dict | None = None) -> dict:
    """Everything that identifies a result, for ``frame.attrs`` (JSON-serialisable)."""

    out: dict[str, Any] = {"experiment": experiment}
    if model is not None:
        out.update(model=model.name, fingerprint=model.fingerprint, dtype=str(model.dtype).removeprefix("torch."),
                   gated=model.gated, vocab_size=model.vocab_size)
    if atlas is not None:
        m = atlas.manifest
        out.setdefault("model", m.model["name"])
        out.setdefault("fingerprint", m.model["fingerprint"])
        out.setdefault("gated", m.model.get("gated"))
        out.setdefault("vocab_size", m.model.get("vocab_size"))
        out.update(atlas=str(atlas.path), atlas_fingerprint=m.model["fingerprint"], corpus=m.corpus["spec"],
                   corpus_unit=m.corpus.get("unit"), atlas_tokens=m.tokens, tokenization={
                       k: v for k, v in m.tokenization.items() if k != "rule"}, atlas_top_k=m.scan["top_k"])
        if model is not None:
            out["fingerprint_match"] = model.fingerprint == m.model["fingerprint"]
    elif corpus is not None:
        out["corpus"] = corpus.spec if hasattr(corpus, "spec") else str(corpus)
        out["corpus_unit"] = getattr(corpus, "unit", None)
    if convention is not None:
        out.update(convention=convention, convention_formula=CONVENTIONS[convention].formula)
    out["settings"] = dict(settings or {})
    out["kvmem_version"] = __version__
    return out


# model -> {(layer, convention): (argmax [d_ff], argmin [d_ff])}: the vocabulary pass is the slow part
_VALUE_TOPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # atlas -> its values' rank-0 rows
_TOPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def value_top_tokens(model: Model | None, layer: int, convention: str, *, atlas: Atlas | None = None,
                     block: int = 256) -> tuple[np.ndarray, np.ndarray]:
    """Per neuron of ``layer``: the token its value promotes most and the one it suppresses most.

    Returns (top [d_ff], bottom [d_ff]) int64 token ids, argmax and argmin of the value's vocabulary
    scores under ``convention``. Read from the atlas's values table (rank 0) when ``atlas`` holds it, the
    layer and the convention; otherwise computed from the model in blocks of ``block`` neurons.
    """
    if atlas is not None and layer in atlas.layers and convention in atlas.conventions and atlas.holds("values"):
        if atlas not in _VALUE_TOPS:  # the values table's rank-0 rows, read once per atlas
            _VALUE_TOPS[atlas] = read_columns(atlas, "values", ["layer", "convention", "neuron", "kind", "token_id"],
                                              [("rank", "=", 0)])
        frame = _VALUE_TOPS[atlas]
        frame = frame[(frame.layer.to_numpy() == layer) & (frame.convention.to_numpy() == convention)]
        d_ff = atlas.d_ff
        out = []
        for kind in ("promote", "suppress"):
            part = frame[frame.kind == kind]
            ids = np.full(d_ff, -1, np.int64)
            ids[part.neuron.to_numpy()] = part.token_id.to_numpy()
            out.append(ids)
        return out[0], out[1]
    if model is None and atlas is not None and layer in atlas.layers and convention in atlas.conventions:
        model = atlas.projections.model  # the scanned model (fingerprint checked), or a one-line error
    if model is None:
        raise KvmemError(f"layer {layer} / convention {convention!r} is not in the atlas; pass the model to compute it")
    cache = _TOPS.setdefault(model, {})
    if (layer, convention) not in cache:
        import torch

        values = model.written_values(layer)  # [d_ff, d_model] what each neuron writes into the residual
        tops, bottoms = [], []
        with torch.inference_mode():
            for start in range(0, values.shape[0], block):
                scores = project(model, values[start:start + block], convention=convention)  # [block, vocab]
                tops.append(scores.argmax(dim=1))
                bottoms.append(scores.argmin(dim=1))
        cache[(layer, convention)] = (torch.cat(tops).cpu().numpy(), torch.cat(bottoms).cpu().numpy())
    return cache[(layer, convention)]
