"""Which neurons a command means: ``layers``, ``neurons`` [(layer, neuron)], or every one of the atlas."""

from __future__ import annotations

from kvmem.errors import KvmemError

__all__ = ["select_neurons"]


def select_neurons(atlas, *, layers=None, neurons=None, all: bool = False) -> list[tuple[int, int]]:
    """(layer, neuron) pairs, checked against the atlas, in (layer, neuron) order without repeats."""
    if not all and layers is None and neurons is None:
        raise KvmemError("say which neurons to explain: layers=[...] (--layers), neurons=[(L, N)] (--neurons L:N,...) "
                         "or all=True (--all)")
    if all and (layers is not None or neurons is not None):
        raise KvmemError("all=True (--all) means every neuron of the atlas; drop it to keep only the layers or neurons "
                         "given, or drop those to keep every neuron")
    chosen = []
    if all:
        layers = atlas.layers
    for layer in layers or ():
        atlas.check(int(layer))
        chosen.extend((int(layer), n) for n in range(atlas.d_ff))
    for layer, neuron in neurons or ():
        atlas.check(int(layer), int(neuron))
        chosen.append((int(layer), int(neuron)))
    return sorted(set(chosen))
