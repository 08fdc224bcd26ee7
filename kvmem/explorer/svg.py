"""Small SVG charts drawn on the server: a coefficient histogram and per-layer lines.

Colours and fonts come from the explorer's stylesheet through class names; the markup holds no
``style`` attribute and no script, so the pages' Content-Security-Policy allows it. Every label is escaped.
"""

from __future__ import annotations

import math
from html import escape

__all__ = ["histogram", "layer_lines"]

SERIES_CLASSES = ("c0", "c1", "c2", "c3", "c4", "c5", "c6")


def _number(value: float) -> str:
    if value is None or not math.isfinite(value):
        return "∞" if value and value > 0 else "−∞"
    text = f"{value:.3g}"
    return text.replace("-", "−")


def histogram(edges: list, counts: list[int], *, width: int = 640, height: int = 170) -> str:
    """Bars of a histogram over fixed bins, drawn one bin per bar (the bins widen away from 0, so the axis is
    a signed log scale), counts on a log axis; empty bins at both ends are left out."""
    nonzero = [i for i, c in enumerate(counts) if c > 0]
    if not nonzero:
        return '<p class="none">No positions counted.</p>'
    lo, hi = max(nonzero[0] - 1, 0), min(nonzero[-1] + 1, len(counts) - 1)
    shown = list(range(lo, hi + 1))
    left, right, top, bottom = 46, 10, 10, 34
    plot_w, plot_h = width - left - right, height - top - bottom
    bar_w = plot_w / len(shown)
    peak = math.log10(max(counts) + 1)
    parts = [f'<svg class="chart" viewBox="0 0 {width} {height}" width="{width}" height="{height}" role="img" '
             f'aria-label="histogram of the coefficients">']
    for power in range(0, int(math.ceil(peak)) + 1):
        y = top + plot_h * (1 - power / max(peak, 1e-9))
        if y < top - 0.5:
            continue
        parts.append(f'<line class="grid" x1="{left}" x2="{width - right}" y1="{y:.1f}" y2="{y:.1f}"/>'
                     f'<text class="tick" x="{left - 4}" y="{y + 3:.1f}" text-anchor="end">{10 ** power:,}</text>')
    for k, i in enumerate(shown):
        count = counts[i]
        h = plot_h * math.log10(count + 1) / max(peak, 1e-9)
        x = left + k * bar_w
        low, high = edges[i], edges[i + 1]
        side = "neg" if high is not None and high <= 0 else "pos"
        parts.append(f'<rect class="bar {side}" x="{x + 0.5:.1f}" y="{top + plot_h - h:.1f}" width="{max(bar_w - 1, 1):.1f}" '
                     f'height="{h:.1f}"><title>[{escape(_number(low))}, {escape(_number(high))}): {count:,}</title></rect>')
    step = max(1, len(shown) // 8)
    for k in range(0, len(shown) + 1, step):
        edge = edges[shown[0] + k] if shown[0] + k < len(edges) else None
        x = left + k * bar_w
        parts.append(f'<line class="axis" x1="{x:.1f}" x2="{x:.1f}" y1="{top + plot_h}" y2="{top + plot_h + 4}"/>'
                     f'<text class="tick" x="{x:.1f}" y="{top + plot_h + 15}" text-anchor="middle">'
                     f'{escape(_number(edge))}</text>')
    parts.append(f'<line class="axis" x1="{left}" x2="{width - right}" y1="{top + plot_h}" y2="{top + plot_h}"/>'
                 f'<text class="label" x="{left + plot_w / 2:.1f}" y="{height - 2}" text-anchor="middle">coefficient m '
                 f'(bins widen away from 0); positions per bin, log scale</text></svg>')
    return "".join(parts)


def layer_lines(layers: list[int], series: dict[str, list[float]], *, label: str, band: tuple[list[float], list[float]]
                | None = None, log: bool = False, width: int = 460, height: int = 180) -> str:
    """One line per named series over the layers (NaN leaves a gap), an optional shaded band, a legend."""
    values = [v for line in series.values() for v in line if v is not None and math.isfinite(v) and (not log or v > 0)]
    if band:
        values += [v for v in (*band[0], *band[1]) if math.isfinite(v)]
    if not values or not layers:
        return '<p class="none">Nothing to plot.</p>'
    low, high = min(values), max(values)
    if log:
        low, high = math.log10(low), math.log10(high)
    if high - low < 1e-12:
        low, high = low - 0.5, high + 0.5
    rows = (len(series) + 2) // 3
    left, right, top, bottom = 52, 12, 10, 26 + 13 * rows
    height += 13 * (rows - 1)
    plot_w, plot_h = width - left - right, height - top - bottom
    span = max(len(layers) - 1, 1)

    def x(i: int) -> float:
        return left + plot_w * (i / span if len(layers) > 1 else 0.5)

    def y(v: float) -> float:
        v = math.log10(v) if log else v
        return top + plot_h * (1 - (v - low) / (high - low))

    parts = [f'<svg class="chart" viewBox="0 0 {width} {height}" width="{width}" height="{height}" role="img" '
             f'aria-label="{escape(label)}">']
    for k in range(5):
        v = low + (high - low) * k / 4
        shown = 10 ** v if log else v
        yy = top + plot_h * (1 - k / 4)
        parts.append(f'<line class="grid" x1="{left}" x2="{width - right}" y1="{yy:.1f}" y2="{yy:.1f}"/>'
                     f'<text class="tick" x="{left - 4}" y="{yy + 3:.1f}" text-anchor="end">{escape(_number(shown))}</text>')
    if band:
        upper = [(x(i), y(v)) for i, v in enumerate(band[1]) if math.isfinite(v)]
        lower = [(x(i), y(v)) for i, v in enumerate(band[0]) if math.isfinite(v)]
        points = " ".join(f"{a:.1f},{b:.1f}" for a, b in upper + lower[::-1])
        parts.append(f'<polygon class="band" points="{points}"/>')
    for n, (name, line) in enumerate(series.items()):
        cls = SERIES_CLASSES[n % len(SERIES_CLASSES)]
        segments, current = [], []
        for i, v in enumerate(line):
            if v is None or not math.isfinite(v) or (log and v <= 0):
                if current:
                    segments.append(current)
                current = []
                continue
            current.append((x(i), y(v), layers[i], v))
        if current:
            segments.append(current)
        for segment in segments:
            points = " ".join(f"{a:.1f},{b:.1f}" for a, b, _, _ in segment)
            parts.append(f'<polyline class="line {cls}" points="{points}"/>')
            for a, b, layer, v in segment:
                parts.append(f'<circle class="dot {cls}" cx="{a:.1f}" cy="{b:.1f}" r="2.2"><title>layer {layer}: '
                             f'{escape(name)} {v:.4g}</title></circle>')
        lx = left + (n % 3) * (plot_w / 3)
        ly = top + plot_h + 28 + (n // 3) * 13
        parts.append(f'<line class="line {cls}" x1="{lx:.1f}" x2="{lx + 14:.1f}" y1="{ly - 3:.1f}" y2="{ly - 3:.1f}"/>'
                     f'<text class="legend" x="{lx + 18:.1f}" y="{ly:.1f}">{escape(name)}</text>')
    step = max(1, len(layers) // 10)
    for i in range(0, len(layers), step):
        parts.append(f'<text class="tick" x="{x(i):.1f}" y="{top + plot_h + 13}" text-anchor="middle">{layers[i]}</text>')
    parts.append(f'<line class="axis" x1="{left}" x2="{width - right}" y1="{top + plot_h}" y2="{top + plot_h}"/>'
                 f'<text class="label" x="{left - 40}" y="{top + plot_h + 13}">layer</text></svg>')
    return "".join(parts)
