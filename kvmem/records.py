"""Activation records: a kept trigger or sample with this neuron's coefficient on every token of its context.

A record is what explanation tools read (OpenAI's automated-interpretability ``ActivationRecord``:
``tokens`` and ``activations``, one per token). Its span is the context stored in the atlas: up to
``context_before`` tokens before the kept position and ``context_after`` after, clipped to the
window the model read.

- Triggers and random samples: the scan stored the context coefficients, so the record comes from
  the atlas alone (no model).
- Bin samples (and the quantile samples drawn from them) store only the sampled token's value: the
  context coefficients are computed on demand with the model (:func:`context_coefficients`). Cost:
  the corpus is re-read (and tokenized, under the manifest's :class:`~kvmem.plan.TokenPlan`) up to
  the last needed document, and the model runs once per distinct window that holds a requested
  position (batched ``batch_size`` windows per forward, stopping after the last needed layer),
  never over the rest of the corpus. The model reads exactly what the scan read (BOS + window), so
  the value at the sampled token equals the stored one to float rounding.

>>> records = activation_records(atlas, atlas.triggers(3, 17, kind="top"))           # doctest: +SKIP
>>> records = activation_records(atlas, atlas.quantile_samples(3, 17)[4], model=model)  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from itertools import takewhile

import numpy as np

from kvmem.atlas_origin import check_model, scanned_corpus
from kvmem.errors import KvmemError
from kvmem.plan import StreamPosition, iterate_batches, window_key

__all__ = ["ActivationRecord", "ContextRequest", "activation_records", "context_coefficients"]


@dataclass(frozen=True, kw_only=True)
class ActivationRecord:
    """One kept position of one neuron, with its context.

    tokens:       [T] the context split into tokens (concatenated they give the stored context)
    activations:  [T] this neuron's coefficient m_i at each of them (signed: negative m_i flips v_i)
    layer, neuron: the neuron
    source:       where it was kept: top | bottom | top_doc | bottom_doc | random | bin
    rank:         its rank among the kept rows of that source (0 first)
    doc, doc_id, pos: the kept token's document (stream index and stable id) and position
    index:        index of the kept token in ``tokens``
    activation:   the coefficient stored in the atlas at the kept token
    computed:     True if ``activations`` were computed on demand with the model
    """

    tokens: tuple[str, ...]
    activations: tuple[float, ...]
    layer: int
    neuron: int
    source: str
    rank: int
    doc: int
    doc_id: str
    pos: int
    index: int
    activation: float
    computed: bool = False


@dataclass(frozen=True, kw_only=True)
class ContextRequest:
    """Coefficients of neuron ``neuron`` of ``layer`` at positions start..start+length-1 of document ``doc``
    (all inside one window); ``doc_id``: the id the atlas stored, checked against the corpus."""

    layer: int
    neuron: int
    doc: int
    start: int
    length: int
    doc_id: str | None = None


def activation_records(atlas, frame, *, model=None, corpus=None, recompute: bool = False) -> list[ActivationRecord]:
    """Records of the rows of ``frame``: a frame of :meth:`Atlas.triggers`, :meth:`Atlas.samples` or one of
    :meth:`Atlas.quantile_samples` (columns layer, neuron, kind, rank, activation, doc, doc_id, pos,
    context_tokens, context_trigger, context_activations).

    Rows whose context coefficients are stored take them from the atlas; the others (bin samples, or
    atlases scanned without context activations) need ``model`` (the scanned one, checked by fingerprint)
    and compute them on demand (see the module docstring for the cost). ``corpus``: the scanned corpus,
    if the manifest's spec cannot reopen it (an in-memory list or dataset). ``recompute``: compute
    every row on demand, stored or not (to check the stored values).
    """
    rows = list(frame.itertuples(index=False))
    stored = [None if recompute or len(_list(r.context_activations)) != len(_list(r.context_tokens))
              or not len(_list(r.context_tokens)) else [float(a) for a in r.context_activations] for r in rows]
    missing = [i for i, values in enumerate(stored) if values is None]
    if missing:
        if model is None:
            raise KvmemError(f"{len(missing)} record(s) have no stored context coefficients (bin or quantile samples, "
                             f"or a scan without context activations); pass model= (--model) to compute them")
        requests = [ContextRequest(layer=int(rows[i].layer), neuron=int(rows[i].neuron), doc=int(rows[i].doc),
                                   start=int(rows[i].pos) - int(rows[i].context_trigger),
                                   length=len(_list(rows[i].context_tokens)), doc_id=str(rows[i].doc_id))
                    for i in missing]
        for i, values in zip(missing, context_coefficients(atlas, model, requests, corpus=corpus)):
            stored[i] = [float(v) for v in values]
    return [ActivationRecord(tokens=tuple(str(t) for t in r.context_tokens), activations=tuple(values),
                             layer=int(r.layer), neuron=int(r.neuron), source=str(r.kind), rank=int(r.rank),
                             doc=int(r.doc), doc_id=str(r.doc_id), pos=int(r.pos), index=int(r.context_trigger),
                             activation=float(r.activation), computed=i in set(missing))
            for i, (r, values) in enumerate(zip(rows, stored))]


def _list(value) -> list:
    return [] if value is None else list(value)


def context_coefficients(atlas, model, requests: Sequence[ContextRequest], *, corpus=None) -> list[np.ndarray]:
    """Coefficients [length] float32 for each request, from the model on exactly the windows the scan read.

    One pass over the corpus up to the last requested document (tokenized under the manifest's plan);
    one forward per batch of ``batch_size`` distinct needed windows, stopped after the last needed layer.
    """
    import torch

    from kvmem.scanning.coefficients import capture_coefficients

    if not requests:
        return []
    check_model(atlas, model)
    plan = replace(atlas.manifest.plan, shard=(0, 1))
    by_window: dict[int, list[int]] = {}
    for i, r in enumerate(requests):
        first = plan.window_start(r.start)
        if r.length < 1 or plan.window_start(r.start + r.length - 1) != first:
            raise KvmemError(f"positions {r.start}..{r.start + r.length - 1} of document {r.doc} are not inside one "
                             f"window of {plan.window} tokens; a record's context never crosses a window")
        by_window.setdefault(window_key(r.doc, first), []).append(i)
    out: list[np.ndarray | None] = [None] * len(requests)
    last_doc = max(r.doc for r in requests)
    layers = sorted({r.layer for r in requests})

    def run(windows) -> None:
        offset = plan.offset
        ids = torch.zeros((len(windows), offset + max(len(w.tokens) for w in windows)), dtype=torch.int64)
        for row, w in enumerate(windows):  # [batch, pos], right-padded as the scan does (padding never read back)
            ids[row, :offset + len(w.tokens)] = torch.tensor(plan.model_input(w.tokens))

        def on_coefficients(layer: int, coefficients) -> None:  # [batch, pos, d_ff]
            for row, w in enumerate(windows):
                for i in by_window[w.key]:
                    r = requests[i]
                    if r.layer != layer:
                        continue
                    if r.doc_id is not None and r.doc_id != w.doc_id:
                        raise KvmemError(f"document {r.doc} of the corpus is {w.doc_id!r}, the atlas says {r.doc_id!r}: "
                                         f"this is not the scanned corpus; pass the one the atlas was scanned from")
                    at = offset + r.start - w.start
                    if r.start + r.length > w.start + len(w.tokens):
                        raise KvmemError(f"document {r.doc} is shorter than the atlas says: this is not the scanned "
                                         f"corpus; pass the one the atlas was scanned from")
                    out[i] = coefficients[row, at:at + r.length, r.neuron].float().cpu().numpy()

        capture_coefficients(model, ids, layers, on_coefficients)

    documents = takewhile(lambda d: d.index <= last_doc, scanned_corpus(atlas, corpus))
    pending = []
    for batch in iterate_batches(documents, model.tokenizer, plan, StreamPosition()):
        pending.extend(w for w in batch.windows if w.key in by_window)
        while len(pending) >= plan.batch_size:
            run(pending[:plan.batch_size])
            pending = pending[plan.batch_size:]
    if pending:
        run(pending)
    lost = [requests[i] for i, values in enumerate(out) if values is None]
    if lost:
        raise KvmemError(f"document {lost[0].doc}, position {lost[0].start} was not found in the corpus (it ended "
                         f"early): this is not the scanned corpus; pass the one the atlas was scanned from")
    return out  # type: ignore[return-value]

