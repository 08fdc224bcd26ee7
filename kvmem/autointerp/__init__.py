"""Explain neuron sides in words and rules, and score the explanations on held-out examples.


``kvmem.explain(atlas, ...)`` and ``kvmem.score(atlas, ...)`` are :func:`explain` and :func:`score` here (the package is
not called ``explain``, so that ``kvmem.explain`` stays the function); explainers and judges:
:mod:`kvmem.autointerp.explainers`; scorers: :mod:`kvmem.autointerp.scorers`;
storage: :mod:`kvmem.autointerp.store`. See docs/explanations.md.
"""

from kvmem.autointerp.api import explain, explanations
from kvmem.autointerp.scoring import score
from kvmem.autointerp.tidy import score_table

__all__ = ["explain", "score", "explanations", "score_table"]
