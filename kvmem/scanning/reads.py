"""Reading sizes from the device in rounds: one host synchronisation per round, shared by every
step that needs a number from the device before it can go on.

A streaming step whose output size is data (how many candidates enter a side, how many sampled
positions reach a cell) must read that size on the host: on a GPU each such read waits for all the
work queued before it. Written as a *pending step*, a generator that yields a 1-d int64 tensor on
the device (the sizes it needs) and receives them as a list of Python ints, several independent
steps share their reads: :func:`run_rounds` advances each to its next read, reads every request of
the round with one copy, hands each its part, and repeats until all have finished. A layer whose
steps each need at most two reads costs two synchronisations, however many steps it runs.

Steps run in rounds must be independent within a round, or safe to interleave: a step reads the
state its generator holds as of its last round, and writes it when it resumes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator, Iterator

import torch
from torch import Tensor

__all__ = ["Pending", "Reads", "run_rounds", "sizes"]

# a step that yields int64 [n] tensors (the numbers it needs) and receives them as list[int]
Pending = Generator[Tensor, list, None]


def sizes(*values: Tensor) -> Tensor:
    """0-dim (or one-element) device tensors -> one int64 [n] request."""
    return torch.stack([v.reshape(()).to(torch.int64) for v in values])


def run_rounds(steps: list[Pending]) -> None:
    """Run pending steps to their ends, their reads of each round in one device-to-host copy."""
    waiting: list[tuple[Pending, Tensor]] = []
    for step in steps:
        _advance(step, None, waiting)
    while waiting:
        values = torch.cat([request for _, request in waiting]).tolist()  # the round's one synchronisation
        current, waiting, at = waiting, [], 0
        for step, request in current:
            n = request.numel()
            _advance(step, values[at:at + n], waiting)
            at += n


def _advance(step: Pending, values: list | None, waiting: list) -> None:
    try:
        request = next(step) if values is None else step.send(values)
    except StopIteration:
        return
    waiting.append((step, request))


class Reads:
    """The pending steps of one unit of work (a layer of a batch), run together when it ends.

    ``defer(step)`` queues a step inside :meth:`collecting`, and runs it at once outside (a call
    made on its own, by a test or at the end of a stream, needs no context)."""

    def __init__(self):
        self._queue: list[Pending] | None = None

    def defer(self, step: Pending | None) -> None:
        if step is None:
            return
        if self._queue is None:
            run_rounds([step])
        else:
            self._queue.append(step)

    @contextlib.contextmanager
    def collecting(self) -> Iterator[None]:
        """Queue the steps deferred inside; run them in shared rounds when the block ends without an error."""
        outer, self._queue = self._queue, []
        try:
            yield
            queued = self._queue
        finally:
            self._queue = outer
        run_rounds(queued)
