"""The explorer: browse an atlas in a web browser (``kvmem serve``, :func:`explore`).

Pages with stable URLs (a neuron, a search, a trace with its edits) and the same data as JSON under
``/api`` (``docs/explorer.md``). Read-only; the model loads in the background.
"""

from __future__ import annotations

from typing import Any

__all__ = ["explore"]


def explore(atlas, *, model: Any = None, port: int = 0, host: str = "127.0.0.1", device: str = "cpu",
            load_model: bool = True):
    """Start the explorer on ``atlas`` (an :class:`~kvmem.atlas.Atlas` or its directory) in a background thread.

    Returns a handle with ``.url`` and ``.stop()``; in a notebook it shows the explorer inline. ``model``: a
    loaded :class:`~kvmem.models.Model` (used as it is, after a fingerprint check), a name or directory, or None
    for the model the manifest names (loaded in the background). ``load_model=False``: atlas pages only.

    >>> running = kvmem.explore(atlas)  # doctest: +SKIP
    >>> running.url  # doctest: +SKIP
    'http://127.0.0.1:40517/'
    """
    from kvmem.explorer.server import start_in_thread

    return start_in_thread(atlas, host=host, port=port, model=model, device=device, load_model=load_model)
