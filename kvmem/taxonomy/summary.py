"""Per-layer summaries of a taxonomy column with bootstrap intervals over the layer's neurons."""

from __future__ import annotations

import numpy as np
import pandas as pd

from kvmem.errors import KvmemError
from kvmem.experiments.stats import bootstrap_ci

__all__ = ["layer_summary"]


def layer_summary(frame: pd.DataFrame, column: str, *, statistic: str = "mean", n_boot: int = 1000,
                  level: float = 0.95, seed: int = 0) -> pd.DataFrame:
    """One row per layer: ``value`` (the mean of ``column``: for a flag, the share of neurons with it;
    ``statistic="median"`` for the median), ``ci_low`` / ``ci_high`` (percentile bootstrap over the layer's
    neurons, :func:`kvmem.experiments.stats.bootstrap_ci`), ``n`` (neurons with a finite value) and, for a
    flag, ``count`` (neurons with it). NaN values are left out."""
    if column not in frame.columns:
        numeric = [c for c in frame.columns if c not in ("layer", "neuron")
                   and (pd.api.types.is_numeric_dtype(frame[c]) or pd.api.types.is_bool_dtype(frame[c]))]
        raise KvmemError(f"column {column!r} is not in the taxonomy frame; choose one of {', '.join(numeric)}")
    series = frame[column]
    flag = pd.api.types.is_bool_dtype(series) or series.dtype == object and set(series.dropna().unique()) <= {True, False}
    if not flag and not pd.api.types.is_numeric_dtype(series):
        raise KvmemError(f"column {column!r} is not numeric or a flag; plot a numeric column or a flag")
    rows = []
    for layer, part in frame.groupby("layer", sort=True):
        values = part[column].to_numpy(dtype=np.float64, na_value=np.nan)
        values = values[np.isfinite(values)]
        value = float(np.median(values) if statistic == "median" else values.mean()) if len(values) else np.nan
        low, high = bootstrap_ci(values, statistic=statistic, n_boot=n_boot, level=level, seed=seed)
        row = {"layer": int(layer), "value": value, "ci_low": low, "ci_high": high, "n": len(values)}
        if flag:
            row["count"] = int(values.sum())
        rows.append(row)
    return pd.DataFrame(rows)
