"""Write reports to disk: one neuron (:func:`export_neuron`) or many plus an index (:func:`export_many`).

Formats come from the registry :data:`kvmem.report.formats.FORMATS`.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from kvmem.atomic import staged_directory
from kvmem.errors import KvmemError
from kvmem.report.formats import FORMATS, ReportFormat, get_format
from kvmem.report.index import index_row
from kvmem.report.neuron_dict import neuron_data
from kvmem.report.safe_text import write_text

__all__ = ["RANKINGS", "export_many", "export_neuron", "report_stem", "select_neurons"]

RANKINGS = ("max", "mean", "frac_positive")


def report_stem(layer: int, neuron: int) -> str:
    """File name stem of a neuron's report: ``L3_N17``."""
    return f"L{layer}_N{neuron}"


def _as_atlas(atlas):
    """An :class:`~kvmem.atlas.Atlas`, opening a directory path if given one."""
    if isinstance(atlas, (str, os.PathLike)):
        from kvmem.atlas import open_atlas

        return open_atlas(atlas)
    return atlas


def _export(atlas, layer: int, neuron: int, report_format: ReportFormat, out: Path) -> tuple[Path, dict]:
    atlas.check(layer, neuron)
    record = atlas.neuron(layer, neuron)
    data = neuron_data(atlas, layer, neuron, record=record)
    return report_format.write_neuron(record, data, out, report_stem(layer, neuron)), data


def export_neuron(atlas, layer: int, neuron: int, *, format: str = "html", out: str | os.PathLike = ".") -> Path:
    """Write one neuron's report into directory ``out`` (created if missing) and return its path.

    ``atlas``: an :class:`~kvmem.atlas.Atlas` or its directory.
    ``format``: a name in :data:`~kvmem.report.formats.FORMATS`: ``html`` (one self-contained file),
    ``md`` (Markdown + PNG files in ``L{l}_N{n}_files/``) or ``json`` (schema ``kvmem.neuron/1``, see
    :mod:`kvmem.report.neuron_dict`). An existing report of the same neuron and format in ``out`` is replaced.
    """
    report_format = get_format(format)
    atlas = _as_atlas(atlas)
    atlas.check(int(layer), int(neuron))
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    return _export(atlas, int(layer), int(neuron), report_format, out)[0]


def select_neurons(atlas, layer: int, *, top: int, by: str = "max") -> list[tuple[int, int]]:
    """The ``top`` neurons of ``layer`` with the highest ``by`` (max | mean | frac_positive), best first."""
    if by not in RANKINGS:
        raise KvmemError(f"unknown ranking --by {by!r}; choose one of {', '.join(RANKINGS)}")
    if top < 1:
        raise KvmemError(f"--top must be at least 1, got {top}")
    atlas = _as_atlas(atlas)
    atlas.check(layer)
    frame = atlas.neurons[atlas.neurons.layer == layer]
    best = frame.sort_values([by, "neuron"], ascending=[False, True], kind="stable").head(top)
    return [(int(layer), int(n)) for n in best.neuron]


def export_many(atlas, neurons: Iterable[tuple[int, int]], *, format: str = "html", out: str | os.PathLike,
                progress: bool = True, overwrite: bool = False) -> Path:
    """Write a report per (layer, neuron) and an index (``index`` + the format's suffix, e.g. ``index.html``).

    Returns the index path. ``out`` must not exist unless ``overwrite`` (then it is replaced, but only
    if it is empty or a previous report directory). Every pair is checked before anything is written.
    """

    report_format = get_format(format)
    atlas = _as_atlas(atlas)
    pairs = list(dict.fromkeys((int(layer), int(neuron)) for layer, neuron in neurons))
    if not pairs:
        raise KvmemError("no neurons to export; give layer/neuron pairs or --layer L --top M")
    for layer, neuron in pairs:
        atlas.check(layer, neuron)
    target = Path(out)
    _check_target(target, overwrite)
    with staged_directory(target, mode=0o777 & ~_umask()) as tmp:  # a report directory is not private
        from tqdm import tqdm  # plain: tqdm.auto warns in notebooks without ipywidgets

        rows = []
        for layer, neuron in tqdm(pairs, desc="reports", unit="neuron", disable=not progress):
            path, data = _export(atlas, layer, neuron, report_format, tmp)
            rows.append(index_row(data, path.name))
        provenance = {key: data["provenance"][key] for key in ("model", "fingerprint", "corpus", "tokens", "convention",
                                                               "kvmem_version", "exported_with")}
        write_text(tmp / f"index{report_format.suffix}", report_format.render_index(rows, provenance))
    return target / f"index{report_format.suffix}"


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _check_target(target: Path, overwrite: bool) -> None:
    if not target.exists():
        return
    if not overwrite:
        raise KvmemError(f"output directory {target} already exists; pass overwrite=True (--overwrite) or another --out")
    if not target.is_dir():
        raise KvmemError(f"--out {target} is a file, not a directory; choose another --out")
    if any(target.iterdir()) and not any((target / f"index{f.suffix}").exists() for f in FORMATS.values()):
        raise KvmemError(f"refusing to replace {target}: it is not empty and holds no kvmem report index; "
                         f"choose another --out")
