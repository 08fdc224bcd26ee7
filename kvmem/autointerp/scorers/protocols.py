"""The anchors' protocols: examples built as EleutherAI/delphi and openai/automated-interpretability build them.

``kvmem score --protocol delphi`` (detection, fuzzing), after delphi's ``latents/samplers.py``,
``latents/constructors.py``, ``scorers/classifier/{detection,fuzz,sample}.py`` and
``log/result_analysis.py``:

- an example is a *window* (delphi: 32 tokens, the activating token at ctx_len − ctx_len//4); kvmem's
  windows are the stored contexts of held-out triggers and random samples (context_before + 1 +
  context_after tokens, 17 by default, the kept token at index context_before), the only ones whose
  activations at every token the atlas holds;
- a window is *activating* when a token reaches the side's firing level and *non-activating* when no
  token does (delphi: the latent never fires in it). A neuron's coefficient is never exactly zero, so
  the level is the side's 0.99 quantile level (the lowest side activation among its held bin samples
  of the q0.99 and q0.999 bands): at the 0.9 level almost every 17-token window would fire somewhere;
- positives: the activating windows sorted by their maximum, cut into 10 equal quantiles, at most 5
  drawn from each (delphi's ``split_quantiles``, n_examples_test 50, n_quantiles 10; seeded);
  negatives: at most 50 non-activating windows drawn at random (``n_non_activating``);
- detection asks whether the side fires anywhere in the window; default fuzzing highlights, in each
  activating window, every token at or above 0.3 of its maximum (correct), and in each non-activating
  window as many random tokens as the activating windows have at or above that level on average,
  rounded up (incorrect; delphi counts the non-zero activations, which a neuron always has);
- metrics as ``compute_classification_metrics``: balanced accuracy, precision, recall and F1, with 0
  where a ratio has no denominator; AUC as ``roc_auc_score`` of the judge's confidence, which kvmem's
  judges give as their yes / no (so AUC = balanced accuracy; delphi reads it from logprobs).

``--protocol neuron-explainer`` (simulation), after ``neuron_explainer/activations/activations.py`` and
``explanations/scoring.py``: records of held-out top triggers and random samples 1 : 1 (its
``valid_activation_records``: n_examples_per_split of each), the pooled correlation over all tokens
(``aggregate_scored_sequence_simulations``' ev_correlation_score), NaN when it is undefined (a constant
prediction; ``np.corrcoef``), and its ``rsquared`` and ``absolute_dev_explained`` scores in ``metrics``.
Its published records are 64 tokens; kvmem's are the stored contexts.
"""

from __future__ import annotations

import math
import random

import numpy as np

from kvmem.autointerp.scorers.base import Query, Task

__all__ = ["delphi_windows", "delphi_detection", "delphi_fuzzing", "neuron_explainer_records", "N_QUANTILES",
           "PER_QUANTILE", "N_NON_ACTIVATING", "HIGHLIGHT"]

N_QUANTILES = 10
PER_QUANTILE = 5
N_NON_ACTIVATING = 50
HIGHLIGHT = 0.3


def _level(side) -> float:
    """The side's firing level for windows: its 0.99 quantile level (see the module docstring)."""
    high = [e.activation for e in side.examples if e.band in ("q0.99", "q0.999")]
    return min(high) if high else float("inf")


def delphi_windows(side, *, seed: int) -> tuple[list, list]:
    """(positives, negatives): held-out windows with stored activations, chosen as delphi chooses them."""
    level = _level(side)
    windows = sorted((e for e in side.part(held_out=True) if e.activations is not None), key=lambda e: e.code)
    active = [e for e in windows if max(e.activations) >= level]
    quiet = [e for e in windows if max(e.activations) < level]
    active.sort(key=lambda e: (-max(e.activations), e.code))
    rng = random.Random(seed)
    size = len(active) // N_QUANTILES
    positives = []
    for q in range(N_QUANTILES):
        part = active[q * size:(q + 1) * size] if size else (active if q == 0 else [])
        positives.extend(part if len(part) <= PER_QUANTILE else rng.sample(part, PER_QUANTILE))
    negatives = quiet if len(quiet) <= N_NON_ACTIVATING else rng.sample(quiet, N_NON_ACTIVATING)
    return positives, negatives


def delphi_detection(side, *, seed: int) -> Task:
    positives, negatives = delphi_windows(side, seed=seed)
    chosen = [(e, True) for e in positives] + [(e, False) for e in negatives]
    return Task(scorer="detection", queries=tuple(Query(tokens=e.tokens, index=-1, whole=True) for e, _ in chosen),
                truth=tuple(t for _, t in chosen), group=tuple(range(len(chosen))),
                codes=tuple(e.code for e, _ in chosen), protocol="delphi", undefined=0.0)


def delphi_fuzzing(side, *, seed: int) -> Task:
    positives, negatives = delphi_windows(side, seed=seed)
    marked = [tuple(i for i, a in enumerate(e.activations) if a >= HIGHLIGHT * max(e.activations)) for e in positives]
    n_incorrect = math.ceil(np.mean([len(m) for m in marked])) if marked else 1
    rng = random.Random(seed + 1)
    queries, truth, codes = [], [], []
    for e, m in zip(positives, marked):
        queries.append(Query(tokens=e.tokens, index=-1, highlights=m))
        truth.append(True)
        codes.append(e.code)
    for e in negatives:
        picks = tuple(sorted(rng.sample(range(len(e.tokens)), min(n_incorrect, len(e.tokens)))))
        queries.append(Query(tokens=e.tokens, index=-1, highlights=picks))
        truth.append(False)
        codes.append(e.code)
    return Task(scorer="fuzzing", queries=tuple(queries), truth=tuple(truth), group=tuple(range(len(queries))),
                codes=tuple(codes), protocol="delphi", undefined=0.0)


def neuron_explainer_records(side, *, per_band: int) -> Task:
    held = sorted((e for e in side.part(held_out=True) if e.activations is not None), key=lambda e: e.code)
    top = [e for e in held if e.band == "top"]
    rand = [e for e in held if e.band == "random"]
    k = min(per_band, len(top), len(rand))
    chosen = top[:k] + rand[:k]
    return Task(scorer="simulation", queries=tuple(Query(tokens=e.tokens, index=-1) for e in chosen),
                truth=tuple(np.asarray(e.activations, np.float64) for e in chosen), group=tuple(range(len(chosen))),
                codes=tuple(e.code for e in chosen), protocol="neuron-explainer")
