"""The shared look of the experiments' per-layer percentage plots."""

from __future__ import annotations

__all__ = ["finish_percent_axes"]


def finish_percent_axes(ax, *, ylabel: str, title: str):
    """The shared look of the per-layer percentage plots: 0-100 %, labels, a small legend."""
    ax.set_ylim(0, 100)
    ax.set_xlabel("layer")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize="small")
    return ax
