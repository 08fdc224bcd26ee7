"""Tokens shaded by a neuron's coefficient: a robust colour scale, discrete levels, and text shown as it is.

A context is shown token by token, each shaded by the neuron's coefficient m there (orange for m > 0,
blue for m < 0). The colour scale is robust: full colour at the *median* coefficient of the neuron's
kept top triggers (and, for m < 0, the median of its bottom triggers), not at the largest value seen.
Coefficients are heavy-tailed (a few positions, often the first token of a window, reach values many
times the typical trigger): a scale set by the maximum would leave every other token pale. Values
beyond the scale saturate and are flagged, so nothing is hidden.

Text is shown faithfully: spaces stay spaces, a newline shows as ``↵`` and then breaks the line, a tab
as ``⇥``; characters that would be invisible or reorder the text (zero-width, bidi controls, other
controls) show as markers such as ``⟨U+200B⟩`` (:func:`kvmem.report.safe_text.visible`).

The explorer (:mod:`kvmem.explorer`) renders :func:`cells` with CSS classes (its pages forbid inline
styles); :func:`shaded_html` renders them with inline styles for notebooks.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from dataclasses import dataclass

from kvmem.report.safe_text import visible

__all__ = ["LEVELS", "Scale", "Cell", "robust_scale", "level", "shown", "cells", "shaded_html"]

LEVELS = 8  # shading steps per sign
POSITIVE_RGB, NEGATIVE_RGB = (217, 102, 31), (47, 109, 181)
MAX_ALPHA = 0.65


@dataclass(frozen=True)
class Scale:
    """|m| at which shading reaches full colour, per sign, and one sentence saying how it was chosen."""

    positive: float
    negative: float
    rule: str

    def to_dict(self) -> dict:
        return {"positive": self.positive, "negative": self.negative, "rule": self.rule}


def _median(values: Sequence[float]) -> float | None:
    finite = sorted(v for v in values if v is not None and math.isfinite(v))
    if not finite:
        return None
    mid = len(finite) // 2
    return finite[mid] if len(finite) % 2 else (finite[mid - 1] + finite[mid]) / 2


def robust_scale(top: Sequence[float], bottom: Sequence[float] = ()) -> Scale:
    """Full colour at the median of the positive coefficients among ``top`` (the top triggers' m) and at
    the median |m| of the negative ones among ``bottom``; a side with no such trigger borrows the other's
    scale (1.0 when neither has one)."""
    pos = _median([v for v in top if v is not None and v > 0])
    neg = _median([-v for v in bottom if v is not None and v < 0])
    fallback = pos or neg or 1.0
    pos, neg = pos or fallback, neg or fallback
    rule = (f"full colour at m = +{pos:.4g} (median of the top triggers) and m = −{neg:.4g} (median of the bottom "
            f"triggers); stronger values saturate and are underlined. A robust scale: a few extreme values do not "
            f"wash out the rest.")
    return Scale(positive=float(pos), negative=float(neg), rule=rule)


def level(value: float | None, scale: Scale) -> int:
    """The signed shading level of ``value``: 0 (unshaded) to ±LEVELS (full colour)."""
    if value is None or not math.isfinite(value) or value == 0:
        return 0
    full = scale.positive if value > 0 else scale.negative
    steps = math.ceil(min(abs(value) / full, 1.0) * LEVELS - 0.5)  # nearest step; tiny values stay unshaded
    return int(math.copysign(max(steps, 0), value))


def shown(token: str) -> str:
    """``token`` as it should appear: every character visible, a newline as ``↵`` followed by a real line break."""
    return "↵\n".join(visible(part) for part in str(token).split("\n"))


@dataclass(frozen=True)
class Cell:
    """One token of a shaded context."""

    text: str  # what to show (:func:`shown`)
    value: float | None  # the coefficient at this token, None when not stored
    level: int  # -LEVELS..LEVELS
    saturated: bool  # |value| beyond the scale
    trigger: bool  # the position the row is about


def cells(tokens: Sequence[str], activations: Sequence[float] | None, trigger: int, scale: Scale, *,
          trigger_value: float | None = None) -> list[Cell]:
    """A context as cells. ``activations``: m at each token (empty or None: only ``trigger_value`` is known,
    at token ``trigger``)."""
    activations = list(activations) if activations is not None else []
    out = []
    for i, token in enumerate(tokens):
        value = activations[i] if i < len(activations) else (trigger_value if i == trigger else None)
        value = None if value is None or not math.isfinite(value) else float(value)
        full = None if value is None else (scale.positive if value > 0 else scale.negative)
        out.append(Cell(text=shown(token), value=value, level=level(value, scale),
                        saturated=value is not None and abs(value) > full, trigger=i == trigger))
    return out


def shaded_html(row: Sequence[Cell]) -> str:
    """Cells as HTML with inline styles (for notebooks; the explorer uses classes): the trigger inside a ``<mark>``."""
    parts = []
    for cell in row:
        style = "white-space:pre-wrap;unicode-bidi:isolate;"
        if cell.level:
            rgb = POSITIVE_RGB if cell.level > 0 else NEGATIVE_RGB
            style += f"background:rgba({rgb[0]},{rgb[1]},{rgb[2]},{abs(cell.level) / LEVELS * MAX_ALPHA:.2f});"
        if cell.saturated:
            style += "text-decoration:underline;"
        title = f' title="m = {cell.value:.4g}"' if cell.value is not None else ""
        if cell.trigger:
            style += "outline:1.5px solid #222;font-weight:700;"
        span = f'<span style="{style}"{title}>{html.escape(cell.text)}</span>'
        parts.append(f"<mark>{span}</mark>" if cell.trigger else span)
    return "".join(parts)
