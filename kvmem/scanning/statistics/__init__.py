"""What a scan accumulates, one module per statistic, composed through one registry.

Each module defines a :class:`~kvmem.scanning.statistics.statistic.Statistic`: its state, its update from one
batch, its exact merge, its serialisation and what it writes (see :mod:`kvmem.scanning.statistics.statistic`),
in one torch implementation that runs on any device. :func:`compose` builds the statistics a
:class:`~kvmem.scanning.config.ScanConfig` asks for: the core ones always, the others when their
setting is on (``per_document``, samples, ``taxonomy_sums``) or when named in ``statistics``.

Adding a statistic: one module here, one line in :data:`STATISTICS`, and its test.
"""

from __future__ import annotations

from kvmem.scanning.statistics.document_bests import DocumentBests
from kvmem.scanning.statistics.extremes import Extremes
from kvmem.scanning.statistics.histograms import Histograms
from kvmem.scanning.statistics.magnitude_percentiles import MagnitudePercentiles
from kvmem.scanning.statistics.moments import Moments
from kvmem.scanning.statistics.samples import Samples
from kvmem.scanning.statistics.scan_state import GATE_UP_EXTRAS, Composition, LayerState, ScanState
from kvmem.scanning.statistics.statistic import LayerSpec, Statistic
from kvmem.scanning.statistics.taxonomy_sums import QUADRANTS, TaxonomySums
from kvmem.scanning.statistics.unigrams import Unigrams

__all__ = ["STATISTICS", "OPTIONAL", "compose", "Statistic", "LayerSpec", "Composition", "LayerState", "ScanState",
           "GATE_UP_EXTRAS", "QUADRANTS"]

# name -> statistic, in the order a layer's updates run and its tables are written
STATISTICS: dict[str, type[Statistic]] = {
    "taxonomy": TaxonomySums,
    "histogram": Histograms,
    "moments": Moments,
    "extremes": Extremes,
    "document_bests": DocumentBests,
    "samples": Samples,
    "unigrams": Unigrams,
    "magnitude_percentiles": MagnitudePercentiles,
}

# the statistics a config names in ``statistics`` (the others follow from its other settings)
OPTIONAL: tuple[str, ...] = tuple(name for name, cls in STATISTICS.items() if getattr(cls, "optional", False))


def compose(config, *, gated: bool) -> Composition:
    """The statistics a scan under ``config`` keeps (``gated``: the model's FFN is gated)."""
    return Composition([cls(config, gated=gated) for name, cls in STATISTICS.items()
                        if cls.wanted(config, gated=gated)])
