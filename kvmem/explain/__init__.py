"""Explain neuron sides in words and rules, and score the explanations on held-out examples.

``kvmem.explain.explain(atlas, ...)`` and ``kvmem.explain.score(atlas, ...)`` (also ``kvmem.explain``
and ``kvmem.score``); explainers and judges: :mod:`kvmem.explain.explainers`; scorers:
:mod:`kvmem.explain.scorers`; storage: :mod:`kvmem.explain.store`. See docs/explanations.md.
"""

from kvmem.explain.api import explain, explanations, score

__all__ = ["explain", "score", "explanations"]
