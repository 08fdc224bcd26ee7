"""Options that several subcommands share, parsed in one place so they behave the same everywhere.

``--atlas DIR``: every command that reads an atlas takes it this way.

``--neurons`` (neuron, report, export, explain, score): neuron ids ``LAYER:NEURON`` (``3:17``), as kvmem
prints them, separated by commas or spaces (``3:17,5:2`` or ``3:17 5:2``), with inclusive ranges of
neurons of one layer (``3:10-12``). The result keeps the order given, each neuron once. A malformed id,
a range written backwards and a number above :data:`MAX_NEURON` are one-line errors; whether the
neuron exists is checked by each command against its atlas or model.

``--layers`` (scan, export, experiment, explain, score, report): comma-separated layers and inclusive ranges, ``0,5,10-12``.
The result is sorted and each layer appears once (``3,1-2,2`` -> [1, 2, 3]). Text that is not of this
form, a range written backwards and a value that names no layer are one-line errors
(:class:`~kvmem.errors.KvmemError`), raised when the command runs so the CLI prints them without a
traceback. Whether a layer exists is checked by each command against its model or atlas; only layers
above :data:`MAX_LAYER` are refused here, so that a typo such as ``0-99999999`` is not expanded.
"""

from __future__ import annotations

import argparse
import re

from kvmem.errors import KvmemError

__all__ = ["LAYERS_FORM", "NEURONS_FORM", "MAX_LAYER", "MAX_NEURON", "add_layers_option", "add_neurons_option",
           "add_atlas_option", "parse_layers", "parse_neurons", "neuron_id"]

LAYERS_FORM = "comma-separated layers or ranges like 0,5,10-12"
NEURONS_FORM = "neuron ids LAYER:NEURON separated by commas or spaces, like 3:17,5:2 or 3:10-12"
MAX_LAYER = 9_999  # far above any model's depth (a few hundred layers)
MAX_NEURON = 9_999_999  # far above any model's d_ff (tens of thousands)
_ITEM = re.compile(r"([0-9]+)(?:-([0-9]+))?")
_NEURON = re.compile(r"([0-9]+):([0-9]+)(?:-([0-9]+))?")


def neuron_id(layer: int, neuron: int) -> str:
    """How kvmem prints a neuron, and how every command takes one back: ``LAYER:NEURON``, e.g. ``3:1184``."""
    return f"{int(layer)}:{int(neuron)}"


def parse_neurons(texts: str | list[str] | None, *, option: str = "--neurons") -> list[tuple[int, int]] | None:
    """``"3:17,5:2"`` or ``["3:17", "5:2"]`` or ``"3:10-12"`` -> [(3, 17), (5, 2)] / [(3, 10), (3, 11), (3, 12)]
    (order kept, each neuron once); None -> None."""
    if texts is None:
        return None
    words = [texts] if isinstance(texts, str) else list(texts)
    items = [item for word in words for item in re.split(r"[,\s]+", word.strip()) if item]
    if not items:
        raise KvmemError(f"{option} names no neuron ({' '.join(words)!r}); give {NEURONS_FORM}")
    out: dict[tuple[int, int], None] = {}
    for item in items:
        found = _NEURON.fullmatch(item)
        if found is None:
            hint = " (a neuron id is LAYER:NEURON, as kvmem prints it)" if item.replace(",", "").isdigit() else ""
            raise KvmemError(f"{option} expects {NEURONS_FORM}; got {item!r}{hint}")
        layer, low = int(found.group(1)), int(found.group(2))
        high = int(found.group(3)) if found.group(3) is not None else low
        if high < low:
            raise KvmemError(f"{option}: the range {layer}:{low}-{high} runs backwards; write {layer}:{high}-{low}")
        if layer > MAX_LAYER or high > MAX_NEURON:
            raise KvmemError(f"{option}: {item} is out of range for any model; layers and neurons are numbered from 0")
        for neuron in range(low, high + 1):
            out[(layer, neuron)] = None
    return list(out)


def add_neurons_option(parser: argparse.ArgumentParser, help: str, *, positional: bool = False) -> None:
    """Add ``--neurons`` (or a positional ``NEURONS``); its words are kept and :func:`parse_neurons` reads them."""
    if positional:
        parser.add_argument("neurons", nargs="+", metavar="L:N", help=f"{help}: {NEURONS_FORM}")
    else:
        parser.add_argument("--neurons", nargs="+", default=None, metavar="L:N", help=f"{help}: {NEURONS_FORM}")


def add_atlas_option(parser: argparse.ArgumentParser, *, required: bool = True) -> None:
    """Add ``--atlas DIR``, the same on every command that reads an atlas."""
    parser.add_argument("--atlas", required=required, metavar="DIR", help="atlas directory written by kvmem scan")


def parse_layers(text: str | None, *, option: str = "--layers") -> list[int] | None:
    """'0,5,10-12' -> [0, 5, 10, 11, 12] (sorted, each layer once); None -> None (every layer)."""
    if text is None:
        return None
    if not text.strip():
        raise KvmemError(f"{option} names no layer ({text!r}); give {LAYERS_FORM}, or leave {option} out for all")
    layers: set[int] = set()
    for item in text.split(","):
        found = _ITEM.fullmatch(item.strip())
        if found is None:
            raise KvmemError(f"{option} expects {LAYERS_FORM}, got {text!r} (bad part {item.strip()!r})")
        low = int(found.group(1))
        high = int(found.group(2)) if found.group(2) is not None else low
        if high < low:
            raise KvmemError(f"{option}: the range {low}-{high} runs backwards; write {high}-{low}")
        if high > MAX_LAYER:
            raise KvmemError(f"{option}: layer {high} is out of range (no model has more than {MAX_LAYER + 1:,} "
                             f"layers); layers are numbered from 0")
        layers.update(range(low, high + 1))
    return sorted(layers)


def add_layers_option(parser: argparse.ArgumentParser, help: str) -> None:
    """Add ``--layers`` (its text is kept; :func:`parse_layers` reads it when the command runs)."""
    parser.add_argument("--layers", default=None, metavar="L,L-L", help=f"{help}: {LAYERS_FORM}")
