"""The scan: one pass over the corpus -> per-neuron state (+ the text it needs) -> atlas.

The pass reads and tokenizes the corpus once. Everything the atlas needs from the corpus
(trigger contexts, each trigger's neuron on its context tokens) is captured while the batch
is in memory; value and key projections depend on the weights alone and are cached per model.

Each batch goes into the state through :mod:`kvmem.scanning.step`: one update per statistic the
config asks for (:func:`kvmem.scanning.statistics.compose`). Under ``torchrun`` each rank scans
its share of the blocks (:mod:`kvmem.plan`); rank 0 merges the states with
:meth:`kvmem.scanning.statistics.ScanState.merge` and writes the atlas.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvmem import environment
from kvmem.atlas import open_atlas
from kvmem.atomic import held_lock
from kvmem.corpus import Corpus, open_corpus
from kvmem.errors import KvmemError
from kvmem.models import Model
from kvmem.plan import DEFAULT_WINDOW, Batch, TokenPlan, WindowText, iterate_batches
from kvmem.scanning import distributed
from kvmem.scanning.checkpoint import load_state, save_state, saved_plan
from kvmem.scanning.coefficients import capture_coefficients, has_gate_up
from kvmem.scanning.config import ScanConfig
from kvmem.scanning.prefetch import prefetched_batches
from kvmem.scanning.progress import Phases
from kvmem.scanning.statistics import ScanState, compose
from kvmem.scanning.step import BatchRows, BatchStep
from kvmem.scanning.writer import write_atlas

__all__ = ["scan", "stream", "resolve_batch_size", "agreed_batch_size", "batch_for", "probe_peak", "resolve_window",
           "token_plan"]


def resolve_window(model: Model, config: ScanConfig) -> int:
    limit = (model.n_ctx or DEFAULT_WINDOW) - (1 if config.prepend_bos else 0)
    window = config.window or min(DEFAULT_WINDOW, limit)
    if window > limit:
        raise KvmemError(f"window {window} exceeds the model's context ({model.n_ctx} tokens"
                         f"{', one for BOS' if config.prepend_bos else ''}); use --window {limit} or less")
    return window


def token_plan(model: Model, config: ScanConfig, unit: str = "document", *, batch_size: int | None = None) -> TokenPlan:
    """The tokenization plan of a scan of ``model`` under ``config``, over a corpus of ``unit``s;
    ``batch_size``: windows per forward already agreed on (see :func:`agreed_batch_size`)."""
    bos = model.bos_token_id if config.prepend_bos else None
    if config.prepend_bos and bos is None:
        raise KvmemError(f"the tokenizer of {model.name} has no BOS token; scan with prepend_bos=False (--no-bos)")
    window = resolve_window(model, config)
    return TokenPlan(window=window, bos_token_id=bos,
                     batch_size=batch_size or resolve_batch_size(model, config, window),
                     max_tokens=config.max_tokens, block_documents=config.block_documents_for(unit), shard=config.shard,
                     sort_by_length=config.sort_by_length,
                     # per-document bests need each document's windows together: documents shortest first
                     longest_windows_first=config.sort_by_length and not config.per_document,
                     skip_first=config.skip_first)


CPU_AUTO_TOKENS = 2048  # a CPU's throughput is flat beyond this many tokens per forward
GPU_MEMORY_SHARE = 0.7  # of the free memory after the state is allocated, for one batch's step


def resolve_batch_size(model: Model, config: ScanConfig, window: int) -> int:
    """Windows per forward for ``config.batch_size``: an int as given; ``"N tokens"`` the whole windows in N
    padded positions (at least one); ``"auto"`` see :class:`ScanConfig` (:func:`_probe_batch_size`)."""
    spec = config.batch_size
    if isinstance(spec, int):
        return spec
    if spec == "auto":
        if not str(model.device).startswith("cuda"):
            return max(1, CPU_AUTO_TOKENS // window)
        return _probe_batch_size(model, config, window)
    return max(1, int(spec.split()[0]) // window)


def agreed_batch_size(model: Model, config: ScanConfig, *, checkpoint: Path, resume: bool, world: int) -> int | None:
    """The batch size an ``"auto"`` scan uses, the same in every process and every run of one scan: a
    resumed scan takes the size its checkpoint recorded (a new probe might choose another, and the
    batches, hence the state, would differ); under torchrun every rank probes its own device and all
    take the smallest size (the ranks' batches must be the same tensors a single process would read).
    None when ``config.batch_size`` is not ``"auto"`` (it resolves the same everywhere)."""
    if config.batch_size != "auto":
        return None
    if resume:
        saved = saved_plan(checkpoint)
        if saved is not None and saved.get("batch_size"):
            return int(saved["batch_size"])
    size = resolve_batch_size(model, config, resolve_window(model, config))
    return distributed.smallest(size, model.device) if world > 1 else size


PROBE_WINDOWS = 8  # the probe's batch: large enough that what grows with the batch outweighs what does not


def _probe_batch_size(model: Model, config: ScanConfig, window: int) -> int:
    """The largest batch whose step fits in GPU_MEMORY_SHARE of the free memory (:func:`probe_peak`,
    :func:`batch_for`); the state a scan keeps is counted once, apart from the step's peak."""
    import torch

    device = torch.device(model.device)
    layers = _check_layers(model, config)
    before = torch.cuda.memory_allocated(device)
    state = _fresh_state(model, config, layers)
    state_bytes = torch.cuda.memory_allocated(device) - before
    del state
    peak = probe_peak(model, config, window, lambda: _fresh_state(model, config, layers), lambda: _CudaPeak(device))
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info(device)
    return batch_for(peak, PROBE_WINDOWS, (free - state_bytes) * GPU_MEMORY_SHARE)


def batch_for(peak: int, windows: int, budget: float) -> int:
    """The most windows whose step fits ``budget`` bytes, from the step's ``peak`` at ``windows`` windows.

    A step's memory is the largest of its phases' (the forward's activations, the histogram, the
    candidates of the sides, ...), each a cost that does not grow with the batch plus one that grows
    linearly with it: a convex function of the windows that is 0 at 0, so peak · B / windows bounds it
    for every B >= windows (a line through two small probes does not: a phase with a steeper growth
    can take over beyond them, as the sides' candidates do from the histogram's fixed table)."""
    return max(1, int(budget * windows // max(peak, 1)))


def probe_peak(model: Model, config: ScanConfig, window: int, new_state, measure, windows: int = PROBE_WINDOWS) -> int:
    """The peak memory of one real step at ``windows`` full windows (forward, capture and fold into a fresh
    state from ``new_state()``, a throwaway, so that the probe is a scan's first, densest batch), the
    most of its layouts: every window a document of its own, and (with per-document sides) all
    windows one document, whose last-document search reads the whole batch. ``measure()``: a context
    manager whose ``bytes`` is the peak of the memory allocated inside it (the state is made before).
    The tokens are drawn from the vocabulary (seeded): text-like, few ties (a batch of one repeated
    token ties every window with the others and inflates the sides' candidates)."""
    import torch

    bos = model.bos_token_id if config.prepend_bos else None
    tokens = torch.randint(0, model.vocab_size, (windows, window), generator=torch.Generator().manual_seed(0)).tolist()
    layouts = [lambda w: (w, 0)] + ([lambda w: (0, w * window)] if config.per_document else [])  # -> (doc, start)
    plan = TokenPlan(window=window, bos_token_id=bos, batch_size=windows)
    worst = 0
    for layout in layouts:
        texts = []
        for w in range(windows):
            doc, start = layout(w)
            texts.append(WindowText(doc, "probe", start, tuple(tokens[w]), -1, ""))
        state = new_state()
        with measure() as peak:
            _run_batch(model, Batch(0, texts, windows * window), plan, config, state)
        del state
        worst = max(worst, peak.bytes)
    return worst


class _CudaPeak:
    """The peak of the CUDA memory allocated inside the block, above what was allocated when it began."""

    def __init__(self, device):
        self.device = device

    def __enter__(self):
        import torch

        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self.base = torch.cuda.memory_allocated(self.device)
        return self

    def __exit__(self, *exc):
        import torch

        torch.cuda.synchronize(self.device)
        self.bytes = torch.cuda.max_memory_allocated(self.device) - self.base


def _check_layers(model: Model, config: ScanConfig) -> list[int]:
    layers = list(config.layers) if config.layers is not None else list(range(model.n_layers))
    bad = [layer for layer in layers if not 0 <= layer < model.n_layers]
    if bad:
        raise KvmemError(f"layer(s) {bad} out of range; this model has layers 0..{model.n_layers - 1}")
    return layers


def statistics_of(model: Model, config: ScanConfig):
    """The statistics a scan of ``model`` under ``config`` keeps (:func:`kvmem.scanning.statistics.compose`)."""
    return compose(config, gated=has_gate_up(model))


def _fresh_state(model: Model, config: ScanConfig, layers: list[int]) -> ScanState:
    statistics = statistics_of(model, config)
    width = config.context_width if config.context_activations else 0
    return statistics.new_state(layers, statistics.spec(model.d_ff, model.vocab_size, model.device, width))


def scan(model: Model, corpus: Any, *, out: str | os.PathLike | None = None, overwrite: bool = False,
         resume: bool = False, progress: bool = True, unit: str = "document", text_field: str = "text",
         **settings: Any):
    """Scan a corpus into a memory atlas and return it opened (:class:`kvmem.atlas.Atlas`).

    ``corpus``: anything :func:`kvmem.corpus.open_corpus` accepts. ``settings``: the fields of
    :class:`ScanConfig` (layers, top_k, per_document, max_tokens, window, batch_size, ...).
    ``out``: the atlas directory (None: a temporary directory). An existing ``out`` is refused
    unless ``overwrite``; ``resume`` continues from ``out``'s checkpoint (``checkpoint_every``).
    While a scan runs it holds a lock on ``out`` (the file ``.NAME.lock`` beside it), and a second
    scan into the same ``out`` is refused in one line.
    Under ``torchrun`` every rank calls this; rank 0 writes the atlas and returns it, the
    others return None.
    """
    config = ScanConfig(**settings)
    corpus = open_corpus(corpus, unit=unit, text_field=text_field)
    layers = _check_layers(model, config)
    rank, world = distributed.rank_and_world(model.device)
    target = Path(out) if out is not None else Path(tempfile.mkdtemp(prefix="kvmem-atlas-")) / "atlas"
    plan = token_plan(model, config, corpus.unit, batch_size=agreed_batch_size(
        model, config, checkpoint=_checkpoint_path(target, rank, world), resume=resume, world=world))
    phases = Phases(progress and rank == 0)  # one set of bars, rank 0's

    lock = target.with_name(f".{target.name}{f'.rank{rank}' if world > 1 else ''}.lock")
    # one scan at a time per --out (and rank); the objects that exist now (modules, the model) are left out of
    # garbage collections until the scan ends
    with held_lock(lock, f"the output {target}"):
        return _scan_into(target, model, corpus, config, layers, plan, phases, rank=rank, world=world,
                          overwrite=overwrite, resume=resume)


def _scan_into(target: Path, model: Model, corpus: Corpus, config: ScanConfig, layers: list[int], plan: TokenPlan,
               phases: Phases, *, rank: int, world: int, overwrite: bool, resume: bool):
    checkpoint = _checkpoint_path(target, rank, world)
    if target.exists() and not overwrite:
        raise KvmemError(f"output directory {target} already exists; pass overwrite=True (--overwrite) or another --out")
    header = _header(model, corpus, config, plan, world)
    if resume:
        state = load_state(checkpoint, header, statistics_of(model, config), device=model.device)
    else:
        state = _fresh_state(model, config, layers)

    if config.checkpoint_every and phases.enabled:
        print(f"kvmem: {checkpoint_rule(config, plan)}", file=sys.stderr)
    try:
        with phases.phase("stream", unit="tok", total=_stream_total(config, world)) as bar:
            bar.update(state.tokens)
            _stream(model, corpus, plan, config, state, rank=rank, world=world, bar=bar,
                    checkpoint=(checkpoint, header) if config.checkpoint_every else None)
    except KeyboardInterrupt as interrupt:
        if config.checkpoint_every:
            interrupt.add_note(f"a checkpoint of {checkpoint_tokens(checkpoint):,} tokens is in {checkpoint}: continue "
                               f"with --resume" if checkpoint.exists() else
                               f"no checkpoint was saved yet ({checkpoint_rule(config, plan)}); --resume cannot continue")
        raise
    state.close()
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


def checkpoint_rule(config: ScanConfig, plan: TokenPlan) -> str:
    """Where a scan's checkpoints fall, in one line for the user."""
    return (f"checkpoints are saved at the end of a block of {plan.block_documents:,} documents once "
            f"{config.checkpoint_every:,} tokens have been scanned since the last one (a scan resumes at a block "
            f"boundary; a block of long documents can hold far more tokens: --block-documents N sets its size)")


def checkpoint_tokens(path: Path) -> int:
    """Tokens scanned in the checkpoint at ``path`` (0 if it cannot be read)."""
    import json

    try:
        return int(json.loads((path / "state.json").read_text())["tokens"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0


def _checkpoint_path(target: Path, rank: int, world: int) -> Path:
    return target.with_name(target.name + (f".rank{rank}" if world > 1 else "") + ".checkpoint")


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
        _stream(model, corpus, token_plan(model, config, corpus.unit), config, state, rank=0, world=1,
                bar=bar, checkpoint=None)
    return state


def _stream_total(config: ScanConfig, world: int) -> int | None:
    if config.max_tokens is None:
        return None
    return config.max_tokens // (config.shard[1] * world) if config.shard[1] * world > 1 else config.max_tokens


def _header(model: Model, corpus: Corpus, config: ScanConfig, plan: TokenPlan, world: int) -> dict:
    """What a checkpoint (or a rank's state) must agree on to be continued or merged."""
    return {"config": config.resume_key(), "model": model.fingerprint, "corpus": corpus.describe(),
            "plan": plan.to_dict(), "world": world, "device": str(model.device),
            "dtype": str(model.dtype).removeprefix("torch.")}


def _stream(model: Model, corpus: Corpus, plan: TokenPlan, config: ScanConfig, state: ScanState, *,
            rank: int, world: int, bar, checkpoint: tuple[Path, dict] | None) -> None:
    started = time.perf_counter() - state.seconds
    last_checkpoint = state.tokens

    def save_if_due(position_at_end) -> None:  # at a block end: the state is whole here
        """``position_at_end()``: the stream position at this block end (built only when a save is due)."""
        nonlocal last_checkpoint
        if checkpoint is not None and state.tokens - last_checkpoint >= config.checkpoint_every:
            state.seconds = time.perf_counter() - started
            live, state.position = state.position, position_at_end()
            try:
                save_state(checkpoint[0], state, checkpoint[1])
            finally:
                state.position = live
            last_checkpoint = state.tokens

    if prefetch_enabled(model.device):  # the walk runs ahead in a thread (kvmem.scanning.prefetch)
        batches = prefetched_batches(corpus, model.tokenizer, plan, state.position, rank=rank, world=world,
                                     on_block_end=lambda end: save_if_due(end.position))
    else:
        batches = iterate_batches(corpus, model.tokenizer, plan, state.position, rank=rank, world=world,
                                  on_block_end=lambda block: save_if_due(lambda: state.position))
    for batch in batches:
        _run_batch(model, batch, plan, config, state)
        bar.update(batch.tokens)
        if state.texts.needs_gc():
            state.texts.keep_only(state.referenced_windows(plan.window))
    state.seconds = time.perf_counter() - started


PREFETCH_ENV = "KVMEM_PREFETCH"  # 1: read ahead in a thread, 0: do not; unset: on a GPU only


def prefetch_enabled(device) -> bool:
    """Whether the corpus walk runs ahead of the forward in a thread: by default on a GPU, where the
    forward is quick next to tokenizing; on a CPU the thread would take cores from the forward."""
    chosen = (environment.read(PREFETCH_ENV) or "").lower()
    if chosen in ("1", "true", "yes", "on"):
        return True
    if chosen in ("0", "false", "no", "off"):
        return False
    if chosen:
        raise KvmemError(f"{PREFETCH_ENV}={chosen!r} is not 0 or 1; unset it for the default (on a GPU only)")
    return str(device).startswith("cuda")


def _run_batch(model: Model, batch: Batch, plan: TokenPlan, config: ScanConfig, state: ScanState) -> None:
    """One forward over a batch of windows, right-padded; only real tokens are scored."""
    rows = BatchRows.build(batch, plan, context_before=config.context_before, context_after=config.context_after,
                           seed=config.seed, samples=state.statistics.needs_keys, device=model.device)
    step = BatchStep(state, rows, with_context=config.context_activations, index=state.batches)
    gate_up = {"on_gate_up": step.gate_up} if step.wants_gate_up else {}  # the taxonomy's quadrants (gated FFNs)
    capture_coefficients(model, rows.ids, state.layers, step.layer, **gate_up)
    step.finish()
