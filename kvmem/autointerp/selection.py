"""Which neurons a command means: ``layers``, ``neurons`` [(layer, neuron)], or every one of the atlas."""

from __future__ import annotations

from kvmem.errors import KvmemError

__all__ = ["select_neurons", "parse_neurons"]


def parse_neurons(text: str) -> list[tuple[int, int]]:
    """``"3:17,5:2"`` -> [(3, 17), (5, 2)]."""
    out = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        try:
            layer, neuron = (int(x) for x in part.split(":"))
        except ValueError:
            raise KvmemError(f"expected LAYER:NEURON pairs separated by commas (e.g. 3:17,5:2), got {part!r}") from None
        out.append((layer, neuron))
    return out


def select_neurons(atlas, *, layers=None, neurons=None, all: bool = False) -> list[tuple[int, int]]:
    """(layer, neuron) pairs, checked against the atlas, in (layer, neuron) order without repeats."""
    if not all and layers is None and neurons is None:
        raise KvmemError("say which neurons to explain: layers=[...] (--layers), neurons=[(L, N)] (--neurons L:N,...) "
                         "or all=True (--all)")
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
