"""One neuron as the explorer shows it: the ``kvmem.neuron/1`` record plus what the page adds.

The record (:func:`kvmem.report.neuron_dict.neuron_data`) is the same data the JSON report holds: statistics,
histogram, triggers with their context coefficients, value and key projections, agreement, quantile
samples, taxonomy row and explanations. The page adds the random samples, the gate/up sign quadrants of
a gated neuron (the scan's counts and each trigger's own quadrant), the robust shading scale
(:mod:`kvmem.shading`) and the links to neighbouring neurons. Everything is read for this neuron alone:
one row group of each table.
"""

from __future__ import annotations

import math

from kvmem.report.neuron_dict import neuron_data
from kvmem.shading import Scale, cells, robust_scale

__all__ = ["SCHEMA", "neuron_view", "neuron_record", "context_cells", "QUADRANTS"]

SCHEMA = "kvmem.explorer.neuron/1"
QUADRANTS = {"pp": "gate > 0, up > 0", "pn": "gate > 0, up ≤ 0", "np": "gate ≤ 0, up > 0", "nn": "gate ≤ 0, up ≤ 0"}


def _number(value):
    if value is None:
        return None
    value = float(value)
    return float(f"{value:.7g}") if math.isfinite(value) else None


def _quadrant(gate: float | None, up: float | None) -> str | None:
    if gate is None or up is None or not (math.isfinite(gate) and math.isfinite(up)):
        return None
    return ("p" if gate > 0 else "n") + ("p" if up > 0 else "n")


def neuron_view(snapshot, layer: int, neuron: int, live=None) -> dict:
    """Everything the neuron page shows, as JSON-ready data (schema :data:`SCHEMA`). ``live``: the server's
    model (:class:`kvmem.explorer.live.LiveModel`), which computes the value and key projections of an atlas
    that holds no projection tables (when it is ready and has the scanned weights)."""
    snapshot.check_neuron(layer, neuron)
    atlas = snapshot.atlas
    record, note = neuron_record(snapshot, layer, neuron, live)
    explained = snapshot.explanations
    data = neuron_data(atlas, layer, neuron, record=record, explanations=snapshot.explanations_of(layer, neuron),
                       population=explained[explained.layer.to_numpy() == layer])
    triggers = data["triggers"]
    scale = robust_scale([t["activation"] for t in triggers.get("top", [])],
                         [t["activation"] for t in triggers.get("bottom", [])])
    frame = record.triggers
    if "gate_pre" in frame:  # each trigger's gate / up pre-activation (gated FFNs with taxonomy sums)
        pre = {(kind, int(rank)): (_number(gate), _number(up)) for kind, rank, gate, up in
               zip(frame["kind"].to_numpy(), frame["rank"].to_numpy(), frame["gate_pre"].to_numpy(), frame["up_pre"].to_numpy())}
        for kind, rows in triggers.items():
            for t in rows:
                gate, up = pre.get((kind, t["rank"]), (None, None))
                t["gate_pre"], t["up_pre"], t["quadrant"] = gate, up, _quadrant(gate, up)
    view = {"schema": SCHEMA, "atlas_id": snapshot.id, "neuron": data, "scale": scale.to_dict(), "projections": note,
            "random_samples": _random_samples(snapshot, layer, neuron), "quadrants": _quadrants(data, record.stats),
            "links": _links(snapshot, layer, neuron)}
    return view


def neuron_record(snapshot, layer: int, neuron: int, live):
    """(the neuron's record, how its projections were got): read from the tables; computed on demand with the
    server's model; or left empty, saying why."""
    atlas = snapshot.atlas
    if atlas.has_projections:
        return atlas.neuron(layer, neuron), None
    status = live.status() if live is not None else {"state": "off"}
    if status["state"] == "ready" and status["fingerprint_match"]:
        with live.use() as model:
            return atlas.neuron(layer, neuron, model=model), "computed on demand from the model"
    why = {"loading": "the model is still loading; reload this page once it is ready",
           "ready": "the server's model has other weights than the scanned ones",
           "failed": f"the model could not be loaded ({status.get('message')})"}.get(
        status["state"], "this server runs without a model")
    return (atlas.neuron(layer, neuron, projections=False),
            f"this atlas holds no projection tables and {why}; write them with: kvmem project --atlas {atlas.path}")


def _random_samples(snapshot, layer: int, neuron: int) -> list[dict]:
    from kvmem.report.safe_text import clean

    if not snapshot.has("samples"):
        return []
    frame = snapshot.atlas.samples(layer, neuron, kind="random")
    return [{"rank": int(row["rank"]), "activation": _number(row["activation"]), "doc_id": clean(row["doc_id"]),
             "pos": int(row["pos"]), "token": clean(row["token"]),
             "context_tokens": [clean(t) for t in (row["context_tokens"] if row["context_tokens"] is not None else [])],
             "context_trigger": int(row["context_trigger"]),
             "context_activations": [_number(a) for a in (row["context_activations"]
                                                          if row["context_activations"] is not None else [])]}
            for row in frame.sort_values("rank").to_dict("records")]


def _quadrants(data: dict, stats: dict) -> dict | None:
    """Shares of the scanned positions in each gate/up sign quadrant (gated FFNs with taxonomy sums), and how
    many kept top / bottom triggers fall in each."""
    if not data["provenance"]["gated"]:
        return None
    counts = {q: stats.get(f"quadrant_{q}") for q in QUADRANTS}
    if any(c is None or (isinstance(c, float) and not math.isfinite(c)) for c in counts.values()):
        return None
    total = sum(int(c) for c in counts.values()) or 1
    out = {"definition": "signs of the gate pre-activation g·x and the up pre-activation u·x; m = act(g·x)·(u·x)",
           "rows": []}
    for q, label in QUADRANTS.items():
        row = {"quadrant": q, "label": label, "positions": int(counts[q]), "share": int(counts[q]) / total}
        for kind in ("top", "bottom"):
            row[f"{kind}_triggers"] = sum(1 for t in data["triggers"].get(kind, []) if t.get("quadrant") == q)
        out["rows"].append(row)
    return out


def _links(snapshot, layer: int, neuron: int) -> dict:
    layers = snapshot.layers
    at = layers.index(layer)
    return {
        "previous_layer": [layers[at - 1], neuron] if at > 0 else None,
        "next_layer": [layers[at + 1], neuron] if at + 1 < len(layers) else None,
        "previous_neuron": [layer, neuron - 1] if neuron > 0 else None,
        "next_neuron": [layer, neuron + 1] if neuron + 1 < snapshot.d_ff else None,
    }


def context_cells(row: dict, scale: Scale) -> list:
    """A trigger or sample's context as :class:`kvmem.shading.Cell` s (only the sampled token's m when the
    context coefficients were not stored)."""
    tokens = row.get("context_tokens") or []
    if not tokens:
        return []
    return cells(tokens, row.get("context_activations") or [], row.get("context_trigger", -1), scale,
                 trigger_value=row.get("activation"))


def scale_of(view: dict) -> Scale:
    s = view["scale"]
    return Scale(positive=s["positive"], negative=s["negative"], rule=s["rule"])
