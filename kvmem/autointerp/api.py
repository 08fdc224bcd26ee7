"""``explain(atlas, ...)`` writes explanations; ``score(atlas, ...)`` scores them on held-out examples.

Both read the atlas through its public queries (:mod:`kvmem.autointerp.evidence`) and write
``explanations.parquet`` (:mod:`kvmem.autointerp.store`) chunk by chunk, so a killed run keeps every
finished chunk; LLM answers are journaled one by one in ``explanations.journal.jsonl`` beside it, so
a rerun asks nothing twice. Every choice that changes a number (split seed and fraction, examples
per band, bootstrap replicates, judge and its prompts) is stored in the row beside the number.
"""

from __future__ import annotations

import hashlib
from collections import namedtuple
from dataclasses import fields, replace
from pathlib import Path

import numpy as np
import pandas as pd

from kvmem.autointerp import store
from kvmem.autointerp.bulk import layer_evidence
from kvmem.autointerp.evidence import neuron_sides
from kvmem.autointerp.explainers import BackendOptions, get_explainer, get_judge
from kvmem.autointerp.explanation import Explanation
from kvmem.autointerp.judges import TokensJudge, rule_of
from kvmem.autointerp.layertable import read_contexts, read_layer
from kvmem.autointerp.randominit import random_init_atlas
from kvmem.autointerp.scorers import get_scorers
from kvmem.autointerp.scorers.base import PER_BAND
from kvmem.autointerp.scorers.statistics import N_BOOT
from kvmem.autointerp.selection import select_neurons
from kvmem.autointerp.splits import DEFAULT_HELD_OUT, DEFAULT_SEED
from kvmem.autointerp.vectorised import FAST_SCORERS, KeyTables, score_layer
from kvmem.errors import KvmemError
from kvmem.experiments.common import SIDES, as_atlas, single_cycle

__all__ = ["explain", "score", "explanations", "JOURNAL", "DEFAULT_SCORERS", "BASELINES"]

JOURNAL = "explanations.journal.jsonl"
DEFAULT_SCORERS = ("detection", "fuzzing", "simulation")
BASELINES = ("random-init",)
_Row = namedtuple("_Row", "layer neuron side text rule")


def _options(atlas, options: BackendOptions | None) -> BackendOptions:
    options = options or BackendOptions()
    return options if options.journal is not None else replace(options, journal=str(atlas.path / JOURNAL))


def explain(atlas, *, layers=None, neurons=None, all: bool = False, explainer: str = "tokens", sides=None,
            seed: int = DEFAULT_SEED, held_out: float = DEFAULT_HELD_OUT, overwrite: bool = False, chunk: int = 2048,
            options: BackendOptions | None = None, progress: bool = False) -> pd.DataFrame:
    """Explain the chosen neurons' sides with ``explainer`` (``tokens``, ``hf:PATH``, ``openai:URL``) and store them.

    Neurons this explainer already explained are kept as they are (``overwrite=True`` explains them
    again). Returns the stored rows of the chosen neurons for this explainer.
    """
    from tqdm import tqdm

    atlas = as_atlas(atlas)
    chosen = select_neurons(atlas, layers=layers, neurons=neurons, all=all)
    worker = get_explainer(explainer, _options(atlas, options))
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
    for part in chunks:
        written = []
        for layer in sorted({layer for layer, _ in part}):
            wanted = [n for l_, n in part if l_ == layer]
            if layer_wise is not None:
                table = read_layer(atlas, layer, wanted, sides=neuron_sides(atlas, sides), seed=seed,
                                   held_out=held_out, convention=atlas.default_convention, contexts=contexts)
                written.extend(layer_wise(table, keys))
            else:
                found = layer_evidence(atlas, layer, wanted, sides=sides, seed=seed, held_out=held_out,
                                       contexts=contexts)
                written.extend(side for n in sorted(found) for side in found[n])
        if layer_wise is None:
            written = worker.explain(written)  # one call: an LLM backend batches all sides of the chunk
        rows = [{**{n: getattr(e, n) for n in names}, "explain_codes": list(e.explain_codes), "split_seed": seed,
                 "held_out": held_out} for e in written]  # not asdict: it would deep-copy every code tuple
        store.write(atlas.path, store.upsert(store.read(atlas.path), pd.DataFrame(rows)))
        bar.update(len(part))
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


def _seed_of(*parts) -> int:
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "little")


def read_user_file(atlas, path) -> pd.DataFrame:
    """A user's explanations: csv, jsonl or parquet with columns layer, neuron, side, text (optional rule)."""
    path = Path(path)
    if not path.exists():
        raise KvmemError(f"explanations file {path} does not exist")
    readers = {".csv": pd.read_csv, ".jsonl": lambda p: pd.read_json(p, lines=True), ".parquet": pd.read_parquet}
    if path.suffix not in readers:
        raise KvmemError(f"explanations file {path} must end in .csv, .jsonl or .parquet")
    try:
        frame = readers[path.suffix](path)
    except ValueError as error:
        raise KvmemError(f"explanations file {path} cannot be read ({str(error).splitlines()[0]})") from None
    missing = [c for c in ("layer", "neuron", "side", "text") if c not in frame.columns]
    if missing:
        raise KvmemError(f"explanations file {path} lacks column(s) {', '.join(missing)}; it needs layer, neuron, "
                         f"side, text (and optionally rule)")
    for i, row in enumerate(frame.itertuples(index=False), start=1):
        where = f"explanations file {path}, row {i}"
        try:
            layer, neuron = int(row.layer), int(row.neuron)
        except (TypeError, ValueError):
            raise KvmemError(f"{where}: layer and neuron must be integers, got {row.layer!r}, {row.neuron!r}") from None
        try:
            atlas.check(layer, neuron)
        except KvmemError as error:
            raise KvmemError(f"{where} names neuron {layer}:{neuron}, which is not in the atlas: {error}") from None
        if row.side not in SIDES:
            raise KvmemError(f"{where}: side {row.side!r} is unknown; use {' or '.join(SIDES)}")
        if not isinstance(row.text, str) or not row.text.strip():
            raise KvmemError(f"{where} ({layer}:{neuron} {row.side}) has an empty text; give every row an explanation")
    rules = frame["rule"].fillna("").astype(str) if "rule" in frame.columns else ""
    return pd.DataFrame({"layer": frame.layer.astype(int), "neuron": frame.neuron.astype(int), "side": frame.side,
                         "explainer": f"user:{path.name}", "text": frame.text, "rule": rules})


def score(atlas, *, scorers=DEFAULT_SCORERS, judge: str = "tokens", explanations=None, explainer: str | None = None,
          layers=None, neurons=None, baseline: str | None = None, seed: int = DEFAULT_SEED,
          held_out: float = DEFAULT_HELD_OUT, per_band: int = PER_BAND, max_quiet: int | None = None,
          n_boot: int = N_BOOT, chunk: int = 4096, options: BackendOptions | None = None,
          progress: bool = False) -> pd.DataFrame:
    """Score stored explanations (or a user's file ``explanations=``) on held-out examples; store and return them.

    ``scorers``: names of :data:`kvmem.autointerp.scorers.SCORERS`;  ``judge``: ``tokens`` (apply the rule),
    ``hf:PATH`` or ``openai:URL``;  ``explainer``, ``layers``, ``neurons``: which stored rows;
    ``baseline="random-init"``: also run the pipeline on a random-init copy (:mod:`kvmem.autointerp.randominit`);
    ``per_band``: activating examples per band (simulation: top records); ``max_quiet``: at most this many
    non-activating examples per side (detection; simulation: random records), None for all (cheaper LLM judging).
    Each score gets a bootstrap interval over examples and a derangement baseline (the same examples judged
    with another neuron's explanation of the same layer, side and explainer).
    """
    for name, value in (("per_band", per_band), ("n_boot", n_boot), ("max_quiet", max_quiet)):
        if not (value is None and name == "max_quiet") and (isinstance(value, bool) or not isinstance(value, int)
                                                            or value < 1):
            raise KvmemError(f"{name} must be an integer >= 1, got {value!r}")
    atlas = as_atlas(atlas)
    modules = get_scorers(scorers)
    if baseline is not None and baseline not in BASELINES:
        raise KvmemError(f"unknown baseline {baseline!r}; choose one of {', '.join(BASELINES)}")
    stored = store.read(atlas.path)
    if explanations is not None:
        rows = read_user_file(atlas, explanations)
        rows = rows.assign(split_seed=seed, held_out=held_out)
    else:
        rows = stored
        if explainer is not None:
            rows = rows[rows.explainer == explainer]
    if layers is not None:
        rows = rows[rows.layer.isin([int(x) for x in layers])]
    if neurons is not None:
        wanted = set(map(tuple, neurons))
        rows = rows[[(int(a), int(b)) in wanted for a, b in zip(rows.layer, rows.neuron)]]
    if not len(rows):
        raise KvmemError("no explanations to score: explain some first (kvmem explain), or pass --explanations FILE")
    rows = store.complete(rows).sort_values(list(store.KEY), kind="stable").reset_index(drop=True)
    worker = get_judge(judge, _options(atlas, options))
    judge_label = f"{judge} {worker.prompt_hash}".strip()
    # the derangement: within each (layer, side, explainer) group, row i borrows row sigma(i)'s explanation
    borrowed = np.full(len(rows), -1)
    for (layer, side, name), index in rows.groupby(["layer", "side", "explainer"]).indices.items():
        if len(index) > 1:
            borrowed[index] = index[single_cycle(len(index), np.random.default_rng(_seed_of(seed, layer, side, name)))]
    scored = rows.copy()
    contexts = read_contexts(atlas) if isinstance(worker, TokensJudge) else None
    if contexts is not None and all(m.NAME in FAST_SCORERS for m in modules):
        _score_layers(atlas, rows, scored, borrowed, modules, contexts=contexts, judge_label=judge_label, seed=seed,
                      per_band=per_band, max_quiet=max_quiet, n_boot=n_boot)
    for begin in range(0, len(rows) if contexts is None else 0, chunk):
        stop = min(begin + chunk, len(rows))
        evidence = {}
        part = rows.iloc[begin:stop]
        for (layer, split_seed, fraction), group in part.groupby(["layer", "split_seed", "held_out"]):
            found = layer_evidence(atlas, int(layer), group.neuron.astype(int).tolist(),
                                   sides=sorted(set(group.side), key=list(SIDES).index), seed=int(split_seed),
                                   held_out=float(fraction), contexts=contexts)
            for neuron, sides in found.items():
                evidence[(int(layer), neuron, int(split_seed), float(fraction))] = {s.side: s for s in sides}
        for module in modules:
            tasks, jobs, spans = {}, [], {}
            for i in range(begin, stop):
                key = (int(rows.layer[i]), int(rows.neuron[i]), int(rows.split_seed[i]), float(rows.held_out[i]))
                side = evidence[key][rows.side[i]]
                task = tasks[i] = module.build(side, per_band=per_band, seed=seed, max_quiet=max_quiet)
                for which, j in (("score", i), ("baseline", int(borrowed[i]))):
                    if j < 0:
                        continue
                    own = _Row(int(rows.layer[j]), int(rows.neuron[j]), rows.side[j], rows.text[j], rows.rule[j])
                    start = len(jobs)
                    jobs.extend((own, module.NAME, q) for q in task.queries)
                    spans[(i, which)] = (start, len(jobs))
            answers = worker.answer(jobs) if jobs else []
            for i, task in tasks.items():
                boot_seed = seed  # the draws depend on (seed, examples): score and baseline resampled alike
                start, end = spans[(i, "score")]
                result = module.evaluate(task, answers[start:end], seed=boot_seed, n_boot=n_boot, judge=judge_label)
                name = module.NAME
                scored.at[i, name], scored.at[i, f"{name}_low"], scored.at[i, f"{name}_high"] = \
                    result.score, result.low, result.high
                scored.at[i, f"{name}_n"], scored.at[i, f"{name}_judge"] = result.n, judge_label
                scored.at[i, f"{name}_codes"] = list(result.codes)
                if (i, "baseline") in spans:
                    start, end = spans[(i, "baseline")]
                    base = module.evaluate(task, answers[start:end], seed=boot_seed, n_boot=n_boot, judge=judge_label)
                    scored.at[i, f"{name}_baseline"] = base.score
                    scored.at[i, f"{name}_baseline_low"], scored.at[i, f"{name}_baseline_high"] = base.low, base.high
                    scored.at[i, f"{name}_baseline_from"] = int(rows.neuron[int(borrowed[i])])
                else:
                    scored.at[i, f"{name}_baseline_from"] = -1
        store.write(atlas.path, store.upsert(store.read(atlas.path), scored.iloc[begin:stop]))
    if baseline == "random-init":
        scored = _random_init_scores(atlas, scored, scorers=[m.NAME for m in modules], judge=judge, seed=seed,
                                     held_out=held_out, per_band=per_band, max_quiet=max_quiet, n_boot=n_boot,
                                     options=options, progress=progress)
        store.write(atlas.path, store.upsert(store.read(atlas.path), scored))
    return scored


def _score_layers(atlas, rows: pd.DataFrame, scored: pd.DataFrame, borrowed: np.ndarray, modules, *, contexts,
                  judge_label: str, seed: int, per_band: int, max_quiet: int | None, n_boot: int) -> None:
    """The tokens judge's scores of ``rows`` into ``scored``, a layer at a time on arrays
    (:func:`kvmem.autointerp.vectorised.score_layer`; equal to the per-row loop of :func:`score`), stored per layer."""
    keys = KeyTables.build(contexts)
    parsed: dict[str, object] = {}
    rules = [parsed.get(r.rule) or parsed.setdefault(r.rule, rule_of(r)) for r in rows.itertuples(index=False)]
    neuron_col = rows.neuron.to_numpy().astype(np.int64)
    for (layer, split_seed, fraction), index in rows.groupby(["layer", "split_seed", "held_out"]).indices.items():
        index = np.sort(index)
        sides = sorted(set(rows.side.iloc[index]), key=list(SIDES).index)
        neurons = np.unique(neuron_col[index])
        table = read_layer(atlas, int(layer), neurons, sides=sides, seed=int(split_seed), held_out=float(fraction),
                           convention=atlas.default_convention, contexts=contexts)
        side_index = np.searchsorted(neurons, neuron_col[index]) * len(sides) + \
            np.asarray([sides.index(s) for s in rows.side.iloc[index]], np.int64)
        lender = borrowed[index]
        based = index[lender >= 0]
        for module in modules:
            name = module.NAME
            got = score_layer(table, keys, name, side_index, [rules[i] for i in index],
                              [rules[j] if j >= 0 else None for j in lender], per_band=per_band, seed=seed,
                              n_boot=n_boot, max_quiet=max_quiet)
            scored.loc[index, name], scored.loc[index, f"{name}_low"] = got.score, got.low
            scored.loc[index, f"{name}_high"] = got.high
            scored.loc[index, f"{name}_n"] = got.n.astype(scored[f"{name}_n"].dtype)
            scored.loc[index, f"{name}_judge"] = judge_label
            for i, codes in zip(index.tolist(), got.codes):
                scored.at[i, f"{name}_codes"] = list(codes)
            mask = lender >= 0
            scored.loc[based, f"{name}_baseline"] = got.baseline[mask]
            scored.loc[based, f"{name}_baseline_low"] = got.baseline_low[mask]
            scored.loc[based, f"{name}_baseline_high"] = got.baseline_high[mask]
            scored.loc[index, f"{name}_baseline_from"] = np.where(mask, neuron_col[np.maximum(lender, 0)], -1).astype(
                scored[f"{name}_baseline_from"].dtype)
        store.write(atlas.path, store.upsert(store.read(atlas.path), scored.iloc[index]))


def _random_init_scores(atlas, rows: pd.DataFrame, *, scorers, judge: str, seed: int, held_out: float,
                        per_band: int, max_quiet: int | None, n_boot: int, options, progress: bool) -> pd.DataFrame:
    """``rows`` with S_random_init (and interval): the same explainer, scorers and judge on the same neuron sides
    of the random-init sibling atlas (:func:`kvmem.autointerp.randominit.random_init_atlas`)."""
    sibling = random_init_atlas(atlas, seed=seed, progress=progress)
    out = rows.copy()
    for name, group in rows.groupby("explainer"):
        if str(name).startswith("user:"):
            continue  # a user's text explains the trained neuron; the copy has no explanation of its own
        pairs = sorted(set(zip(group.layer.astype(int), group.neuron.astype(int))))
        explain(sibling, neurons=pairs, explainer=str(name), seed=seed, held_out=held_out, options=options)
        other = score(sibling, scorers=scorers, judge=judge, explainer=str(name), neurons=pairs, seed=seed,
                      held_out=held_out, per_band=per_band, max_quiet=max_quiet, n_boot=n_boot, options=options)
        index = {(int(r.layer), int(r.neuron), r.side): r for r in other.itertuples(index=False)}
        for i in group.index:
            match = index.get((int(rows.layer[i]), int(rows.neuron[i]), rows.side[i]))
            if match is None:
                continue
            for s in scorers:
                for suffix in ("", "_low", "_high"):
                    out.at[i, f"{s}_random_init{suffix}"] = getattr(match, f"{s}{suffix}")
    return out
