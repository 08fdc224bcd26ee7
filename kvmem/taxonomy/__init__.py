"""The neuron taxonomy of the literature, one row per (layer, neuron): see ``docs/taxonomy.md``.

``weights`` (statistics of the weights alone), ``evidence`` (exact functions of an atlas's tables),
``table`` (the typed schema, assembly, atomic I/O), ``summary`` (per-layer shares with bootstrap
intervals), ``thresholds`` (every cut-off and its source).
"""

from kvmem.taxonomy.table import COLUMNS, PENDING, build_taxonomy, read_taxonomy, write_taxonomy
from kvmem.taxonomy.thresholds import Thresholds

__all__ = ["COLUMNS", "PENDING", "Thresholds", "build_taxonomy", "read_taxonomy", "write_taxonomy"]
