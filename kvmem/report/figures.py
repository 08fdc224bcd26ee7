"""The report's figures as PNG bytes, drawn with :mod:`kvmem.plots` on Agg figures (pyplot is never used)."""

from __future__ import annotations

import io
import warnings
from dataclasses import dataclass

__all__ = ["Figure", "neuron_figures"]

DPI = 150


@dataclass(frozen=True)
class Figure:
    """One figure: ``name`` (file stem), ``caption`` (plain text), ``png`` (bytes), size in CSS pixels."""

    name: str
    caption: str
    png: bytes
    width: int
    height: int


def _render(draw, size: tuple[float, float]) -> tuple[bytes, int, int]:
    from matplotlib.figure import Figure as MplFigure

    figure = MplFigure(figsize=size, layout="constrained")
    draw(figure.add_subplot())
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Glyph .* missing from")  # odd Unicode in token labels
        figure.savefig(buffer, format="png", dpi=DPI, facecolor="white")
    return buffer.getvalue(), round(size[0] * 96), round(size[1] * 96)


def neuron_figures(record, data: dict) -> list[Figure]:
    """Histogram, trigger coefficients and one value projection per stored convention."""
    from kvmem import plots

    layer, neuron = data["layer"], data["neuron"]
    out = []
    png, w, h = _render(lambda ax: plots.plot_histogram(record.histogram, ax=ax), (4.6, 2.4))
    out.append(Figure("histogram", f"Coefficient histogram of {layer}:{neuron} over "
                      f"{data['provenance']['tokens']:,} corpus tokens (log-spaced bins).", png, w, h))
    shown = record.triggers[record.triggers.kind.isin(["top", "bottom"])]
    if len(shown):
        height = min(max(2.2, 0.13 * len(shown) + 0.8), 7.5)
        png, w, h = _render(lambda ax: plots.plot_trigger_activations(shown, ax=ax), (4.6, height))
        out.append(Figure("triggers", "Coefficient at each kept top (orange) and bottom (blue) trigger token.",
                          png, w, h))
    for convention in data["values"]:
        png, w, h = _render(lambda ax, c=convention: plots.plot_value_projection(record.values, convention=c, ax=ax),
                            (4.0, 3.6))
        out.append(Figure(f"values_{convention}", f"Tokens the value promotes and suppresses ({convention} "
                          "convention), ten each.", png, w, h))
    return out
