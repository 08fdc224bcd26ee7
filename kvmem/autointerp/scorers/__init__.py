"""The scorers: one module each, registered by name (``kvmem score --scorers``).

Each module has ``NAME``, ``ANSWER`` (what the judge returns per query: ``bool``, ``values``, ``choice`` or
``similarity``), ``ASPECT`` (``input``: when the memory fires; ``output``: what it writes),
``build(side, *, per_band, seed, max_quiet, protocol) -> Task``, ``evaluate(task, answers, *, seed, n_boot,
judge) -> Score`` and ``paired(task, answers, base_answers, *, seed, n_boot) -> (low, high)`` (the interval
of the score minus its baseline's on the same examples). ``NEEDS`` names what ``build`` or ``answer`` takes
besides the evidence (``model``, ``embedder``); a module with ``answer(jobs, **needs)`` answers its own
queries instead of the judge.
"""

from __future__ import annotations

from types import ModuleType

from kvmem.autointerp.scorers import detection, embedding, fuzzing, output, simulation, steering
from kvmem.autointerp.scorers.base import Query, Score, Task
from kvmem.errors import KvmemError

__all__ = ["SCORERS", "get_scorers", "Query", "Score", "Task"]

SCORERS: dict[str, ModuleType] = {m.NAME: m for m in (detection, fuzzing, simulation, output, steering, embedding)}


def get_scorers(names) -> list[ModuleType]:
    """Scorer modules by name (a comma-separated string or a list)."""
    if isinstance(names, str):
        names = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in names if n not in SCORERS]
    if unknown or not names:
        raise KvmemError(f"unknown scorer(s) {unknown or '(none)'}; choose from {', '.join(SCORERS)}")
    return [SCORERS[n] for n in dict.fromkeys(names)]
