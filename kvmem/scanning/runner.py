"""The scan: one pass over the corpus -> per-neuron state (+ the text it needs) -> atlas.

The pass reads and tokenizes the corpus once. Everything the atlas needs from the corpus
(trigger contexts, each trigger's neuron on its context tokens) is captured while the batch
is in memory; value and key projections depend on the weights alone and are cached per model.

Under ``torchrun`` each rank scans its share of the blocks (:mod:`kvmem.plan`); rank 0 merges
the states with :func:`kvmem.scanning.accumulator.merge_states` and writes the atlas.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvmem.corpus import Corpus, open_corpus
from kvmem.errors import KvmemError
from kvmem.models import Model
from kvmem.plan import DEFAULT_WINDOW, Batch, StreamPosition, TokenPlan, iterate_batches, pack
from kvmem.scanning import distributed, kernels
from kvmem.scanning.accumulator import (
    LayerState,
    close_open_document,
    merge_states,
    new_layer_state,
    update,
    window_context,
)
from kvmem.scanning.capture import capture_coefficients
from kvmem.scanning.checkpoint import load_state, save_state
from kvmem.scanning.config import ScanConfig
from kvmem.scanning.progress import Phases
from kvmem.scanning.sampling import position_keys
from kvmem.scanning.texts import TextStore

__all__ = ["scan", "stream", "ScanState", "resolve_window", "token_plan"]


@dataclass
class ScanState:
    """Everything a process holds during a scan; what a checkpoint stores (as tensors and JSON)."""

    layers: list[int]
    layer_states: dict[int, LayerState]
    texts: TextStore = field(default_factory=TextStore)
    position: StreamPosition = field(default_factory=StreamPosition)
    tokens: int = 0  # scored by this process
    windows: int = 0
    batches: int = 0  # forwards run by this process (resumed runs included)
    seconds: float = 0.0  # streaming seconds so far

    def merge(self, other: ScanState) -> ScanState:
        """The state of one process that had read both (disjoint shares of one stream)."""
        return ScanState(self.layers, {layer: merge_states(self.layer_states[layer], other.layer_states[layer])
                                       for layer in self.layers},
                         TextStore({**self.texts.windows, **other.texts.windows}), self.position,
                         self.tokens + other.tokens, self.windows + other.windows, self.batches + other.batches,
                         max(self.seconds, other.seconds))

    def referenced_windows(self, window: int) -> set[int]:
        codes = [part.codes.reshape(-1) for s in self.layer_states.values()
                 for part in (*s.sides().values(), s.open_top, s.open_bottom, s.random, s.bins) if part is not None]
        codes = torch.unique(torch.cat(codes).cpu())
        codes = codes[codes >= 0]
        docs, pos = codes >> 32, codes & 0xFFFFFFFF
        return set(pack(docs, pos - pos % window).tolist())


def resolve_window(model: Model, config: ScanConfig) -> int:
    limit = (model.n_ctx or DEFAULT_WINDOW) - (1 if config.prepend_bos else 0)
    window = config.window or min(DEFAULT_WINDOW, limit)
    if window > limit:
        raise KvmemError(f"window {window} exceeds the model's context ({model.n_ctx} tokens"
                         f"{', one for BOS' if config.prepend_bos else ''}); use --window {limit} or less")
    return window


def token_plan(model: Model, config: ScanConfig, unit: str = "document") -> TokenPlan:
    """The tokenization plan of a scan of ``model`` under ``config``, over a corpus of ``unit``s."""
    bos = model.bos_token_id if config.prepend_bos else None
    if config.prepend_bos and bos is None:
        raise KvmemError(f"the tokenizer of {model.name} has no BOS token; scan with prepend_bos=False (--no-bos)")
    return TokenPlan(window=resolve_window(model, config), bos_token_id=bos, batch_size=config.batch_size,
                     max_tokens=config.max_tokens, block_documents=config.block_documents_for(unit), shard=config.shard,
                     sort_by_length=config.sort_by_length)


def _check_layers(model: Model, config: ScanConfig) -> list[int]:
    layers = list(config.layers) if config.layers is not None else list(range(model.n_layers))
    bad = [layer for layer in layers if not 0 <= layer < model.n_layers]
    if bad:
        raise KvmemError(f"layer(s) {bad} out of range; this model has layers 0..{model.n_layers - 1}")
    return layers


def _fresh_state(model: Model, config: ScanConfig, layers: list[int]) -> ScanState:
    width = config.context_width if config.context_activations else 0
    return ScanState(layers, {layer: new_layer_state(
        model.d_ff, config.top_k, per_document=config.per_document, context_width=width, device=model.device,
        random_samples=config.random_samples, bin_samples=config.bin_samples, sample_rate=config.sample_rate,
        seed=config.seed) for layer in layers})


def scan(model: Model, corpus: Any, *, out: str | os.PathLike | None = None, overwrite: bool = False,
         resume: bool = False, progress: bool = True, unit: str = "document", text_field: str = "text",
         **settings: Any):
    """Scan a corpus into a memory atlas and return it opened (:class:`kvmem.atlas.Atlas`).

    ``corpus``: anything :func:`kvmem.corpus.open_corpus` accepts. ``settings``: the fields of
    :class:`ScanConfig` (layers, top_k, per_document, max_tokens, window, batch_size, ...).
    ``out``: the atlas directory (None: a temporary directory). An existing ``out`` is refused
    unless ``overwrite``; ``resume`` continues from ``out``'s checkpoint (``checkpoint_every``).
    Under ``torchrun`` every rank calls this; rank 0 writes the atlas and returns it, the
    others return None.
    """
    from kvmem.atlas import open_atlas
    from kvmem.scanning.writer import write_atlas

    config = ScanConfig(**settings)
    corpus = open_corpus(corpus, unit=unit, text_field=text_field)
    layers = _check_layers(model, config)
    plan = token_plan(model, config, corpus.unit)
    rank, world = distributed.rank_and_world(model.device)
    phases = Phases(progress and rank == 0)  # one set of bars, rank 0's

    target = Path(out) if out is not None else Path(tempfile.mkdtemp(prefix="kvmem-atlas-")) / "atlas"
    checkpoint = target.with_name(target.name + (f".rank{rank}" if world > 1 else "") + ".checkpoint")
    if target.exists() and not overwrite:
        raise KvmemError(f"output directory {target} already exists; pass overwrite=True (--overwrite) or another --out")
    header = _header(model, corpus, config, plan, world)
    if resume:
        state = load_state(checkpoint, header, device=model.device)
    else:
        state = _fresh_state(model, config, layers)

    if kernels.compiled_available() and str(model.device).startswith("cpu"):
        with phases.phase("kernels"):  # numba compiles them once per install (seconds), then loads them
            kernels.warm_up(model.device)
    with phases.phase("stream", unit="tok", total=_stream_total(config, world)) as bar:
        bar.update(state.tokens)
        _stream(model, corpus, plan, config, state, rank=rank, world=world, bar=bar,
                checkpoint=(checkpoint, header) if config.checkpoint_every else None)
    for layer_state in state.layer_states.values():
        close_open_document(layer_state)
    if world > 1:
        with phases.phase("gather"):
            state = distributed.gather_states(state, header, rank=rank, world=world, device=model.device)
    if rank != 0:
        distributed.barrier()
        return None
    if state.tokens == 0 and config.shard[1] == 1:
        raise KvmemError(f"corpus {corpus.spec!r} gave no tokens to scan (empty, or every document empty"
                         f"{' in this shard' if config.shard[1] > 1 else ''}); check the corpus")
    write_atlas(target, model, corpus.describe(), config, plan, state, overwrite=overwrite, phases=phases,
                world=world, keep_state=config.shard[1] > 1)
    if checkpoint.exists():
        shutil.rmtree(checkpoint, ignore_errors=True)
    if world > 1:
        distributed.barrier()
    return open_atlas(target)


def stream(model: Model, corpus: Any, *, progress: bool = False, unit: str = "document", text_field: str = "text",
           **settings: Any) -> ScanState:
    """The streaming pass alone (no tables, no files): the per-layer state of a scan.

    Same settings as :func:`scan`; used by benchmarks and by code that wants the raw tensors.
    """
    config = ScanConfig(**settings)
    corpus = open_corpus(corpus, unit=unit, text_field=text_field)
    state = _fresh_state(model, config, _check_layers(model, config))
    phases = Phases(progress)
    with phases.phase("stream", unit="tok", total=config.max_tokens) as bar:
        _stream(model, corpus, token_plan(model, config, corpus.unit), config, state, rank=0, world=1, bar=bar, checkpoint=None)
    return state


def _stream_total(config: ScanConfig, world: int) -> int | None:
    if config.max_tokens is None:
        return None
    return config.max_tokens // (config.shard[1] * world) if config.shard[1] * world > 1 else config.max_tokens


def _header(model: Model, corpus: Corpus, config: ScanConfig, plan: TokenPlan, world: int) -> dict:
    """What a checkpoint (or a rank's state) must agree on to be continued or merged."""
    return {"config": config.resume_key(), "model": model.fingerprint, "corpus": corpus.describe(),
            "plan": plan.to_dict(), "world": world}


def _stream(model: Model, corpus: Corpus, plan: TokenPlan, config: ScanConfig, state: ScanState, *, rank: int,
            world: int, bar, checkpoint: tuple[Path, dict] | None) -> None:
    started = time.perf_counter() - state.seconds
    last_checkpoint = state.tokens
    for item in iterate_batches(corpus, model.tokenizer, plan, state.position, rank=rank, world=world):
        if isinstance(item, int):  # a block boundary: the state is whole here
            if checkpoint is not None and state.tokens - last_checkpoint >= config.checkpoint_every:
                state.seconds = time.perf_counter() - started
                save_state(checkpoint[0], state, checkpoint[1])
                last_checkpoint = state.tokens
            continue
        _run_batch(model, item, plan, config, state)
        bar.update(item.tokens)
        if state.batches % 16 == 0:
            _release_freed_memory()
        if state.texts.needs_gc():
            state.texts.keep_only(state.referenced_windows(plan.window))
    state.seconds = time.perf_counter() - started


def _release_freed_memory() -> None:
    """Hand memory freed by earlier batches back to the OS (glibc keeps it otherwise, and the
    batches' temporaries differ in size from batch to batch, so peak RSS would creep up)."""
    global _MALLOC_TRIM
    if _MALLOC_TRIM is None:
        try:
            import ctypes

            _MALLOC_TRIM = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):  # not glibc: nothing to do
            _MALLOC_TRIM = False
    if _MALLOC_TRIM:
        _MALLOC_TRIM(0)


_MALLOC_TRIM = None


def _run_batch(model: Model, batch: Batch, plan: TokenPlan, config: ScanConfig, state: ScanState) -> None:
    """One forward over a batch of windows, right-padded; only real tokens are scored."""
    device = model.device
    offset = plan.offset
    lengths = [len(w.tokens) for w in batch.windows]
    width = max(lengths) + offset
    ids = torch.zeros((len(batch.windows), width), dtype=torch.int64)  # [batch, pos]; padding id 0 is never scored
    for row, w in enumerate(batch.windows):
        ids[row, :offset + lengths[row]] = torch.tensor(plan.model_input(w.tokens))
    lengths_t = torch.tensor(lengths)
    valid = torch.arange(width)[None, :] - offset < lengths_t[:, None]
    valid[:, :offset] = False
    flat = valid.view(-1).nonzero().squeeze(1).to(device)  # [N] scored positions, in reading order
    window_of = torch.repeat_interleave(torch.arange(len(lengths)), lengths_t)  # [N]
    first_row = torch.cumsum(lengths_t, 0) - lengths_t  # flat index of each window's first token
    starts = torch.tensor([w.start for w in batch.windows])
    docs_w = torch.tensor([w.doc for w in batch.windows])
    positions = starts[window_of] + torch.arange(len(window_of)) - first_row[window_of]
    doc_of = docs_w[window_of].to(device)  # [N], each document's rows contiguous
    codes = pack(doc_of, positions.to(device))  # [N], increasing when batch.ordered
    low = first_row[window_of].to(device)  # [N] first flat row of each row's window
    high = (first_row + lengths_t)[window_of].to(device)
    steps = torch.arange(-config.context_before, config.context_after + 1, device=device)
    n_rows = len(window_of)
    with_context = config.context_activations
    keys = position_keys(codes, config.seed) if config.random_samples or config.bin_samples else None

    def on_coefficients(layer: int, coefficients: torch.Tensor) -> None:
        acts = coefficients.reshape(-1, coefficients.shape[-1]).index_select(0, flat).float()  # [N, d_ff]

        def context_fn(rows: torch.Tensor, neurons: torch.Tensor) -> torch.Tensor:
            if not with_context:
                return torch.empty((rows.numel(), 0), dtype=torch.float32, device=device)
            return window_context(acts, rows, neurons, steps, low, high)

        update(state.layer_states[layer], acts, codes, context_fn, docs=doc_of, keys=keys, ordered=batch.ordered)

    capture_coefficients(model, ids, state.layers, on_coefficients)
    state.texts.add(batch.windows)
    state.tokens += n_rows
    state.windows += len(batch.windows)
    state.batches += 1

