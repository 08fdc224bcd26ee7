"""What every scorer shares: the task it builds from held-out examples, and its result.

A scorer turns a side's held-out examples into a :class:`Task` (queries a judge answers, the truth,
and the example each query belongs to), then turns the judge's answers into a :class:`Score`
with a bootstrap interval over examples. Queries are plain data, so one judge call can answer the
tasks of many neurons at once (concurrently for LLM judges).
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Query", "Task", "Score", "select_active", "PER_BAND"]

PER_BAND = 10  # activating examples per band, as Delphi's 10 per decile


@dataclass(frozen=True, kw_only=True)
class Query:
    """tokens: [T] the context shown;  index: the token asked about (detection: the last token shown;
    fuzzing: the highlighted token; simulation: -1, every token)."""

    tokens: tuple[str, ...]
    index: int


@dataclass(frozen=True, kw_only=True)
class Task:
    """queries [Q]; truth [Q] (bool, or a [T] float array per query for simulation); group [Q]: the example
    each query came from (the bootstrap resamples examples); codes: their position codes."""

    scorer: str
    queries: tuple[Query, ...]
    truth: tuple
    group: tuple[int, ...]
    codes: tuple[int, ...]


@dataclass(frozen=True, kw_only=True)
class Score:
    """score with its 95% bootstrap interval (low, high); n: examples; judge: who answered; codes: held-out
    examples used."""

    scorer: str
    score: float
    low: float
    high: float
    n: int
    judge: str = ""
    codes: tuple[int, ...] = field(default=())


def select_active(examples, per_band: int = PER_BAND) -> list:
    """Held-out activating examples, at most ``per_band`` from each band (top, q0.999, q0.99, q0.9, random),
    in code order (the split's hash already made the held-out set a seeded sample)."""
    by_band: dict[str, list] = {}
    for e in sorted(examples, key=lambda e: e.code):
        if e.active:
            by_band.setdefault(e.band, []).append(e)
    return [e for band in by_band.values() for e in band[:per_band]]
