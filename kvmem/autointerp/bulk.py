"""The evidence of many neurons of one layer at once.

An atlas's layer is read once per table by :func:`kvmem.autointerp.layertable.read_layer`; where the atlas
lacks what that reads (an atlas scanned without context coefficients), each neuron's sides come from the
atlas's per-neuron queries (:func:`kvmem.autointerp.evidence.load_evidence`). Both give equal evidence (a
test checks it).
"""

from __future__ import annotations

from kvmem.autointerp.evidence import load_evidence, neuron_sides
from kvmem.autointerp.layertable import read_contexts, read_layer

__all__ = ["layer_evidence"]


def layer_evidence(atlas, layer: int, neurons, *, sides=None, seed: int, held_out: float,
                   convention: str | None = None, contexts=None) -> dict[int, list]:
    """neuron -> its sides' :class:`~kvmem.autointerp.evidence.SideEvidence`, for ``neurons`` of ``layer``.
    ``contexts``: :func:`~kvmem.autointerp.layertable.read_contexts` of the atlas, if the caller has it."""
    neurons = sorted({int(n) for n in neurons})
    for n in neurons:
        atlas.check(layer, n)
    convention = convention or atlas.default_convention
    chosen = neuron_sides(atlas, sides)
    contexts = contexts or read_contexts(atlas)
    if contexts is None:
        return {n: load_evidence(atlas, layer, n, sides=chosen, seed=seed, held_out=held_out, convention=convention)
                for n in neurons}
    table = read_layer(atlas, layer, neurons, sides=chosen, seed=seed, held_out=held_out, convention=convention,
                       contexts=contexts)
    found = table.sides()
    return {n: found[i * len(chosen):(i + 1) * len(chosen)] for i, n in enumerate(neurons)}
