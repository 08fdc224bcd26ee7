"""Export an atlas for other tools: one registry of formats (name -> writer module, description).

Adding a format is one module in this package with a ``write`` function plus one line in
:data:`FORMATS`; ``kvmem export --format`` reads its choices and help from here.

``write(atlas, out, neurons, *, model, corpus, progress, **options) -> dict``: fill directory ``out``
(a staged copy, renamed into place when ``write`` returns) for the ``neurons`` [(layer, neuron)] and
return the export's metadata, which is written to ``out/metadata.json``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from importlib import import_module
from pathlib import Path

from kvmem.atomic import staged_directory
from kvmem.errors import KvmemError

__all__ = ["ExportFormat", "FORMATS", "export_atlas", "METADATA"]

METADATA = "metadata.json"


@dataclass(frozen=True, kw_only=True)
class ExportFormat:
    """A registered export format: ``module`` in :mod:`kvmem.export` defines ``write``."""

    name: str
    module: str
    description: str

    def writer(self):
        return import_module(f"kvmem.export.{self.module}").write


FORMATS: dict[str, ExportFormat] = {
    "neuron-explainer": ExportFormat(
        name="neuron-explainer", module="neuron_explainer",
        description="OpenAI automated-interpretability NeuronRecord JSON, neurons/<layer>/<neuron>.json "
                    "(quantile samples run the scanned model; --no-quantiles skips them)"),
}


def export_atlas(atlas, *, out: str | os.PathLike, format: str = "neuron-explainer",
                 layers: Iterable[int] | None = None, neurons: Iterable[tuple[int, int]] | None = None,
                 model=None, corpus=None, overwrite: bool = False, progress: bool = False, **options) -> Path:
    """Write the atlas's neurons in ``format`` (see :data:`FORMATS`) into directory ``out``; return ``out``.

    Selection: ``neurons`` [(layer, neuron)] and every neuron of ``layers``; neither: the whole atlas.
    ``model``: the scanned model (a :class:`~kvmem.models.Model`), for formats that compute context
    coefficients; ``corpus``: the scanned corpus, when the manifest cannot reopen it. ``out`` is written
    atomically and must not exist unless ``overwrite`` (then only a previous export is replaced).
    ``options``: the format's own (neuron-explainer: ``quantiles``, ``per_band``, ``levels``, ``chunk``).
    """
    from kvmem.atlas import Atlas, open_atlas

    if format not in FORMATS:
        raise KvmemError(f"unknown export format {format!r}; choose one of {', '.join(FORMATS)}")
    atlas = atlas if isinstance(atlas, Atlas) else open_atlas(atlas)
    pairs = _selection(atlas, layers, neurons)
    target = Path(out)
    if target.exists():
        if not overwrite:
            raise KvmemError(f"output directory {target} already exists; pass overwrite=True (--overwrite) or another --out")
        if not target.is_dir() or (any(target.iterdir()) and not (target / METADATA).exists()):
            raise KvmemError(f"refusing to replace {target}: it is not a previous kvmem export; choose another --out")
    with staged_directory(target) as tmp:
        metadata = FORMATS[format].writer()(atlas, tmp, pairs, model=model, corpus=corpus, progress=progress,
                                            **options)
        (tmp / METADATA).write_text(json.dumps(metadata, indent=2, allow_nan=False) + "\n", encoding="utf-8")
    return target


def _selection(atlas, layers, neurons) -> list[tuple[int, int]]:
    pairs: list[tuple[int, int]] = []
    for layer, neuron in neurons or ():
        atlas.check(int(layer), int(neuron))
        pairs.append((int(layer), int(neuron)))
    for layer in layers or ():
        atlas.check(int(layer))
        pairs += [(int(layer), n) for n in range(atlas.d_ff)]
    if layers is None and neurons is None:
        pairs = [(layer, n) for layer in atlas.layers for n in range(atlas.d_ff)]
    pairs = sorted(dict.fromkeys(pairs))
    if not pairs:
        raise KvmemError("nothing to export: the selection is empty; give --layers L ... or --neurons L:N ...")
    return pairs
