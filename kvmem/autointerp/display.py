"""Explanations as report rows and text lines (for ``kvmem neuron``, the reports and the exports).

Each score is shown with its interval, p-value, examples and baseline. The random-init copy's scores
are shown as a population (the layer's sides scored in the copy: median and quartiles, and the share
of them this score beats), never as the single random-init number of the same row: neuron i of a
random-init model has nothing to do with neuron i of the trained one.
"""

from __future__ import annotations

import math

from kvmem.autointerp.store import SCORER_NAMES
from kvmem.autointerp.tidy import percentile_of, random_init_reference

__all__ = ["explanation_dicts", "explanation_lines", "population_text", "SCORE_NAMES"]

SCORE_NAMES = SCORER_NAMES


def _num(value) -> float | None:
    value = float(value)
    return value if math.isfinite(value) else None


def _population(population, row, name: str, score) -> dict | None:
    if population is None:
        return None
    reference = random_init_reference(population, layer=int(row.layer), side=row.side, explainer=row.explainer,
                                      scorer=name)
    if reference is None:
        return None
    out = {k: reference[k] for k in ("n", "q1", "median", "q3")}
    out["share_below"] = None if score is None else percentile_of(reference, score)
    return out


def explanation_dicts(frame, *, population=None) -> list[dict]:
    """One JSON-ready dict per row: side, explainer, text, rule and each score with its interval, p-value,
    baselines and, when ``population`` (the explanations of the whole layer) is given, the random-init population
    of the layer (``random_init_population``: n, q1, median, q3, share_below)."""
    out = []
    if not len(frame):  # itertuples would still build a namedtuple class of every column
        return out
    for row in frame.itertuples(index=False):
        scores = {}
        for name in SCORE_NAMES:
            status = getattr(row, f"{name}_status")
            if _num(getattr(row, name)) is None and not status:
                continue
            score = _num(getattr(row, name))
            scores[name] = {"score": score, "low": _num(getattr(row, f"{name}_low")),
                            "high": _num(getattr(row, f"{name}_high")), "p": _num(getattr(row, f"{name}_p")),
                            "n": int(getattr(row, f"{name}_n")), "n_quiet": int(getattr(row, f"{name}_n_quiet")),
                            "status": status, "protocol": getattr(row, f"{name}_protocol"),
                            "judge": getattr(row, f"{name}_judge"),
                            "baseline": _num(getattr(row, f"{name}_baseline")),
                            "baseline_low": _num(getattr(row, f"{name}_baseline_low")),
                            "baseline_high": _num(getattr(row, f"{name}_baseline_high")),
                            "baseline_from": int(getattr(row, f"{name}_baseline_from")),
                            "diff_low": _num(getattr(row, f"{name}_diff_low")),
                            "diff_high": _num(getattr(row, f"{name}_diff_high")),
                            "random_init": _num(getattr(row, f"{name}_random_init")),
                            "random_init_low": _num(getattr(row, f"{name}_random_init_low")),
                            "random_init_high": _num(getattr(row, f"{name}_random_init_high")),
                            "random_init_population": _population(population, row, name, score)}
            scores[name]["random_init_text"] = population_text(scores[name])
        out.append({"layer": int(row.layer), "neuron": int(row.neuron), "side": row.side, "explainer": row.explainer,
                    "explainer_model": row.explainer_model, "prompt_version": row.prompt_version,
                    "prompt_hash": row.prompt_hash, "text": row.text, "rule": row.rule or None, "scores": scores})
    return out


def _interval(entry: dict, key: str = "") -> str:
    value, low, high = entry[key or "score"], entry[f"{key}_low" if key else "low"], entry[f"{key}_high" if key else "high"]
    if value is None:
        return "n/a"
    return f"{value:.2f} [{low:.2f}, {high:.2f}]" if low is not None and high is not None else f"{value:.2f}"


def population_text(s: dict) -> str:
    """'random-init layer population (3072 sides): median 0.53 [0.51, 0.56]; this score beats 97%', or ''."""
    ref = s.get("random_init_population")
    if not ref:
        return ""
    beats = "" if ref["share_below"] is None else f"; this score beats {ref['share_below']:.0%} of them"
    return (f"random-init layer population ({ref['n']} sides): median {ref['median']:.2f} "
            f"[{ref['q1']:.2f}, {ref['q3']:.2f}]{beats}")


def explanation_lines(frame, *, population=None) -> list[str]:
    """Readable lines: the text, then per score 'detection 0.93 [0.85, 1.00], p 0.001, on 60 held-out examples
    (40 quiet); baseline 0.51 [..]; minus baseline [0.30, 0.52]' and the random-init population of the layer."""
    lines = []
    for entry in explanation_dicts(frame, population=population):
        lines.append(f"  {entry['side']} ({entry['explainer']}): {entry['text']}")
        for name, s in entry["scores"].items():
            if s["status"] not in ("", "ok"):
                quiet = "" if s["n_quiet"] < 0 else f", {s['n_quiet']} quiet"
                lines.append(f"      {name}: not scored ({s['status']}: {s['n']} held-out examples{quiet})")
                continue
            quiet = f" ({s['n_quiet']} quiet)" if s["n_quiet"] >= 0 else ""
            p = f", p {s['p']:.3g}" if s["p"] is not None else ""
            protocol = f" [{s['protocol']} protocol]" if s["protocol"] not in ("", "kvmem") else ""
            extra = f"; baseline {_interval(s, 'baseline')}" if s["baseline"] is not None else ""
            if s["diff_low"] is not None:
                extra += f"; minus baseline [{s['diff_low']:.2f}, {s['diff_high']:.2f}]"
            lines.append(f"      {name} {_interval(s)}{p} on {s['n']} held-out examples{quiet}{protocol}{extra}")
            reference = population_text(s)
            if reference:
                lines.append(f"        {reference}")
    return lines
