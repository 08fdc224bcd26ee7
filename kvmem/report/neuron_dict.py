"""One neuron as plain data: the ``kvmem.neuron/1`` schema (the JSON report; HTML and Markdown render it).

Every string is cleaned (lone surrogates -> U+FFFD) but otherwise kept as it is: renderers escape.
Numbers are JSON numbers; NaN and infinities are ``null``. Fields::

    schema        "kvmem.neuron/1"
    layer, neuron int: FFN layer and neuron i
    provenance    {model, fingerprint, corpus, tokens, convention (the default one), conventions
                   (name -> definition, every stored convention), kvmem_version (that wrote the atlas),
                   exported_with (kvmem version that wrote this report), gated (bool), activation (str),
                   vocab_size (int), atlas (directory name)}
    stats         {count, mean, std, min, max, frac_positive, key_norm, gate_norm, value_norm}
                  (columns of kvmem.schema.COLUMNS["neurons"])
    histogram     {edges: [bins + 1] floats (outer edges null = unbounded), counts: [bins] ints}
    triggers      {kind: [trigger, ...]} for each kind stored (top, bottom, top_doc, bottom_doc), by rank;
                  trigger = {rank, activation, doc_id, pos, token, token_id, next_token, next_token_id
                  (-1 at a document's end), context, span: [start, end) in context, context_tokens: [str],
                  context_trigger: int, context_activations: [float] (empty if not computed)}
    values        {convention: {promote: [entry], suppress: [entry]}}, entry = {rank, token, token_id, score}
    keys          {vector ("key" | "gate"): {promote: [entry], suppress: [entry]}} (score = W_E[token] . k)
    agreement     [{convention, triggers ("top" | "bottom"), tokens ("promote" | "suppress"), top_n, checked,
                   fraction (hits / checked, null if none checked), chance (top_n / vocab_size),
                   hits: [{trigger_rank, next_token, next_token_id, value_rank}]}]
                  Does the value promote what follows the key's top triggers (and, since m < 0 flips
                  the value, suppress what follows its bottom triggers)? Triggers at a document's end
                  and bottom triggers with m >= 0 are not checked.
    quantiles     [{levels: [low, high] quantile levels (QUANTILE_LEVELS), low, high: coefficient bounds of the
                   band's histogram bins (null: unbounded or empty band), samples: [sample]}] from
                  Atlas.quantile_samples; sample = {rank, activation, doc_id, pos, token, context, span,
                  context_tokens, context_trigger, context_activations: [] (not stored for these samples)};
                  [] when the atlas holds no samples
    taxonomy      the neuron's row of the atlas's taxonomy table (kvmem.taxonomy.table.COLUMNS), column -> value,
                  present only when the atlas has one (``kvmem taxonomy --atlas A`` writes it)
    explanations  [explanation] from the atlas's explanations.parquet (kvmem explain / kvmem score), [] if none;
                  explanation = {layer, neuron, side, explainer, explainer_model, prompt_version, prompt_hash, text,
                  rule (JSON or null), scores: {scorer: {score, low, high, p, n, n_quiet, status, protocol, judge,
                  baseline, baseline_low, baseline_high, baseline_from, diff_low, diff_high, random_init,
                  random_init_low, random_init_high, random_init_population: {n, q1, median, q3, share_below} or
                  null, random_init_text}}} (kvmem.autointerp.display.explanation_dicts)
"""

from __future__ import annotations

import math
import os

import numpy as np

from kvmem import __version__
from kvmem.conventions import CONVENTIONS
from kvmem.report.safe_text import clean
from kvmem.schema import KEY_VECTORS, TRIGGER_KINDS

__all__ = ["SCHEMA", "neuron_data"]

SCHEMA = "kvmem.neuron/1"
QUANTILE_LEVELS = (0.0, 0.5, 0.9, 0.99, 0.999, 1.0)  # the bands of OpenAI's neuron viewer
QUANTILE_SAMPLES = 3  # samples shown per band
_STATS = ("count", "mean", "std", "min", "max", "frac_positive", "key_norm", "gate_norm", "value_norm")


def _number(value):
    """A JSON-safe number: ints stay ints, floats keep float32 precision, NaN and infinities -> None."""
    if value is None or isinstance(value, (bool, np.bool_)):
        return value if value is None else bool(value)
    if isinstance(value, (int, np.integer)):
        return int(value)
    value = float(value)
    return float(f"{value:.7g}") if math.isfinite(value) else None


def neuron_data(atlas, layer: int, neuron: int, *, record=None, explanations=None, population=None) -> dict:
    """The ``kvmem.neuron/1`` dict of one neuron (``record``: its :class:`NeuronRecord`, if already read;
    ``explanations``: its rows of the explanations table, if already read; ``population``: the rows of its
    layer, for the random-init population of each score)."""
    record = record if record is not None else atlas.neuron(layer, neuron)
    manifest = atlas.manifest
    model = manifest.model
    provenance = record.provenance
    data = {
        "schema": SCHEMA,
        "layer": int(layer),
        "neuron": int(neuron),
        "provenance": {
            "model": clean(provenance["model"]),
            "fingerprint": clean(provenance["fingerprint"]),
            "corpus": clean(provenance["corpus"]),
            "tokens": int(provenance["tokens"]),
            "convention": provenance["convention"],
            "conventions": {name: CONVENTIONS[name].formula if name in CONVENTIONS else ""
                            for name in atlas.conventions},
            "kvmem_version": clean(provenance["kvmem_version"]),
            "exported_with": __version__,
            "gated": bool(model.get("gated", False)),
            "activation": clean(model.get("activation_description") or model.get("activation", "")),
            "vocab_size": int(model.get("vocab_size", 0)),
            "atlas": clean(os.path.basename(os.path.normpath(str(atlas.path)))),
        },
        "stats": {name: _number(record.stats[name]) for name in _STATS if name in record.stats},
        "histogram": {
            "edges": [_number(e) for e in [*record.histogram["low"], record.histogram["high"].iloc[-1]]],
            "counts": [int(c) for c in record.histogram["count"]],
        },
        "triggers": _triggers(record.triggers),
        "values": _projections(record.values, "convention", order=atlas.conventions),
        "keys": _projections(record.keys, "vector", order=KEY_VECTORS),
    }
    data["agreement"] = agreement(data)
    data["quantiles"] = _quantiles(atlas, layer, neuron)
    taxonomy = _taxonomy(atlas, layer, neuron)
    if taxonomy is not None:
        data["taxonomy"] = taxonomy
    data["explanations"] = _explanations(atlas, layer, neuron, explanations, population)
    return data


def _taxonomy(atlas, layer: int, neuron: int) -> dict | None:
    from kvmem.taxonomy.table import FILE

    if not (atlas.path / FILE).exists():
        return None
    frame = atlas.taxonomy
    row = frame[(frame.layer.to_numpy() == layer) & (frame.neuron.to_numpy() == neuron)]
    if not len(row):
        return None
    return {name: (clean(value) if isinstance(value, str) else _number(value)) for name, value in row.iloc[0].items()
            if name not in ("layer", "neuron")}


def _explanations(atlas, layer: int, neuron: int, frame=None, population=None) -> list[dict]:
    """The neuron's explanations (``frame``: its rows, if already read) with the random-init population of its
    layer (``population``: the layer's rows, read here when neither is given)."""
    from kvmem.autointerp.display import explanation_dicts

    if frame is None:
        frame = atlas.explanations(layer, neuron)
        population = atlas.explanations(layer) if population is None else population
    rows = explanation_dicts(frame, population=population)
    return [{k: clean(v) if isinstance(v, str) else v for k, v in row.items()} for row in rows]


def _quantiles(atlas, layer: int, neuron: int) -> list[dict]:
    if not atlas.holds("samples"):
        return []
    bands = atlas.quantile_samples(layer, neuron, levels=QUANTILE_LEVELS, per_band=QUANTILE_SAMPLES)
    out = []
    for i, frame in enumerate(bands):
        low, high = (frame.band_low.iloc[0], frame.band_high.iloc[0]) if len(frame) else (None, None)
        out.append({"levels": [QUANTILE_LEVELS[i], QUANTILE_LEVELS[i + 1]], "low": _number(low), "high": _number(high),
                    "samples": [{"rank": int(row.rank), "activation": _number(row.activation), "doc_id": clean(row.doc_id),
                                 "pos": int(row.pos), "token": clean(row.token), "context": clean(row.context),
                                 "span": [int(row.span_start), int(row.span_end)],
                                 "context_tokens": [clean(t) for t in _list(row.context_tokens)],
                                 "context_trigger": int(row.context_trigger), "context_activations": []}
                                for row in _rows(frame)]})
    return out


def _triggers(frame) -> dict:
    out: dict[str, list[dict]] = {}
    for row in _rows(frame.sort_values(["kind", "rank"])):
        out.setdefault(row.kind, []).append({
            "rank": int(row.rank),
            "activation": _number(row.activation),
            "doc_id": clean(row.doc_id),
            "pos": int(row.pos),
            "token": clean(row.token),
            "token_id": int(row.token_id),
            "next_token": clean(row.next_token),
            "next_token_id": int(row.next_token_id),
            "context": clean(row.context),
            "span": [int(row.span_start), int(row.span_end)],
            "context_tokens": [clean(t) for t in _list(row.context_tokens)],
            "context_trigger": int(row.context_trigger),
            "context_activations": [_number(a) for a in _list(row.context_activations)],
        })

    return {kind: out[kind] for kind in TRIGGER_KINDS if kind in out}


def _rows(frame):
    """A frame's rows with attribute access, like ``itertuples`` without building a namedtuple class per call
    (about 3 ms each, a third of a neuron's record)."""
    from types import SimpleNamespace

    names = list(frame.columns)
    for values in zip(*(frame[name].to_numpy() for name in names)):
        yield SimpleNamespace(**dict(zip(names, values)))


def _list(value) -> list:
    return [] if value is None else list(value)


def _projections(frame, label: str, *, order=()) -> dict:
    out: dict[str, dict[str, list[dict]]] = {}
    for row in _rows(frame.sort_values([label, "kind", "rank"])):
        group = out.setdefault(getattr(row, label), {"promote": [], "suppress": []})
        group.setdefault(row.kind, []).append({"rank": int(row.rank), "token": clean(row.token),
                                               "token_id": int(row.token_id), "score": _number(row.score)})
    return {name: out[name] for name in sorted(out, key=lambda n: (list(order).index(n) if n in order else len(order), n))}


def agreement(data: dict) -> list[dict]:
    """Next tokens of the top (bottom) triggers found among the value's promoted (suppressed) tokens."""
    vocab = data["provenance"]["vocab_size"]
    rows = []
    for convention, groups in data["values"].items():
        for trigger_kind, token_kind in (("top", "promote"), ("bottom", "suppress")):
            ranks = {entry["token_id"]: entry["rank"] for entry in groups.get(token_kind, [])}
            triggers = [t for t in data["triggers"].get(trigger_kind, []) if t["next_token_id"] >= 0
                        and (trigger_kind == "top" or (t["activation"] or 0) < 0)]
            hits = [{"trigger_rank": t["rank"], "next_token": t["next_token"], "next_token_id": t["next_token_id"],
                     "value_rank": ranks[t["next_token_id"]]} for t in triggers if t["next_token_id"] in ranks]
            rows.append({"convention": convention, "triggers": trigger_kind, "tokens": token_kind,
                         "top_n": len(ranks), "checked": len(triggers),
                         "fraction": _number(len(hits) / len(triggers)) if triggers else None,
                         "chance": _number(len(ranks) / vocab) if vocab else None, "hits": hits})
    return rows
