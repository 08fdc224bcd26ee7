"""Plots of atlas tables. Each takes a DataFrame (and an optional ``ax``) and returns the Axes.

matplotlib is imported inside the functions, so ``import kvmem`` never loads it. No function calls
``plt.show()``; with ``ax=None`` a new figure is made with pyplot (shown inline in notebooks).
Token strings are drawn through :func:`kvmem.report.safe_text.mpl_text` (controls made visible, ``$`` escaped,
long tokens cut).
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from kvmem.conventions import DEFAULT_CONVENTION
from kvmem.errors import KvmemError
from kvmem.report.safe_text import mpl_text

__all__ = [
    "NEGATIVE",
    "POSITIVE",
    "plot_activation_functions",
    "plot_histogram",
    "plot_layer_neuron_overview",
    "plot_layer_summary",
    "plot_taxonomy",
    "plot_trigger_activations",
    "plot_value_projection",
]

POSITIVE = "#d9661f"  # promote / positive coefficient
NEGATIVE = "#2f6db5"  # suppress / negative coefficient
_INK = "#333333"


def _axes(ax, figsize=(5.0, 3.0)):
    if ax is not None:
        return ax
    import matplotlib.pyplot as plt

    _, ax = plt.subplots(figsize=figsize, layout="constrained")
    return ax


def _tidy(ax) -> None:
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    ax.tick_params(labelsize=8, colors=_INK)
    ax.xaxis.label.set_size(9)
    ax.yaxis.label.set_size(9)


def _require(frame, columns: list[str], what: str) -> None:
    missing = [c for c in columns if c not in frame.columns]
    if missing:
        raise KvmemError(f"{what} needs columns {columns}; the frame lacks {missing} (pass the atlas's own table)")


def _label(token) -> str:
    return f"‘{mpl_text(token, limit=24)}’"


def plot_histogram(hist_frame, *, ax=None):
    """Coefficient histogram (``atlas.histogram(L, N)``: columns bin, low, high, count).

    The atlas's bins are fixed and roughly logarithmic, so each bin is drawn equally wide and the
    x ticks name their edges; y (positions) is logarithmic. Empty outer bins are left out.
    """
    _require(hist_frame, ["low", "high", "count"], "plot_histogram")
    ax = _axes(ax)
    low = hist_frame["low"].to_numpy(float)
    high = hist_frame["high"].to_numpy(float)
    count = hist_frame["count"].to_numpy(float)
    nonzero = np.flatnonzero(count)
    first, last = (max(nonzero[0] - 1, 0), min(nonzero[-1] + 1, len(count) - 1)) if len(nonzero) else (0, len(count) - 1)
    index = np.arange(first, last + 1)
    ax.bar(index, count[index], width=1.0, align="edge", log=bool(len(nonzero)), color="#8c8c8c",
           edgecolor="white", linewidth=0.4)
    edges = np.append(low[index], high[last])  # edge j sits at x = j
    positions = np.append(index, last + 1)
    for base in (4.0, 16.0, 256.0):  # label powers of 4, or of 16 / 256 when that would crowd the axis
        marks = {0.0} | {sign * base ** k for sign in (1, -1) for k in range(-8, 9)}
        ticks = [(p, e) for p, e in zip(positions, edges) if e in marks or np.isinf(e)]
        if len(ticks) <= 9:
            break
    ax.set_xticks([p for p, _ in ticks], [_edge(e) for _, e in ticks])
    if 0.0 in edges:
        ax.axvline(positions[list(edges).index(0.0)], color=_INK, linewidth=0.6)
    ax.set_xlim(first, last + 1)
    if len(nonzero):
        from matplotlib.ticker import LogFormatter

        ax.yaxis.set_major_formatter(LogFormatter())  # plain numbers (40, 100), not 4×10¹
        ax.yaxis.set_minor_formatter(LogFormatter(labelOnlyBase=False))
        ax.set_ylim(0.7, count.max() * 1.6)  # a count of 1 still shows
    ax.set_xlabel("coefficient $m_i$ (log-spaced bins)")
    ax.set_ylabel("positions")
    _tidy(ax)
    return ax


def _edge(value: float) -> str:
    if np.isinf(value):
        return "−∞" if value < 0 else "∞"
    text = f"{abs(value):g}" if abs(value) >= 1 or value == 0 else f"1/{round(1 / abs(value)):d}"
    return ("−" if value < 0 else "") + text


def plot_trigger_activations(triggers_frame, *, ax=None):
    """Coefficients of the kept triggers (``atlas.triggers(L, N)``), one bar per trigger, labelled by token.

    When the frame holds both ``top``/``bottom`` and per-document kinds, only top and bottom are drawn.
    """
    _require(triggers_frame, ["activation", "token"], "plot_trigger_activations")
    frame = triggers_frame
    if "kind" in frame.columns and frame.kind.isin(["top", "bottom"]).any():
        frame = frame[frame.kind.isin(["top", "bottom"])]
    frame = frame.sort_values("activation", ascending=True)
    ax = _axes(ax, figsize=(5.0, max(2.0, 0.16 * len(frame) + 0.8)))
    values = frame["activation"].to_numpy(float)
    y = np.arange(len(values))
    ax.barh(y, values, color=[POSITIVE if v >= 0 else NEGATIVE for v in values], height=0.7)
    ax.set_yticks(y, [_label(t) for t in frame["token"]], fontsize=7)
    ax.axvline(0, color=_INK, linewidth=0.6)
    ax.set_xlabel("coefficient $m_i$ at the trigger token")
    _tidy(ax)
    return ax


def plot_value_projection(values_frame, *, ax=None, convention: str | None = None, n: int = 10):
    """Tokens a value promotes (orange) and suppresses (blue), ``n`` each, for one convention.

    ``values_frame``: ``atlas.values(L, N)``. ``convention``: default
    :data:`kvmem.conventions.DEFAULT_CONVENTION` if present, else the first in the frame; the title names it.
    """
    _require(values_frame, ["kind", "token", "score"], "plot_value_projection")
    frame = values_frame
    if "convention" in frame.columns and len(frame):
        stored = list(dict.fromkeys(frame.convention))
        if convention is None:
            convention = DEFAULT_CONVENTION if DEFAULT_CONVENTION in stored else stored[0]
        if convention not in stored:
            raise KvmemError(f"convention {convention!r} is not in this frame; it holds {', '.join(stored)}")
        frame = frame[frame.convention == convention]
    order = "rank" if "rank" in frame.columns else "score"
    promote = frame[frame.kind == "promote"].sort_values(order).head(n)
    suppress = frame[frame.kind == "suppress"].sort_values(order).head(n)
    rows = list(promote.itertuples()) + list(suppress.iloc[::-1].itertuples())
    ax = _axes(ax, figsize=(4.2, max(2.0, 0.16 * len(rows) + 0.8)))
    y = np.arange(len(rows))[::-1]
    scores = np.array([r.score for r in rows], float)
    ax.barh(y, scores, color=[POSITIVE if r.kind == "promote" else NEGATIVE for r in rows], height=0.7)
    ax.set_yticks(y, [_label(r.token) for r in rows], fontsize=7)
    ax.axvline(0, color=_INK, linewidth=0.6)
    ax.set_xlabel("logit score per unit coefficient")
    if convention:
        ax.set_title(f"value projection ({convention})", fontsize=9, color=_INK)
    _tidy(ax)
    return ax


def plot_layer_summary(neurons_frame, *, axes=None):
    """Per-layer summary of ``atlas.neurons``; returns the Figure (three panels).

    Panels: (a) fraction of positions with m > 0 (mean over neurons, 10-90% band); (b) coefficients:
    mean of the neuron means, median and largest neuron max; (c) vector norms: mean ||v|| (10-90% band)
    and mean ||k||. ``axes``: three Axes to draw into (default: a new figure).
    """
    _require(neurons_frame, ["layer", "frac_positive", "mean", "max", "value_norm", "key_norm"], "plot_layer_summary")
    if axes is None:
        import matplotlib.pyplot as plt

        _, axes = plt.subplots(3, 1, figsize=(5.0, 5.4), sharex=True, layout="constrained")
    if len(axes) != 3:
        raise KvmemError(f"plot_layer_summary draws three panels; pass axes=None or 3 Axes, got {len(axes)}")
    grouped = neurons_frame.groupby("layer")
    layers = np.array(sorted(grouped.groups))

    def band(ax, column, color, label):
        q = grouped[column].quantile([0.1, 0.9]).unstack()
        ax.fill_between(layers, q[0.1].to_numpy(), q[0.9].to_numpy(), color=color, alpha=0.18, linewidth=0)
        ax.plot(layers, grouped[column].mean().to_numpy(), "o-", color=color, markersize=3, linewidth=1.2, label=label)

    band(axes[0], "frac_positive", POSITIVE, "mean (10–90%)")
    axes[0].set_ylabel("fraction $m>0$")
    axes[1].plot(layers, grouped["mean"].mean().to_numpy(), "o-", color=_INK, markersize=3, linewidth=1.2,
                 label="mean of neuron means")
    axes[1].plot(layers, grouped["max"].median().to_numpy(), "s-", color=POSITIVE, markersize=3, linewidth=1.2,
                 label="median neuron max")
    axes[1].plot(layers, grouped["max"].max().to_numpy(), "^--", color=POSITIVE, markersize=3, linewidth=1.0,
                 label="largest neuron max")
    # heavy tails: one massive activation (thousands) beside typical maxima of a few units would flatten a
    # linear axis, so the axis is symmetric-log, linear within ±1
    axes[1].set_yscale("symlog", linthresh=1.0)
    axes[1].set_ylabel("coefficient (symlog)")
    band(axes[2], "value_norm", NEGATIVE, "‖v‖ (10–90%)")
    axes[2].plot(layers, grouped["key_norm"].mean().to_numpy(), "s--", color=_INK, markersize=3, linewidth=1.0,
                 label="‖k‖")
    axes[2].set_ylabel("norm")
    axes[2].set_xlabel("layer")
    for ax, tag in zip(axes, "abc"):
        ax.legend(fontsize=7, frameon=False)
        ax.set_title(f"({tag})", loc="left", fontsize=9, color=_INK)
        _tidy(ax)
    return axes[0].figure


def plot_layer_neuron_overview(neurons_frame, *, column: str = "max", ax=None):
    """A layer × neuron image of one ``atlas.neurons`` column (diverging colours around 0 when signed).

    The colour scale is clipped to the 1st-99th percentiles (signed: ±the 99th percentile of |x|) so that a
    few heavy-tailed neurons do not flatten the rest; the colour bar says so and the clipped ends extend."""
    numeric = [c for c in neurons_frame.columns if c not in ("layer", "neuron")
               and pd.api.types.is_numeric_dtype(neurons_frame[c])]
    if column not in numeric:
        raise KvmemError(f"column {column!r} is not a numeric column of the neurons table; choose one of "
                         f"{', '.join(numeric)}")
    ax = _axes(ax, figsize=(6.0, 3.0))
    grid = neurons_frame.pivot(index="layer", columns="neuron", values=column).sort_index()
    data = grid.to_numpy(float)  # [layers, d_ff]
    finite = data[np.isfinite(data)]
    signed = len(finite) and finite.min() < 0 < finite.max()
    if signed:
        limit = float(np.percentile(np.abs(finite), 99))
        image = ax.imshow(data, aspect="auto", interpolation="nearest", cmap="RdBu_r", vmin=-limit, vmax=limit)
        clipped = f"clipped at ±{limit:.3g}, the 99th percentile of |{column}|"
    else:
        low, high = (float(np.percentile(finite, q)) for q in (1, 99)) if len(finite) else (None, None)
        image = ax.imshow(data, aspect="auto", interpolation="nearest", cmap="viridis", vmin=low, vmax=high)
        clipped = "clipped at the 1st and 99th percentiles" if len(finite) else ""
    layers = grid.index.to_numpy()
    ticks = np.arange(len(layers)) if len(layers) <= 12 else np.linspace(0, len(layers) - 1, 7).round().astype(int)
    ax.set_yticks(ticks, [str(layers[t]) for t in ticks])
    ax.set_xlabel("neuron")
    ax.set_ylabel("layer")
    ax.figure.colorbar(image, ax=ax, label=f"{column}\n({clipped})" if clipped else column, shrink=0.9,
                       extend="both" if clipped else "neither")
    _tidy(ax)
    return ax


def plot_taxonomy(frame, *, column: str = "suppression", ax=None, statistic: str = "mean", paper=None,
                  label: str | None = None, color: str = POSITIVE):
    """A taxonomy column by layer: the share of neurons with a flag (or a numeric column's mean / median)
    with its 95% bootstrap interval over the layer's neurons (:func:`kvmem.taxonomy.summary.layer_summary`).

    ``frame``: ``atlas.taxonomy`` or :func:`kvmem.taxonomy.read_taxonomy`'s result. ``paper``: an optional
    reference value drawn as a dashed line (a paper's number). Call again with the same ``ax`` to overlay
    another column.
    """
    from kvmem.taxonomy.summary import layer_summary  # here: the taxonomy package imports torch

    _require(frame, ["layer"], "plot_taxonomy")
    summary = layer_summary(frame, column, statistic=statistic)
    ax = _axes(ax, figsize=(5.0, 2.8))
    ax.autoscale(enable=True, axis="y")  # an earlier call on this ax fixed the limits
    x = summary.layer.to_numpy()
    y = summary.value.to_numpy(float)
    ax.fill_between(x, summary.ci_low.to_numpy(float), summary.ci_high.to_numpy(float), color=color, alpha=0.25,
                    linewidth=0)
    ax.plot(x, y, marker="o", markersize=3, color=color, linewidth=1.2, label=label or column)
    if paper is not None:
        ax.axhline(float(paper), color=_INK, linestyle="--", linewidth=0.8, label="paper")
    flag = "count" in summary.columns
    ax.set_xlabel("layer")
    ax.set_ylabel("share of neurons" if flag else f"{statistic} {column}")
    ax.relim()
    ax.autoscale_view()
    if flag:
        ax.set_ylim(bottom=0)
    ax.legend(fontsize=7, frameon=False)
    _tidy(ax)
    return ax


def plot_activation_functions(*, ax=None):
    """GELU (tanh form and exact erf form) against ReLU on [-3, 3], and the tanh − erf difference.

    The difference (at most ~5e-4) is drawn in an inset (``ax.child_axes[0]``); GELU's minimum
    (≈ -0.170 at x ≈ -0.75) is marked. Returns the main Axes.
    """
    ax = _axes(ax, figsize=(5.0, 3.2))
    x = np.linspace(-3.0, 3.0, 1201)
    tanh_form = 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))
    erf_form = 0.5 * x * (1.0 + np.array([math.erf(v / math.sqrt(2.0)) for v in x]))
    ax.plot(x, np.maximum(x, 0.0), color="#9a9a9a", linewidth=1.2, linestyle="--", label="ReLU")
    ax.plot(x, tanh_form, color=POSITIVE, linewidth=1.6, label="GELU (tanh form)")
    ax.plot(x, erf_form, color=_INK, linewidth=0.9, linestyle=":", label="GELU (exact, erf)")
    i = int(np.argmin(tanh_form))
    ax.plot([x[i]], [tanh_form[i]], "o", color=POSITIVE, markersize=4)
    ax.annotate(f"min ≈ {tanh_form[i]:.3f}\nat x ≈ {x[i]:.2f}", (x[i], tanh_form[i]), xytext=(-2.9, 0.9),
                fontsize=8, color=_INK, arrowprops={"arrowstyle": "-", "color": "#9a9a9a", "linewidth": 0.8})
    ax.axhline(0, color=_INK, linewidth=0.5)
    ax.set_xlabel("x")
    ax.set_ylabel("activation")
    ax.legend(fontsize=7, frameon=False, loc="lower right")
    inset = ax.inset_axes([0.1, 0.5, 0.36, 0.3])
    inset.plot(x, (tanh_form - erf_form) * 1e4, color=NEGATIVE, linewidth=0.9)
    inset.axhline(0, color=_INK, linewidth=0.4)
    inset.set_title("tanh − erf  (×10⁻⁴)", fontsize=7, color=_INK)
    _tidy(inset)
    inset.tick_params(labelsize=6)
    _tidy(ax)
    return ax
