"""Explanations as report rows and text lines (for ``kvmem neuron``, the reports and the exports)."""

from __future__ import annotations

import math

__all__ = ["explanation_dicts", "explanation_lines", "SCORE_NAMES"]

SCORE_NAMES = ("detection", "fuzzing", "simulation")


def _num(value) -> float | None:
    value = float(value)
    return value if math.isfinite(value) else None


def explanation_dicts(frame) -> list[dict]:
    """One JSON-ready dict per row: side, explainer, text, rule and each score with its interval and baselines."""
    out = []
    if not len(frame):  # itertuples would still build a namedtuple class of every column
        return out
    for row in frame.itertuples(index=False):
        scores = {}
        for name in SCORE_NAMES:
            if _num(getattr(row, name)) is None:
                continue
            scores[name] = {"score": _num(getattr(row, name)), "low": _num(getattr(row, f"{name}_low")),
                            "high": _num(getattr(row, f"{name}_high")), "n": int(getattr(row, f"{name}_n")),
                            "judge": getattr(row, f"{name}_judge"),
                            "baseline": _num(getattr(row, f"{name}_baseline")),
                            "baseline_low": _num(getattr(row, f"{name}_baseline_low")),
                            "baseline_high": _num(getattr(row, f"{name}_baseline_high")),
                            "baseline_from": int(getattr(row, f"{name}_baseline_from")),
                            "random_init": _num(getattr(row, f"{name}_random_init")),
                            "random_init_low": _num(getattr(row, f"{name}_random_init_low")),
                            "random_init_high": _num(getattr(row, f"{name}_random_init_high"))}
        out.append({"layer": int(row.layer), "neuron": int(row.neuron), "side": row.side, "explainer": row.explainer,
                    "explainer_model": row.explainer_model, "prompt_version": row.prompt_version,
                    "prompt_hash": row.prompt_hash, "text": row.text, "rule": row.rule or None, "scores": scores})
    return out


def _interval(entry: dict, key: str = "") -> str:
    value, low, high = entry[key or "score"], entry[f"{key}_low" if key else "low"], entry[f"{key}_high" if key else "high"]
    if value is None:
        return "n/a"
    return f"{value:.2f} [{low:.2f}, {high:.2f}]" if low is not None and high is not None else f"{value:.2f}"


def explanation_lines(frame) -> list[str]:
    """Readable lines: the text, then 'detection 0.93 [0.85, 1.00] (baseline 0.51 [..])' per score."""
    lines = []
    for entry in explanation_dicts(frame):
        lines.append(f"  {entry['side']} ({entry['explainer']}): {entry['text']}")
        for name, s in entry["scores"].items():
            extra = f"; baseline {_interval(s, 'baseline')}" if s["baseline"] is not None else ""
            extra += f"; random-init {_interval(s, 'random_init')}" if s["random_init"] is not None else ""
            lines.append(f"      {name} {_interval(s)} on {s['n']} held-out examples{extra}")
    return lines
