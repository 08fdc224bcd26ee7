"""The streaming pass: corpus -> windows -> batches -> hooks -> per-neuron state -> atlas."""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvmem.corpus import Corpus, Document, Window, open_corpus, windows
from kvmem.errors import KvmemError
from kvmem.models import Model
from kvmem.scanning.accumulator import LayerState, close_open_document, new_layer_state, pack, update
from kvmem.scanning.capture import capture_coefficients
from kvmem.scanning.config import ScanConfig
from kvmem.scanning.histogram import HIST_BINS

__all__ = ["scan", "stream", "ScanState", "resolve_window"]

DEFAULT_WINDOW = 256


@dataclass
class ScanState:
    """Everything a checkpoint holds; enough to continue a scan exactly where it stopped."""

    config: dict
    model: dict
    corpus: dict
    window: int
    layers: list[int]
    layer_states: dict[int, LayerState]
    windows_done: int = 0
    tokens: int = 0
    documents: int = 0
    corpus_digest: str = ""  # chained sha256 over (id, text) of every scanned document
    seconds: float = 0.0
    finished: bool = False
    extra: dict = field(default_factory=dict)

    def save(self, path: Path) -> None:
        data = dict(self.__dict__)
        data["layer_states"] = {layer: state.to_dict() for layer, state in self.layer_states.items()}
        tmp = path.with_suffix(".tmp")
        torch.save(data, tmp)
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: Path) -> ScanState:
        try:
            data = torch.load(path, weights_only=False, map_location="cpu")
        except Exception as error:  # torch raises many types for a damaged file
            raise KvmemError(f"checkpoint {path} is unreadable ({error}); delete it and scan again") from None
        data["layer_states"] = {layer: LayerState.from_dict(s) for layer, s in data["layer_states"].items()}
        return cls(**data)


def resolve_window(model: Model, config: ScanConfig) -> int:
    limit = (model.n_ctx or DEFAULT_WINDOW) - (1 if config.prepend_bos else 0)
    window = config.window or min(DEFAULT_WINDOW, limit)
    if window > limit:
        raise KvmemError(f"window {window} exceeds the model's context ({model.n_ctx} tokens"
                         f"{', one for BOS' if config.prepend_bos else ''}); use --window {limit} or less")
    return window


def _document_digest(document: Document) -> str:
    return hashlib.sha256(document.id.encode() + b"\0" + document.text.encode()).hexdigest()


class _Batches:
    """Windows of the (sharded) corpus in batches, hashing each document as its first window is scored."""

    def __init__(self, corpus: Corpus, model: Model, config: ScanConfig, window: int):
        self.corpus, self.model, self.config, self.window = corpus, model, config, window
        self.digests: dict[int, str] = {}

    def documents(self) -> Iterator[Document]:
        index, count = self.config.shard
        for document in self.corpus:
            if document.index % count == index:
                self.digests[document.index] = _document_digest(document)
                yield document

    def windows(self) -> Iterator[Window]:
        return windows(self.documents(), self.model.encode, self.window)


def scan(model: Model, corpus: Any, *, out: str | os.PathLike | None = None, overwrite: bool = False,
         resume: bool = False, progress: bool = True, unit: str = "document", text_field: str = "text",
         **settings: Any):
    """Scan a corpus into a memory atlas and return it opened (:class:`kvmem.atlas.Atlas`).

    ``corpus``: anything :func:`kvmem.corpus.open_corpus` accepts. ``settings``: the fields of
    :class:`ScanConfig` (layers, top_k, per_document, max_tokens, window, batch_size, ...).
    ``out``: the atlas directory (None: a temporary directory). An existing ``out`` is refused
    unless ``overwrite``; ``resume`` continues from ``out``'s checkpoint (``checkpoint_every``).
    """
    from kvmem.atlas import open_atlas
    from kvmem.scanning.writer import write_atlas

    config = ScanConfig(**settings)
    corpus = open_corpus(corpus, unit=unit, text_field=text_field)
    layers = list(config.layers) if config.layers is not None else list(range(model.n_layers))
    bad = [layer for layer in layers if not 0 <= layer < model.n_layers]
    if bad:
        raise KvmemError(f"layer(s) {bad} out of range; this model has layers 0..{model.n_layers - 1}")
    window = resolve_window(model, config)

    target = Path(out) if out is not None else Path(tempfile.mkdtemp(prefix="kvmem-atlas-")) / "atlas"
    checkpoint = target.with_name(target.name + ".checkpoint")
    if target.exists() and not overwrite:
        raise KvmemError(f"output directory {target} already exists; pass overwrite=True (--overwrite) or another --out")

    fresh = ScanState(config=config.resume_key(), model=model.describe(), corpus=corpus.describe(), window=window,
                      layers=layers, layer_states={})
    if resume:
        if not (checkpoint / "state.pt").exists():
            raise KvmemError(f"nothing to resume: no checkpoint at {checkpoint}; scan without --resume")
        state = ScanState.load(checkpoint / "state.pt")
        _check_resumable(state, fresh)
    else:
        state = fresh
        state.layer_states = {layer: new_layer_state(model.d_ff, config.top_k, per_document=config.per_document,
                                                     device=model.device) for layer in layers}

    _stream(model, corpus, config, state, checkpoint, progress)
    if state.tokens == 0:
        raise KvmemError(f"corpus {corpus.spec!r} gave no tokens to scan (empty, or every document empty"
                         f"{' in this shard' if config.shard[1] > 1 else ''}); check the corpus")
    for layer_state in state.layer_states.values():
        close_open_document(layer_state)
    write_atlas(target, model, corpus, config, state, overwrite=overwrite, progress=progress)
    if checkpoint.exists():
        shutil.rmtree(checkpoint, ignore_errors=True)
    return open_atlas(target)


def stream(model: Model, corpus: Any, *, progress: bool = False, unit: str = "document", text_field: str = "text",
           **settings: Any) -> ScanState:
    """The streaming pass alone (no text, projections or files): the per-layer state of a scan.

    Same settings as :func:`scan`; used by benchmarks and by code that wants the raw tensors.
    """
    config = ScanConfig(**settings)
    corpus = open_corpus(corpus, unit=unit, text_field=text_field)
    layers = list(config.layers) if config.layers is not None else list(range(model.n_layers))
    state = ScanState(config=config.resume_key(), model=model.describe(), corpus=corpus.describe(),
                      window=resolve_window(model, config), layers=layers,
                      layer_states={layer: new_layer_state(model.d_ff, config.top_k, per_document=config.per_document,
                                                           device=model.device) for layer in layers})
    _stream(model, corpus, config, state, Path(tempfile.gettempdir()) / "kvmem-unused.checkpoint", progress)
    return state


def _check_resumable(saved: ScanState, fresh: ScanState) -> None:
    differ = [key for key in sorted(set(saved.config) | set(fresh.config)) if saved.config.get(key) != fresh.config.get(key)]
    if saved.model["fingerprint"] != fresh.model["fingerprint"]:
        differ.append("model")
    if saved.corpus != fresh.corpus:
        differ.append("corpus")
    if saved.window != fresh.window:
        differ.append("window")
    if differ:
        raise KvmemError(f"cannot resume: these settings differ from the checkpoint's: {', '.join(differ)}; "
                         f"rerun with the original settings or start over without --resume")


def _stream(model: Model, corpus: Corpus, config: ScanConfig, state: ScanState, checkpoint: Path, progress: bool) -> None:
    source = _Batches(corpus, model, config, state.window)
    bos = model.bos_token_id if config.prepend_bos else None
    if config.prepend_bos and bos is None:
        raise KvmemError(f"the tokenizer of {model.name} has no BOS token; scan with prepend_bos=False (--no-bos)")
    offset = 1 if bos is not None else 0
    neuron_offsets = torch.arange(model.d_ff, dtype=torch.int32, device=model.device) * HIST_BINS
    bar = _progress_bar(progress, total=config.max_tokens, initial=state.tokens)
    next_checkpoint = state.tokens + config.checkpoint_every if config.checkpoint_every else None
    started = time.perf_counter() - state.seconds

    batch: list[Window] = []
    skip = state.windows_done
    for item in source.windows():
        digest = source.digests.pop(item.doc, None) if item.start == 0 else None
        if skip:  # already scanned before the checkpoint
            skip -= 1
            continue
        if digest is not None:
            state.corpus_digest = hashlib.sha256((state.corpus_digest + digest).encode()).hexdigest()
            state.documents += 1
        if config.max_tokens is not None:
            room = config.max_tokens - state.tokens - sum(len(w.tokens) for w in batch)
            if room <= 0:
                break
            if len(item.tokens) > room:
                item = Window(item.doc, item.start, item.tokens[:room])
        batch.append(item)
        if len(batch) == config.batch_size:
            _run_batch(model, batch, state, offset, bos, neuron_offsets)
            bar.update(sum(len(w.tokens) for w in batch))
            batch = []
            if next_checkpoint is not None and state.tokens >= next_checkpoint:
                state.seconds = time.perf_counter() - started
                checkpoint.mkdir(parents=True, exist_ok=True)
                state.save(checkpoint / "state.pt")
                next_checkpoint = state.tokens + config.checkpoint_every
    if batch:
        _run_batch(model, batch, state, offset, bos, neuron_offsets)
        bar.update(sum(len(w.tokens) for w in batch))
    bar.close()
    state.seconds = time.perf_counter() - started
    state.finished = True


def _run_batch(model: Model, batch: list[Window], state: ScanState, offset: int, bos: int | None,
               neuron_offsets: torch.Tensor) -> None:
    """One forward over a batch of windows, right-padded; only real tokens are scored."""
    width = max(len(w.tokens) for w in batch) + offset
    ids = torch.zeros((len(batch), width), dtype=torch.int64)  # [batch, pos]; padding id 0 is never scored
    valid = torch.zeros((len(batch), width), dtype=torch.bool)
    docs = torch.zeros((len(batch), width), dtype=torch.int64)
    positions = torch.zeros((len(batch), width), dtype=torch.int64)
    for row, item in enumerate(batch):
        n = len(item.tokens)
        if bos is not None:
            ids[row, 0] = bos
        ids[row, offset:offset + n] = torch.tensor(item.tokens)
        valid[row, offset:offset + n] = True
        docs[row, offset:offset + n] = item.doc
        positions[row, offset:offset + n] = torch.arange(item.start, item.start + n)
    flat = valid.view(-1).nonzero().squeeze(1).to(model.device)  # [N] scored positions, in reading order
    codes = pack(docs, positions).view(-1).to(model.device)[flat]  # [N]
    doc_of = docs.view(-1).to(model.device)[flat]  # [N], non-decreasing

    def on_coefficients(layer: int, coefficients: torch.Tensor) -> None:
        acts = coefficients.reshape(-1, coefficients.shape[-1]).index_select(0, flat)  # [N, d_ff]
        update(state.layer_states[layer], acts, codes, doc_of, neuron_offsets)

    capture_coefficients(model, ids, state.layers, on_coefficients)
    state.tokens += int(flat.numel())
    state.windows_done += len(batch)


class _NullBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def _progress_bar(enabled: bool, *, total: int | None, initial: int):
    if not enabled:
        return _NullBar()
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, unit="tok", unit_scale=True, desc="scan", smoothing=0.1)
