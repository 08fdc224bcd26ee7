"""The report-format registry: each export format's name, file suffix, description and writers.

Adding a format is one module that defines ``write_neuron`` and ``render_index`` (see
:mod:`kvmem.report.jsonfmt` for the smallest) plus one entry in :data:`FORMATS`;
:func:`kvmem.report.export_many` and ``kvmem report --format`` read everything from here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvmem.errors import KvmemError
from kvmem.report import html, jsonfmt, markdown

if TYPE_CHECKING:
    from kvmem.neuron_record import NeuronRecord

__all__ = ["FORMATS", "ReportFormat", "get_format"]


@dataclass(frozen=True, kw_only=True)
class ReportFormat:
    """One export format.

    ``name``: the key in :data:`FORMATS` (``--format NAME``). ``suffix``: file suffix of each
    report and of the index (``.html``). ``description``: one line for ``--help``.
    ``write_neuron(record, data, out, stem) -> Path``: write one neuron's report (its
    :class:`~kvmem.neuron_record.NeuronRecord` and ``kvmem.neuron/1`` dict) into directory ``out`` as
    ``stem + suffix`` (plus any files beside it) and return its path.
    ``render_index(rows, provenance) -> str``: the index text from ``kvmem.index/1`` rows.
    """

    name: str
    suffix: str
    description: str
    write_neuron: Callable[[NeuronRecord, dict, Path, str], Path]
    render_index: Callable[[list[dict], dict], str]


FORMATS: dict[str, ReportFormat] = {
    "html": ReportFormat(name="html", suffix=".html", description="one self-contained page per neuron, figures inline",
                         write_neuron=html.write_neuron, render_index=html.render_index),
    "md": ReportFormat(name="md", suffix=".md", description="Markdown for GitHub, figures as PNG files beside each page",
                       write_neuron=markdown.write_neuron, render_index=markdown.render_index),
    "json": ReportFormat(name="json", suffix=".json", description="the kvmem.neuron/1 data, no figures",
                         write_neuron=jsonfmt.write_neuron, render_index=jsonfmt.render_index),
}


def get_format(name: str) -> ReportFormat:
    """The registered format called ``name``; a one-line :class:`KvmemError` naming the allowed ones."""
    try:
        return FORMATS[name]
    except (KeyError, TypeError):
        raise KvmemError(f"unknown report format {name!r}; choose one of {', '.join(FORMATS)}") from None
