"""Memory edits as the trace page's URL carries them.

``off=L:N`` switches memory N of layer L off (m := 0); ``edit=L:N=V`` with ``mode`` set, scale or add
(:data:`kvmem.intervention.MODES`) sets, scales or shifts its coefficient. Both repeat. The URL is the
whole state of an edit, so an edited trace can be shared as a link.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from urllib.parse import urlencode

from kvmem.errors import KvmemError

__all__ = ["Edits", "parse_edits", "MAX_EDITS"]

MAX_EDITS = 256
MODES = ("set", "scale", "add")
_OFF = re.compile(r"^\s*L?(\d+)\s*[:/]\s*(\d+)\s*$")
_EDIT = re.compile(r"^\s*L?(\d+)\s*[:/]\s*(\d+)\s*=\s*(\S+)\s*$")


@dataclass(frozen=True)
class Edits:
    """Memories switched off, and memories edited with ``mode``."""

    off: tuple[tuple[int, int], ...] = ()
    edits: tuple[tuple[tuple[int, int], float], ...] = ()
    mode: str = "set"

    def __bool__(self) -> bool:
        return bool(self.off or self.edits)

    def describe(self) -> str:
        parts = [f"{layer}:{neuron} off" for layer, neuron in self.off]
        verb = {"set": "=", "scale": "×", "add": "+"}[self.mode]
        parts += [f"{layer}:{neuron} {verb} {value:g}" for (layer, neuron), value in self.edits]
        return ", ".join(parts) or "none"

    def query(self) -> list[tuple[str, str]]:
        """The URL parameters of these edits."""
        out = [("off", f"{layer}:{neuron}") for layer, neuron in self.off]
        out += [("edit", f"{layer}:{neuron}={value:g}") for (layer, neuron), value in self.edits]
        if self.edits:
            out.append(("mode", self.mode))
        return out

    def encode(self) -> str:
        return urlencode(self.query())

    def to_dict(self) -> dict:
        return {"off": [list(pair) for pair in self.off], "mode": self.mode,
                "edits": [{"layer": layer, "neuron": neuron, "value": value} for (layer, neuron), value in self.edits],
                "description": self.describe()}


def parse_edits(off: list[str], edits: list[str], mode: str | None, *, layers: list[int], d_ff: int) -> Edits:
    """Parse and check the URL's edits against the model's layers and width; a one-line KvmemError if bad."""
    mode = mode or "set"
    if mode not in MODES:
        raise KvmemError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    if len(off) + len(edits) > MAX_EDITS:
        raise KvmemError(f"{len(off) + len(edits)} edits; at most {MAX_EDITS} at once")

    def neuron_of(layer: str, neuron: str, text: str) -> tuple[int, int]:
        pair = int(layer), int(neuron)
        if pair[0] not in layers:
            raise KvmemError(f"edit {text!r}: layer {pair[0]} is not one of the model's layers {layers[0]}..{layers[-1]}")
        if not 0 <= pair[1] < d_ff:
            raise KvmemError(f"edit {text!r}: neuron {pair[1]} is out of range 0..{d_ff - 1}")
        return pair

    switched = []
    for text in off:
        match = _OFF.match(text)
        if match is None:
            raise KvmemError(f"off= expects LAYER:NEURON (e.g. 12:301), got {text!r}")
        switched.append(neuron_of(match.group(1), match.group(2), text))
    changed: dict[tuple[int, int], float] = {}
    for text in edits:
        match = _EDIT.match(text)
        value = None
        if match is not None:
            try:
                value = float(match.group(3))
            except ValueError:
                pass
        if value is None or not math.isfinite(value):
            raise KvmemError(f"edit= expects LAYER:NEURON=VALUE with a finite number (e.g. 12:301=3.0), got {text!r}")
        changed[neuron_of(match.group(1), match.group(2), text)] = value
    both = sorted(set(switched) & set(changed))
    if both:
        raise KvmemError(f"{both[0][0]}:{both[0][1]} is both switched off and edited; keep one")
    return Edits(off=tuple(dict.fromkeys(switched)), edits=tuple(changed.items()), mode=mode)
