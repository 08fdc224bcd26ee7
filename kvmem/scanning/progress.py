"""Phases of a scan with their progress bars and wall-clock seconds (shown, and kept for the manifest)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["Phases"]


class _NullBar:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


class Phases:
    """``with phases.phase("texts", total=n) as bar: ... bar.update()``; ``phases.seconds`` per phase.

    A bar appears once its phase has run for a second (the streaming bar at once), so no step
    longer than that is silent and short ones print nothing.
    """

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.seconds: dict[str, float] = {}
        self.started = time.perf_counter()
        self._open: tuple[str, float] | None = None

    @contextmanager
    def phase(self, name: str, *, unit: str = "step", total: int | None = None) -> Iterator:
        bar = _NullBar()
        if self.enabled:
            from tqdm.auto import tqdm

            bar = tqdm(total=total, unit=unit, unit_scale=unit == "tok", desc=name, smoothing=0.1,
                       delay=0 if name == "stream" else 1.0, leave=name == "stream")
        started = time.perf_counter()
        self._open = (name, started)
        try:
            yield bar
        finally:
            bar.close()
            self.seconds[name] = round(self.seconds.get(name, 0.0) + time.perf_counter() - started, 3)
            self._open = None

    def so_far(self) -> dict[str, float]:
        """Seconds per phase, the phase still running included (up to now)."""
        out = dict(self.seconds)
        if self._open is not None:
            name, started = self._open
            out[name] = round(out.get(name, 0.0) + time.perf_counter() - started, 3)
        return out

    def elapsed(self) -> float:
        return round(time.perf_counter() - self.started, 3)
