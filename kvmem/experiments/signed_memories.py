"""The memories a neuron is read as: its sides (``positive``; ``negative`` too for signed, gated FFNs), with the
trigger kind and value kind each side reads."""

from __future__ import annotations

from collections.abc import Sequence

from kvmem.errors import KvmemError

__all__ = ["SIDES", "memory_sides", "trigger_kind"]


# side -> (trigger kind prefix, value kind, sign): a signed neuron is two memories (Geva et al. 2022 read m_i v_i)
SIDES = {
    "positive": ("top", "promote", 1),  # the top triggers (largest m_i) with +v: the value's promoted tokens
    "negative": ("bottom", "suppress", -1),  # the bottom triggers (most negative m_i) with -v: its suppressed tokens
}


def memory_sides(gated: bool, sides: str | Sequence[str] | None = None) -> tuple[str, ...]:
    """The memories a neuron is read as: ``("positive",)`` for ReLU/GELU FFNs (the paper's reading), both sides
    for signed (gated SwiGLU/GeGLU) ones. ``sides`` overrides the default (a name or several)."""
    if sides is None:
        return ("positive", "negative") if gated else ("positive",)
    chosen = (sides,) if isinstance(sides, str) else tuple(dict.fromkeys(sides))
    unknown = [s for s in chosen if s not in SIDES]
    if unknown or not chosen:
        raise KvmemError(f"unknown memory side(s) {unknown or '(none)'}; choose from {', '.join(SIDES)}")
    return chosen


def trigger_kind(side: str, kind: str) -> str:
    """The atlas trigger kind of a memory side: ``kind`` is ``top`` (top-k positions) or ``top_doc`` (one per
    document); the negative side reads the matching ``bottom`` / ``bottom_doc`` triggers."""
    if kind not in ("top", "top_doc"):
        raise KvmemError(f"kind must be 'top' or 'top_doc' (the negative side reads bottom / bottom_doc), got {kind!r}")
    return SIDES[side][0] + kind.removeprefix("top")
