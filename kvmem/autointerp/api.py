"""``explain(atlas, ...)`` writes explanations (``score``, in :mod:`kvmem.autointerp.scoring`, scores them).

Both read the atlas through its public queries (:mod:`kvmem.autointerp.evidence`) and write
``explanations.parquet`` (:mod:`kvmem.autointerp.store`) as they go (at most every 20 seconds, and at the
end), so a killed run keeps what was stored; LLM answers are journaled one by one in ``explanations.journal.jsonl`` beside it, so
a rerun asks nothing twice. Every choice that changes a number (split seed and fraction, examples
per band, bootstrap replicates, judge and its prompts) is stored in the row beside the number.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import fields, replace

import pandas as pd

from kvmem.autointerp import store
from kvmem.autointerp.bulk import layer_evidence
from kvmem.autointerp.evidence import neuron_sides
from kvmem.autointerp.explainers import BackendOptions, get_explainer
from kvmem.autointerp.explanation import Explanation
from kvmem.autointerp.layertable import read_contexts, read_layer
from kvmem.autointerp.selection import select_neurons
from kvmem.autointerp.splits import DEFAULT_HELD_OUT, DEFAULT_SEED, split_window
from kvmem.autointerp.vectorised import KeyTables
from kvmem.experiments.atlas_inputs import as_atlas

__all__ = ["explain", "explanations", "backend_options", "JOURNAL"]

JOURNAL = "explanations.journal.jsonl"


def backend_options(atlas, options: BackendOptions | None) -> BackendOptions:
    """``options`` with the atlas's journal (``explanations.journal.jsonl``) unless they name one."""
    options = options or BackendOptions()
    return options if options.journal is not None else replace(options, journal=str(atlas.path / JOURNAL))


def explain(atlas, *, layers=None, neurons=None, all: bool = False, explainer: str = "tokens", sides=None,
            seed: int = DEFAULT_SEED, held_out: float = DEFAULT_HELD_OUT, overwrite: bool = False, chunk: int = 2048,
            options: BackendOptions | None = None, progress: bool = False, store_every: float = 20.0) -> pd.DataFrame:
    """Explain the chosen neurons' sides with ``explainer`` (``tokens``, ``hf:PATH``, ``openai:URL``) and store them.

    Neurons this explainer already explained are kept as they are (``overwrite=True`` explains them
    again). Rows are stored at most every ``store_every`` seconds and at the end (0: after every chunk
    of ``chunk`` neurons). Returns the stored rows of the chosen neurons for this explainer.
    """
    from tqdm import tqdm

    atlas = as_atlas(atlas)
    chosen = select_neurons(atlas, layers=layers, neurons=neurons, all=all)
    worker = get_explainer(explainer, backend_options(atlas, options))
    existing = store.read(atlas.path)
    done = set() if overwrite else set(zip(existing.layer[existing.explainer == explainer],
                                           existing.neuron[existing.explainer == explainer]))
    todo = [pair for pair in chosen if pair not in done]
    contexts = read_contexts(atlas) if todo else None
    # the tokens explainer works on a whole layer's arrays (kvmem.autointerp.vectorised); others on SideEvidence
    layer_wise = getattr(worker, "explain_layer", None) if contexts is not None else None
    keys = KeyTables.build(contexts) if layer_wise is not None else None
    bar = tqdm(total=len(todo), desc="explain", unit="neuron", disable=not progress)
    # chunks: of one layer for the array path (its tables read once per chunk), across layers for an LLM (one batch)
    chunks = []
    if layer_wise is not None:
        by_layer: dict[int, list[tuple[int, int]]] = {}
        for pair in todo:
            by_layer.setdefault(pair[0], []).append(pair)
        chunks = [pairs[b:b + chunk] for pairs in by_layer.values() for b in range(0, len(pairs), chunk)]
    else:
        chunks = [todo[b:b + chunk] for b in range(0, len(todo), chunk)]
    names = [f.name for f in fields(Explanation)]
    storer = store.Storer(atlas.path, every=store_every)

    def store_chunk(part, written) -> None:
        rows = [{**{n: getattr(e, n) for n in names}, "explain_codes": list(e.explain_codes), "split_seed": seed,
                 "held_out": held_out, "split_window": split_window(atlas)} for e in written]  # not asdict: it would deep-copy every code tuple
        storer.add(pd.DataFrame(rows))
        bar.update(len(part))

    if layer_wise is not None:
        # a chunk is part of one layer: its explanation (numpy on the layer's arrays) runs in a thread while the
        # main thread reads the next chunk's layer; chunks are stored in order
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvmem-explain") as pool:
            in_flight: deque = deque()
            for part in chunks:
                (layer,) = {layer for layer, _ in part}
                table = read_layer(atlas, layer, [n for _, n in part], sides=neuron_sides(atlas, sides), seed=seed,
                                   held_out=held_out, convention=atlas.default_convention, contexts=contexts)
                in_flight.append((part, pool.submit(layer_wise, table, keys)))
                while len(in_flight) > 1:
                    part, explained = in_flight.popleft()
                    store_chunk(part, explained.result())
            while in_flight:
                part, explained = in_flight.popleft()
                store_chunk(part, explained.result())
    else:
        for part in chunks:
            written = []
            for layer in sorted({layer for layer, _ in part}):
                wanted = [n for l_, n in part if l_ == layer]
                found = layer_evidence(atlas, layer, wanted, sides=sides, seed=seed, held_out=held_out,
                                       contexts=contexts)
                written.extend(side for n in sorted(found) for side in found[n])
            store_chunk(part, worker.explain(written))  # one call: an LLM backend batches all sides of the chunk
    storer.store()
    bar.close()
    return explanations(atlas, explainer=explainer, neurons=chosen)


def explanations(atlas, *, explainer: str | None = None, layer: int | None = None, neurons=None) -> pd.DataFrame:
    """Stored explanations, optionally of one explainer, one layer, or some (layer, neuron) pairs."""
    atlas = as_atlas(atlas)
    frame = store.read(atlas.path)
    if explainer is not None:
        frame = frame[frame.explainer == explainer]
    if layer is not None:
        frame = frame[frame.layer == layer]
    if neurons is not None:
        wanted = set(map(tuple, neurons))
        frame = frame[[(int(a), int(b)) in wanted for a, b in zip(frame.layer, frame.neuron)]]
    return frame.reset_index(drop=True)

