"""One batch into the scan's state: the per-batch logic every statistic shares.

:class:`BatchRows` lays a batch of windows out as the model's input and the flat list of its
scored positions (codes, documents, window bounds, sampling keys); :class:`BatchStep` folds each
layer's coefficients into that layer's states, one update per statistic of the scan
(:func:`fold_batch`, :mod:`kvmem.scanning.statistics`), and :meth:`BatchStep.finish` applies the
non-finite rule and counts the batch into the scan-wide statistics.

**Non-finite coefficients are refused.** A coefficient that is NaN or ±inf (a float16 overflow)
stops the scan with one line that names the layer and the batch and suggests float32 or
bfloat16; nothing is written. A batch's Σm [F], which the moments compute anyway, is finite
exactly when every coefficient is. The flags of all layers are read with each layer's other reads
and checked once per batch, after the forward.

**Reads of the device.** A layer's updates run inside one ``reads.collecting()`` block: their pending
steps share rounds, two synchronisations per layer and batch in all (``benchmarks/host_syncs.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kvmem.errors import KvmemError
from kvmem.plan import Batch, TokenPlan, pack
from kvmem.scanning.coefficients import GATE_UP_SITES
from kvmem.scanning.ordering import position_keys
from kvmem.scanning.reads import Pending, Reads, sizes
from kvmem.scanning.statistics import LayerState, ScanState
from kvmem.scanning.statistics.batch import BatchLayout, LayerBatch, Positions, ScanBatch

__all__ = ["BatchRows", "BatchStep", "fold_batch", "window_context", "window_rows"]


def _around(rows: Tensor, steps: Tensor, first: Tensor, end: Tensor, n: int) -> tuple[Tensor, Tensor]:
    """(rows[i] + steps clamped into 0..n-1, whether each lies inside row i's window
    ``first[row] <= row + step < end[row]``) [c, C] each."""
    around = rows[:, None] + steps[None, :]
    inside = (around >= first.index_select(0, rows)[:, None]) & (around < end.index_select(0, rows)[:, None])
    return around.clamp_(0, n - 1), inside


def window_context(acts: Tensor, rows: Tensor, neurons: Tensor, steps: Tensor, first: Tensor, end: Tensor,
                   extras: Tensor | None = None) -> Tensor:
    """Coefficients of neuron ``neurons[i]`` at rows ``rows[i] + steps``, NaN where that row lies outside
    the row's window (``first[row] <= row + step < end[row]``), then ``extras[e, rows[i], neurons[i]]``
    for each e -> [c, C + E] float32. acts [N, F]; rows, neurons [c]; steps [C] (may be empty);
    first, end [N] each row's window bounds in acts; extras [E, N, F] float32 or None (E = 0).
    A flat ``index_select`` (advanced indexing of acts costs several times as much); values are copied,
    never computed."""
    n, d_ff = acts.shape
    around, inside = _around(rows, steps, first, end, n)  # [c, C]
    flat = around.mul_(d_ff).add_(neurons[:, None])
    got = acts.reshape(-1).index_select(0, flat.view(-1)).view(flat.shape).masked_fill_(~inside, float("nan"))
    if extras is None or extras.shape[0] == 0:
        return got
    at = rows * d_ff + neurons
    return torch.cat([got, extras.reshape(extras.shape[0], -1).index_select(1, at).T], dim=1)


def window_rows(acts: Tensor, rows: Tensor, steps: Tensor, first: Tensor, end: Tensor,
                extras: Tensor | None = None) -> Tensor:
    """Every neuron's coefficients at rows ``rows[i] + steps``, NaN where that row lies outside the row's
    window, then ``extras[e, rows[i]]`` for each e -> [m, C + E, F] float32: what :func:`window_context`
    gives for each (row, neuron), laid out as whole rows of acts (one ``index_select`` of rows)."""
    n, d_ff = acts.shape
    around, inside = _around(rows, steps, first, end, n)  # [m, C]
    got = acts.index_select(0, around.view(-1)).view(*around.shape, d_ff)
    got.masked_fill_(~inside[:, :, None], float("nan"))
    if extras is None or extras.shape[0] == 0:
        return got
    return torch.cat([got, extras.index_select(1, rows).transpose(0, 1)], dim=1)


@torch.inference_mode()  # no autograd; pools written in and out of the forward alike
def fold_batch(layer_state: LayerState, batch: LayerBatch, flags: list, label=None) -> None:
    """Fold one batch of one layer into its states, one update per statistic, their device reads in shared
    rounds (the finite flag's among them): appends (``label``, whether every coefficient was finite) to
    ``flags`` (nothing for an empty batch); the caller applies the rule (:meth:`BatchStep.finish`)."""
    if batch.acts.shape[0] == 0:
        return
    with batch.reads.collecting():
        for statistic in layer_state.composition.layer:
            statistic.update(layer_state[statistic.name], batch)
        finite = batch.finite if batch.finite is not None else torch.isfinite(batch.acts).all()
        batch.reads.defer(_read_flag(finite, label, flags))


@dataclass
class BatchRows:
    """A batch laid out for one forward: ``ids`` [B, P] the model's input (windows right-padded,
    padding id 0 is never scored), and per scored position, in reading order (N of them):
    ``flat`` [N] its index in ids.view(-1), ``codes`` [N], ``docs`` [N] (each document's rows
    contiguous), ``low``/``high`` [N] the flat rows bounding its window, ``keys`` [N] sampling keys
    (None without samples); ``steps`` [C] the context offsets around a trigger; ``tokens`` [N] int64
    (CPU) the token at each position; ``positions`` each position's place in its window."""

    batch: Batch
    ids: Tensor
    flat: Tensor
    codes: Tensor
    docs: Tensor
    low: Tensor
    high: Tensor
    keys: Tensor | None
    steps: Tensor
    tokens: Tensor
    positions: Positions

    @classmethod
    def build(cls, batch: Batch, plan: TokenPlan, *, context_before: int, context_after: int, seed: int,
              samples: bool, device) -> BatchRows:
        offset = plan.offset
        lengths = [len(w.tokens) for w in batch.windows]
        leads = [min(plan.skip_first, n) for n in lengths]  # tokens of each window read, not scored
        width = max(lengths) + offset
        ids = torch.zeros((len(batch.windows), width), dtype=torch.int64)  # [batch, pos]
        for row, w in enumerate(batch.windows):
            ids[row, :offset + lengths[row]] = torch.tensor(plan.model_input(w.tokens))
        lengths_t, leads_t = torch.tensor(lengths), torch.tensor(leads)
        scored_t = lengths_t - leads_t  # [windows]
        column = torch.arange(width)[None, :] - offset  # [1, pos]: index into the window
        valid = (column >= leads_t[:, None]) & (column < lengths_t[:, None])  # BOS and the leads are not scored
        flat = valid.view(-1).nonzero().squeeze(1)  # [N] scored positions, in reading order
        tokens = ids.view(-1).index_select(0, flat)  # [N], on the CPU
        flat = flat.to(device)
        window_of = torch.repeat_interleave(torch.arange(len(lengths)), scored_t)  # [N]
        first_row = torch.cumsum(scored_t, 0) - scored_t  # flat index of each window's first scored token
        starts = torch.tensor([w.start for w in batch.windows]) + leads_t  # document position of that token
        docs_w = torch.tensor([w.doc for w in batch.windows])
        positions = starts[window_of] + torch.arange(len(window_of)) - first_row[window_of]
        docs = docs_w[window_of].to(device)
        codes = pack(docs, positions.to(device))  # [N], increasing when batch.ordered
        low = first_row[window_of].to(device)
        high = (first_row + scored_t)[window_of].to(device)
        steps = torch.arange(-context_before, context_after + 1, device=device)
        keys = position_keys(codes, seed) if samples else None
        return cls(batch, ids, flat, codes, docs, low, high, keys, steps, tokens, Positions.of(lengths, device, leads))

    @property
    def count(self) -> int:
        return self.flat.numel()


class BatchStep:
    """Fold one batch's coefficients, layer by layer as the forward produces them, into ``state``
    (its ``index``-th batch); then :meth:`finish`."""

    def __init__(self, state: ScanState, rows: BatchRows, *, with_context: bool, index: int):
        self.state, self.rows, self.with_context, self.index = state, rows, with_context, index
        self.statistics = state.statistics
        self.reads = Reads()
        self.finite: list[tuple[int, bool]] = []
        self.pending: dict[int, Tensor] = {}  # layer -> [2, N, F] gate, up, until its coefficients come
        composition = self.statistics
        self.layout = (BatchLayout.read(rows.codes, rows.docs, rows.keys, documents=composition.needs_documents,
                                        random_size=composition.random_size, bin_limit=composition.bin_limit)
                       if rows.count else None)

    @property
    def wants_gate_up(self) -> bool:
        """Whether a statistic needs the gate and up pre-activations, so the capture must pass :meth:`gate_up`
        each layer's."""
        return self.statistics.needs_gate_up

    def gate_up(self, layer: int, site: str, tensor: Tensor) -> None:
        """A gate (site ``pre``) or up (``pre_linear``) pre-activation [B, P, F] of ``layer``, kept at the
        scored positions (float32) for :meth:`layer`."""
        d_ff = self.state.layer_states[layer]["moments"].total.shape[1]
        if tensor.shape[-1] != d_ff:
            raise KvmemError(f"the {site} pre-activation of layer {layer} is {tensor.shape[-1]} wide, not d_ff: this "
                             f"model's gate/up projections are not laid out as its architecture row says; "
                             f"scan with --no-taxonomy-sums")
        if layer not in self.pending:
            self.pending[layer] = torch.empty((len(GATE_UP_SITES), self.rows.count, tensor.shape[-1]),
                                              dtype=torch.float32, device=tensor.device)
        kept = self.pending[layer][GATE_UP_SITES.index(site)]
        scored = tensor.reshape(-1, tensor.shape[-1])
        if scored.dtype == torch.float32:
            torch.index_select(scored, 0, self.rows.flat, out=kept)
        else:
            kept.copy_(scored.index_select(0, self.rows.flat))

    def layer(self, layer: int, coefficients: Tensor) -> None:
        """coefficients [B, P, F] of ``layer`` (any float dtype) -> folded into its states."""
        rows = self.rows
        acts = coefficients.reshape(-1, coefficients.shape[-1]).index_select(0, rows.flat).float()  # [N, F]
        extras = self.pending.pop(layer, None)  # [2, N, F] gate, up or None
        steps = rows.steps if self.with_context else rows.steps[:0]

        def context(at: Tensor, neurons: Tensor) -> Tensor:  # [c, C (+ gate, up)]
            return window_context(acts, at, neurons, steps, rows.low, rows.high, extras)

        def row_context(at: Tensor) -> Tensor:  # [m, C (+ gate, up), F]
            return window_rows(acts, at, steps, rows.low, rows.high, extras)

        batch = LayerBatch(acts, rows.codes, rows.batch.ordered, context, row_context, self.layout, self.reads,
                           positions=rows.positions, gate_up=None if extras is None else (extras[0], extras[1]))
        fold_batch(self.state.layer_states[layer], batch, self.finite, layer)

    def finish(self) -> None:
        """Apply the non-finite rule (to the flags the layers read) and count the batch into the state."""
        bad = [layer for layer, ok in self.finite if not ok]
        if bad:
            windows = self.rows.batch.windows
            raise KvmemError(
                f"layer {bad[0]} gave non-finite coefficients (NaN or ±inf) in batch {self.index} "
                f"(documents {windows[0].doc_id!r} .. {windows[-1].doc_id!r}); kvmem refuses them rather "
                f"than count them wrongly: scan in float32 or bfloat16 (--dtype float32), whose range "
                f"does not overflow")
        batch = self.rows.batch
        scan_batch = ScanBatch(self.rows.tokens)
        for statistic in self.statistics.scan:
            statistic.update(self.state.scan_states[statistic.name], scan_batch)
        self.state.texts.add(batch.windows)
        self.state.tokens += self.rows.count  # scored tokens
        self.state.windows += len(batch.windows)
        self.state.batches += 1


def _read_flag(flag: Tensor, label, into: list) -> Pending:
    (value,) = yield sizes(flag)
    into.append((label, bool(value)))
