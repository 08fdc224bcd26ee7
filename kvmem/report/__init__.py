"""Neuron reports: one neuron as HTML, Markdown or JSON (schema ``kvmem.neuron/1``), many with an index.

The formats are the registry :data:`FORMATS` (:mod:`kvmem.report.formats`).
"""

from kvmem.report.formats import FORMATS
from kvmem.report.neuron_dict import SCHEMA, neuron_data
from kvmem.report.writing import RANKINGS, export_many, export_neuron, select_neurons

__all__ = ["FORMATS", "RANKINGS", "SCHEMA", "export_many", "export_neuron", "neuron_data", "select_neurons"]
