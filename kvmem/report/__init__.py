"""Neuron reports: one memory slot as HTML, Markdown or JSON (schema ``kvmem.neuron/1``), many with an index."""

from kvmem.report.export import FORMATS, RANKINGS, export_many, export_neuron, select_neurons
from kvmem.report.record import SCHEMA, neuron_data

__all__ = ["FORMATS", "RANKINGS", "SCHEMA", "export_many", "export_neuron", "neuron_data", "select_neurons"]
