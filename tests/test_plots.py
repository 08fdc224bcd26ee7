"""kvmem.plots: each function draws on the given Axes (or a new one), returns it, and never shows."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import pytest

from kvmem import plots
from kvmem.errors import KvmemError

EDGES = [-np.inf, -1.0, -0.25, -0.0625, 0.0, 0.0625, 0.25, 1.0, 4.0, np.inf]


@pytest.fixture(autouse=True)
def _no_show(monkeypatch):
    monkeypatch.setattr(plt, "show", lambda *a, **k: pytest.fail("a plot function called plt.show()"))
    yield
    plt.close("all")


@pytest.fixture
def neurons():
    rng = np.random.default_rng(0)
    layers, d_ff = 4, 32
    frame = pd.DataFrame({"layer": np.repeat(np.arange(layers), d_ff).astype(np.int16),
                          "neuron": np.tile(np.arange(d_ff), layers).astype(np.int32)})
    frame["mean"] = rng.normal(0, 0.05, len(frame))
    frame["max"] = rng.gamma(2.0, 0.5, len(frame)) + frame.layer * 0.3
    frame["min"] = -rng.gamma(1.0, 0.05, len(frame))
    frame["frac_positive"] = rng.uniform(0.1, 0.5, len(frame))
    frame["value_norm"] = rng.uniform(0.5, 1.5, len(frame)).astype(np.float32)
    frame["key_norm"] = rng.uniform(0.5, 1.5, len(frame)).astype(np.float32)
    frame["gate_norm"] = np.float32(np.nan)
    return frame


def _drawn(ax) -> None:
    ax.figure.canvas.draw()  # mathtext, layout and fonts are only exercised when drawing


def test_histogram():
    counts = [0, 0, 5, 40, 300, 120, 8, 1, 0]
    frame = pd.DataFrame({"bin": range(9), "low": EDGES[:-1], "high": EDGES[1:], "count": counts})
    _, ax = plt.subplots()
    assert plots.plot_histogram(frame, ax=ax) is ax
    _drawn(ax)
    assert [p.get_height() for p in ax.patches] == [0, 5, 40, 300, 120, 8, 1, 0]  # one empty bin kept each side
    assert ax.get_yscale() == "log" and "0" in [t.get_text() for t in ax.get_xticklabels()]
    empty = frame.assign(count=0)
    _drawn(plots.plot_histogram(empty))  # nothing counted: still a valid, empty plot


def test_trigger_activations_labels_are_safe():
    frame = pd.DataFrame({"kind": ["top", "top", "bottom", "top_doc"], "activation": [2.0, 1.5, -0.5, 2.0],
                          "token": pd.Series(["$x$", "\u202e\u200bodd", "a\ud800b", "dup"], dtype=object)})
    ax = plots.plot_trigger_activations(frame)
    _drawn(ax)
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert labels == ["‘a\ufffdb’", "‘⟨U+202E⟩⟨U+200B⟩odd’", r"‘\$x\$’"]  # top_doc dropped, sorted by m
    assert [p.get_width() for p in ax.patches] == [-0.5, 1.5, 2.0]


def test_value_projection_picks_a_convention():
    rows = [(c, k, r, f"{c}-{k}-{r}", (1 if k == "promote" else -1) * (10 - r))
            for c in ("raw", "final_norm") for k in ("promote", "suppress") for r in range(12)]
    frame = pd.DataFrame(rows, columns=["convention", "kind", "rank", "token", "score"])
    ax = plots.plot_value_projection(frame, n=5)
    _drawn(ax)
    assert "final_norm" in ax.get_title() and len(ax.patches) == 10
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert labels[0] == "‘final_norm-promote-0’" and labels[-1] == "‘final_norm-suppress-0’"  # top to bottom
    assert "raw" in plots.plot_value_projection(frame, convention="raw").get_title()
    with pytest.raises(KvmemError, match="convention 'nope' is not in this frame"):
        plots.plot_value_projection(frame, convention="nope")
    with pytest.raises(KvmemError, match="needs columns"):
        plots.plot_value_projection(frame.drop(columns="score"))


def test_layer_summary(neurons):
    figure = plots.plot_layer_summary(neurons)
    assert isinstance(figure, matplotlib.figure.Figure) and len(figure.axes) == 3
    figure.canvas.draw()
    fraction = figure.axes[0].get_lines()[0].get_ydata()
    assert np.allclose(fraction, neurons.groupby("layer").frac_positive.mean())
    largest = figure.axes[1].get_lines()[2].get_ydata()
    assert np.allclose(largest, neurons.groupby("layer")["max"].max())
    own = plt.subplots(3, 1)[1]
    assert plots.plot_layer_summary(neurons, axes=own) is own[0].figure
    with pytest.raises(KvmemError, match="three panels"):
        plots.plot_layer_summary(neurons, axes=own[:2])


def test_layer_neuron_overview(neurons):
    ax = plots.plot_layer_neuron_overview(neurons, column="max")
    _drawn(ax)
    image = ax.get_images()[0]
    assert image.get_array().shape == (4, 32) and image.get_cmap().name == "viridis"
    signed = plots.plot_layer_neuron_overview(neurons, column="mean").get_images()[0]
    low, high = signed.get_clim()
    assert signed.get_cmap().name == "RdBu_r" and low == -high
    with pytest.raises(KvmemError, match="'token' is not a numeric column"):
        plots.plot_layer_neuron_overview(neurons.assign(token="x"), column="token")


def test_plots_stay_readable_with_a_massive_activation(neurons):
    """One neuron at 2,864 (a massive activation, Sun et al. 2024) beside maxima of a few units must not
    flatten the layer plots: the summary's coefficient axis is symlog, the overview's colours are clipped
    at the 99th percentile, and both say so on the axis."""
    heavy = neurons.copy()
    heavy.loc[5, "max"] = 2864.0
    heavy.loc[7, "mean"] = 900.0
    figure = plots.plot_layer_summary(heavy)
    figure.canvas.draw()
    panel = figure.axes[1]
    assert panel.get_yscale() == "symlog" and "symlog" in panel.get_ylabel()
    ax = plots.plot_layer_neuron_overview(heavy, column="max")
    _drawn(ax)
    low, high = ax.get_images()[0].get_clim()
    typical = heavy["max"].drop(index=5)
    assert high < 2864.0 / 100 and high >= np.percentile(typical, 95)  # the outlier no longer sets the scale
    assert "99th percentile" in ax.figure.axes[-1].get_ylabel()  # the colour bar states the clipping
    signed = plots.plot_layer_neuron_overview(heavy, column="mean")
    low, high = signed.get_images()[0].get_clim()
    assert low == -high and high < 900.0 / 100


def test_activation_functions_match_the_seeds():
    ax = plots.plot_activation_functions()
    _drawn(ax)
    relu, tanh_form, erf_form, minimum = ax.get_lines()[:4]
    x = tanh_form.get_xdata()
    assert x[0] == -3 and x[-1] == 3
    for point, expected in [(-1.0, -0.1588), (0.5, 0.3457), (1.0, 0.8412), (2.0, 1.9546), (3.0, 2.9964)]:
        assert np.interp(point, x, tanh_form.get_ydata()) == pytest.approx(expected, abs=2e-4)
    assert minimum.get_ydata()[0] == pytest.approx(-0.170, abs=1e-3) and minimum.get_xdata()[0] == pytest.approx(-0.75, abs=0.01)
    difference = np.abs(tanh_form.get_ydata() - erf_form.get_ydata())
    assert 1e-4 < difference.max() < 1e-3
    assert np.array_equal(relu.get_ydata(), np.maximum(x, 0))
    inset = ax.child_axes[0]
    assert np.allclose(inset.get_lines()[0].get_ydata(), (tanh_form.get_ydata() - erf_form.get_ydata()) * 1e4)


def test_plots_accept_atlas_tables(gpt2_model, tmp_path):
    import kvmem

    atlas = kvmem.scan(gpt2_model, ["The cat sat on the mat. " * 20], out=tmp_path / "a", top_k=3, window=32,
                       progress=False)
    _, axes = plt.subplots(2, 2)
    for function, table, ax in [(plots.plot_histogram, atlas.histogram(1, 4), axes[0, 0]),
                                (plots.plot_trigger_activations, atlas.triggers(1, 4), axes[0, 1]),
                                (plots.plot_value_projection, atlas.values(1, 4), axes[1, 0]),
                                (plots.plot_layer_neuron_overview, atlas.neurons, axes[1, 1])]:
        assert function(table, ax=ax) is ax
    _drawn(axes[0, 0])
    plots.plot_layer_summary(atlas.neurons).canvas.draw()
