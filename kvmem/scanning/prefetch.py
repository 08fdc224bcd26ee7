"""Read and tokenize ahead of the forward: the corpus walk in a thread, the batches through a small queue.

On a GPU the forward of a batch takes less time than reading and tokenizing the next one, so the
two are overlapped: a producer thread runs :func:`kvmem.plan.iterate_batches` and puts each batch
into a bounded queue (``depth`` batches ahead), and the scan takes them out in the same order. The
walk's block ends travel through the queue too, so the scan checkpoints exactly where it would
without the thread, with the stream position as it stood at that block end (the producer's own
position has moved on). An error in the producer (a changed corpus, a tokenizer failure) is raised
in the scan; an error in the scan stops the producer.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from kvmem.plan import Batch, StreamPosition, iterate_batches

__all__ = ["BlockEnd", "prefetched_batches"]


@dataclass(frozen=True)
class BlockEnd:
    """Every block before ``block`` is complete; the stream position at that moment, held as its fields
    and the number of document digests (the producer's digest array only grows, so its prefix is that
    moment's: no copy per block)."""

    block: int
    fields: tuple[int, int, int, str]  # blocks_done, tokens, documents, corpus_digest
    digests: int
    live: StreamPosition

    def position(self) -> StreamPosition:
        """The stream position at this block end (copies the digests: call it when saving)."""
        return StreamPosition(*self.fields, self.live.read_digests[:self.digests])


_DONE = object()


def _block_end(block: int, position: StreamPosition) -> BlockEnd:
    fields = (position.blocks_done, position.tokens, position.documents, position.corpus_digest)
    return BlockEnd(block, fields, len(position.read_digests), position)


def prefetched_batches(documents, tokenizer, plan, position: StreamPosition, *, rank: int, world: int,
                       on_block_end: Callable[[BlockEnd], None], depth: int = 2) -> Iterator[Batch]:
    """The batches of ``iterate_batches(documents, tokenizer, plan, position, ...)``, read ``depth`` ahead
    in a thread. ``on_block_end(end)`` is called in the caller's thread, after the block's batches were
    consumed (``end.position()`` is the position at that block end); when the walk ends ``position``
    holds where it ended."""
    slots: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(item) -> bool:
        while not stop.is_set():
            try:
                slots.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            walk = iterate_batches(documents, tokenizer, plan, position, rank=rank, world=world,
                                   on_block_end=lambda block: put(_block_end(block, position)))
            for batch in walk:
                if not put(batch):
                    return
            put(_DONE)
        except BaseException as error:  # raised again in the consumer
            put(error)

    thread = threading.Thread(target=produce, name="kvmem-prefetch", daemon=True)
    thread.start()
    try:
        while True:
            item = slots.get()
            if item is _DONE:
                return
            if isinstance(item, BaseException):
                raise item
            if isinstance(item, BlockEnd):
                on_block_end(item)
                continue
            yield item
    finally:
        stop.set()
        thread.join()
