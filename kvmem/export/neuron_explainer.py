"""The ``neuron-explainer`` format: OpenAI automated-interpretability's ``NeuronRecord`` JSON.

Written to match ``neuron-explainer/neuron_explainer/activations/activations.py`` (openai/
automated-interpretability): its ``fast_dataclasses.loads`` builds each dict whose
``dataclass_name`` is a registered class with ``cls(**fields)``, so every object carries
``dataclass_name`` and exactly that class's fields, in the class's order::

    DIR/neurons/<layer>/<neuron>.json   NeuronRecord {dataclass_name, neuron_id: NeuronId {layer_index,
        neuron_index}, random_sample: [ActivationRecord {tokens: [str], activations: [float]}],
        random_sample_by_quantile: [[ActivationRecord]] | null, quantile_boundaries: [float] | null,
        mean, variance, skewness, kurtosis, most_positive_activation_records: [ActivationRecord]}
    DIR/kvmem/<layer>/<neuron>.json     what NeuronRecord has no field for (its loader would refuse
        extra keys): most_negative_activation_records, stdev, each record's source and position, and the
        neuron's explanations with their scores, intervals and baselines (``explanations``, [] if none)
    DIR/metadata.json                   the atlas, quantile levels, how each number was computed

- most_positive_activation_records: the top triggers (highest m_i first); most_negative: the bottom
  triggers (lowest first). Coefficients are signed: a record with m_i < 0 writes -|m_i| v_i, so the
  most negative records illustrate the memory -v_i (the second direction of a gated neuron).
- random_sample: the layer's uniform random sample of positions (context coefficients stored).
- random_sample_by_quantile: ``per_band`` uniform samples of each band between the quantile levels
  (0, 0.5, 0.9, 0.99, 0.999, 1) as in OpenAI's viewer, bands made of whole histogram bins; their
  context coefficients are computed with the scanned model (:mod:`kvmem.records`).
- quantile_boundaries: the coefficient where each band after the first starts (lower edge of its
  first non-empty histogram bin, clamped to the observed range): levels 0.5, 0.9, 0.99, 0.999.
- mean, variance: exact (population) from the scan's double-double sums. skewness, excess kurtosis
  (normal = 0): estimated by strata, each histogram bin weighted by its exact count and represented by
  its kept bin sample (its clamped midpoint if it kept none); the scan keeps no third or fourth sums.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from kvmem import __version__
from kvmem.atlas_origin import check_model, load_scanned_model
from kvmem.errors import KvmemError
from kvmem.records import activation_records

__all__ = ["write", "LEVELS", "moments", "band_boundaries"]

LEVELS = (0.0, 0.5, 0.9, 0.99, 0.999, 1.0)
SOURCE = "openai/automated-interpretability neuron-explainer/neuron_explainer/activations/activations.py"


def write(atlas, out: Path, neurons: list[tuple[int, int]], *, model=None, corpus=None, progress: bool = False,
          quantiles: bool = True, per_band: int = 5, levels=LEVELS, chunk: int = 256) -> dict:
    """Write one NeuronRecord (and its kvmem sidecar) per neuron; return the export's metadata.

    ``quantiles=False`` writes ``random_sample_by_quantile`` and ``quantile_boundaries`` as null (no model
    needed). Otherwise ``model`` is the scanned model, or None to load it by the manifest's name; the
    context coefficients of ``chunk`` neurons' quantile samples are computed in one pass over the corpus.
    """
    from tqdm import tqdm

    if not isinstance(per_band, int) or per_band < 1:
        raise KvmemError(f"per_band must be an integer >= 1, got {per_band!r}")
    levels = tuple(float(level) for level in levels)
    needs_model = quantiles or not atlas.manifest.scan.get("context_activations", True)
    if needs_model and model is None:
        try:
            model = load_scanned_model(atlas)
        except (KvmemError, OSError) as error:
            raise KvmemError(f"quantile samples need the scanned model for their context coefficients and "
                             f"{atlas.manifest.model['name']!r} could not be loaded ({str(error).splitlines()[0]}); "
                             f"pass --model DIR (model=), or --no-quantiles to write them as null") from None
    if model is not None:
        check_model(atlas, model)
    bar = tqdm(total=len(neurons), desc="neurons", unit="neuron", disable=not progress)
    for begin in range(0, len(neurons), chunk):
        part = neurons[begin:begin + chunk]
        bands = {pair: atlas.quantile_samples(*pair, levels=levels, per_band=per_band) for pair in part} \
            if quantiles else {}
        frames = [frame for pair in part for frame in bands.get(pair, [])]
        flat = activation_records(atlas, _concat(frames), model=model, corpus=corpus) if frames else []
        cursor = 0
        for layer, neuron in part:
            by_band = None
            if quantiles:
                by_band = []
                for frame in bands[(layer, neuron)]:
                    by_band.append(flat[cursor:cursor + len(frame)])
                    cursor += len(frame)
            _write_neuron(atlas, out, layer, neuron, by_band, model=model, corpus=corpus, levels=levels)
            bar.update()
    bar.close()
    return _metadata(atlas, neurons, quantiles=quantiles, per_band=per_band, levels=levels)


def _concat(frames):
    import pandas as pd

    return pd.concat(frames, ignore_index=True)


def _write_neuron(atlas, out: Path, layer: int, neuron: int, by_band, *, model, corpus, levels) -> None:
    stats = atlas.neurons.iloc[atlas.layers.index(layer) * atlas.d_ff + neuron]
    top = activation_records(atlas, atlas.triggers(layer, neuron, kind="top"), model=model, corpus=corpus)
    bottom = activation_records(atlas, atlas.triggers(layer, neuron, kind="bottom"), model=model, corpus=corpus)
    random = activation_records(atlas, atlas.samples(layer, neuron, kind="random"), model=model, corpus=corpus)
    histogram = atlas.histogram(layer, neuron)
    bins = atlas.samples(layer, neuron, kind="bin")
    mean, variance, skewness, kurtosis = moments(stats, histogram, bins)
    boundaries = band_boundaries(stats, histogram, levels) if by_band is not None else None
    record = {  # field order of NeuronRecord
        "dataclass_name": "NeuronRecord",
        "neuron_id": {"dataclass_name": "NeuronId", "layer_index": layer, "neuron_index": neuron},
        "random_sample": [_record(r) for r in random],
        "random_sample_by_quantile": None if by_band is None else [[_record(r) for r in band] for band in by_band],
        "quantile_boundaries": boundaries,
        "mean": _float(mean), "variance": _float(variance), "skewness": _float(skewness), "kurtosis": _float(kurtosis),
        "most_positive_activation_records": [_record(r) for r in top],
    }
    lists = {"most_positive_activation_records": top, "most_negative_activation_records": bottom,
             "random_sample": random}
    sidecar = {
        "layer": layer, "neuron": neuron, "stdev": _float(math.sqrt(variance)) if variance == variance else None,
        "most_negative_activation_records": [_record(r) for r in bottom],
        "sign": {"most_positive_activation_records": "+v (top triggers, highest m first)",
                 "most_negative_activation_records": "-v when m < 0 (bottom triggers, lowest m first)",
                 "random_sample": "signed m", "random_sample_by_quantile": "signed m"},
        "positions": {name: [_position(r) for r in rows] for name, rows in lists.items()},
    }
    sidecar["explanations"] = _explanations(atlas, layer, neuron)
    if by_band is not None:
        sidecar["positions"]["random_sample_by_quantile"] = [[_position(r) for r in band] for band in by_band]
        sidecar["quantile_bands"] = [{"levels": [levels[i], levels[i + 1]], "samples": len(band)}
                                     for i, band in enumerate(by_band)]
    for folder, data in (("neurons", record), ("kvmem", sidecar)):
        path = out / folder / str(layer) / f"{neuron}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, ensure_ascii=False, allow_nan=False), encoding="utf-8", errors="replace")


def _explanations(atlas, layer: int, neuron: int) -> list[dict]:
    """The neuron's stored explanations with their scores (kvmem explain / kvmem score), [] if none."""
    from kvmem.autointerp.display import explanation_dicts

    return explanation_dicts(atlas.explanations(layer, neuron))


def _record(r) -> dict:
    return {"dataclass_name": "ActivationRecord", "tokens": list(r.tokens),
            "activations": [_float32(a) for a in r.activations]}


def _position(r) -> dict:
    return {"source": r.source, "rank": r.rank, "doc": r.doc, "doc_id": r.doc_id, "pos": r.pos, "index": r.index,
            "activation": _float32(r.activation), "computed": r.computed}


def _float32(value) -> float | None:
    """The shortest decimal that reads back as the same float32; NaN and infinities -> None."""
    value = np.float32(value)
    return float(str(value)) if np.isfinite(value) else None


def _float(value) -> float | None:
    value = float(value)
    return value if math.isfinite(value) else None


def moments(stats, histogram, bin_samples) -> tuple[float, float, float, float]:
    """(mean, variance, skewness, excess kurtosis) of one neuron's coefficients.

    mean and variance exact (``stats``: a row of ``atlas.neurons``); skewness and kurtosis estimated by
    strata over the histogram bins (count-weighted; each bin's values from its kept samples, else its
    midpoint clamped to [min, max]). NaN when the variance is 0 or nothing was scanned.
    """
    mean, std = float(stats["mean"]), float(stats["std"])
    low_clip, high_clip = float(stats["min"]), float(stats["max"])
    counts = histogram["count"].to_numpy().astype(np.float64)
    total = counts.sum()
    if total <= 0 or not std > 0:
        return mean, std * std, math.nan, math.nan
    m3 = m4 = 0.0
    for b in np.flatnonzero(counts):
        values = bin_samples.activation.to_numpy()[bin_samples["bin"].to_numpy() == b].astype(np.float64)
        if not len(values):
            low = min(max(float(histogram.low.iloc[b]), low_clip), high_clip)
            high = min(max(float(histogram.high.iloc[b]), low_clip), high_clip)
            values = np.array([(low + high) / 2])
        d = values - mean
        m3 += counts[b] / total * float(np.mean(d ** 3))
        m4 += counts[b] / total * float(np.mean(d ** 4))
    return mean, std * std, m3 / std ** 3, m4 / std ** 4 - 3.0


def band_boundaries(stats, histogram, levels) -> list[float]:
    """Coefficient where each band after the first starts: lower edge of its first non-empty bin (bins are
    assigned to bands as :meth:`Atlas.quantile_samples` does), clamped to [min, max]."""
    counts = histogram["count"].to_numpy()
    cumulative = counts.cumsum() / max(int(counts.sum()), 1)
    before = np.concatenate([[0.0], cumulative[:-1]])
    band_of_bin = np.searchsorted(np.asarray(levels[1:-1]), before, side="right")
    low_clip, high_clip = float(stats["min"]), float(stats["max"])
    out = []
    for band in range(1, len(levels) - 1):
        bins = np.flatnonzero((band_of_bin >= band) & (counts > 0))
        edge = float(histogram.low.iloc[bins[0]]) if len(bins) else high_clip
        out.append(_float32(min(max(edge, low_clip), high_clip)))
    return out


def _metadata(atlas, neurons, *, quantiles: bool, per_band: int, levels) -> dict:
    m = atlas.manifest
    return {
        "format": "neuron-explainer",
        "record_class": f"NeuronRecord of {SOURCE}",
        "files": {"neurons/<layer>/<neuron>.json": "NeuronRecord (load with neuron_explainer.fast_dataclasses.loads)",
                  "kvmem/<layer>/<neuron>.json": "most_negative_activation_records, stdev, record positions, "
                                                 "explanations (kvmem explain) with scores"},
        "exported_with": __version__,
        "atlas": {"model": m.model["name"], "fingerprint": m.model["fingerprint"], "gated": m.model.get("gated"),
                  "corpus": m.corpus["spec"], "tokens": m.tokens, "kvmem_version": m.kvmem_version},
        "neurons": len(neurons), "layers": sorted({layer for layer, _ in neurons}),
        "records": {"tokens": f"the stored context: up to {m.scan['context_before']} tokens before and "
                              f"{m.scan['context_after']} after the kept token, inside the window the model read",
                    "activations": "signed coefficient m_i (hook_post) at each token"},
        "most_positive_activation_records": "top triggers, highest m_i first (memory +v_i)",
        "most_negative_activation_records": "in kvmem/: bottom triggers, lowest m_i first (memory -v_i when m_i < 0)",
        "random_sample": f"the layer's uniform random sample of {m.scan.get('random_samples')} positions",
        "random_sample_by_quantile": (f"{per_band} uniform samples per band between quantile levels {list(levels)}; "
                                      "bands of whole histogram bins; context coefficients computed with the model"
                                      if quantiles else None),
        "quantile_boundaries": ("coefficient where each band after the first starts (lower edge of its first "
                                "non-empty histogram bin)" if quantiles else None),
        "moments": {"mean": "exact", "variance": "exact, population",
                    "skewness": "estimated: histogram bins weighted by exact counts, values from the bin samples",
                    "kurtosis": "excess (normal = 0), estimated like skewness"},
    }
