"""The read-ahead thread (kvmem/scanning/prefetch.py) against the plain walk (kvmem.plan.iterate_batches):
the same batches in the same order, each block end with the position the plain walk had there, errors
raised in the consumer, and a consumer that stops early stops the thread."""

from __future__ import annotations

import threading

import pytest
from conftest import SHORT_DOCS

from kvmem.corpus import open_corpus
from kvmem.errors import KvmemError
from kvmem.plan import StreamPosition, TokenPlan, iterate_batches
from kvmem.scanning.prefetch import prefetched_batches

PLAN = TokenPlan(window=4, bos_token_id=None, batch_size=2, block_documents=2)


def plain_walk(tokenizer, documents):
    events, position = [], StreamPosition()

    def at_end(block: int) -> None:
        events.append(("end", block, position.to_json(), list(position.read_digests)))

    for batch in iterate_batches(documents, tokenizer, PLAN, position, on_block_end=at_end):
        events.append(("batch", batch.block, [(w.doc, w.start, w.tokens) for w in batch.windows]))
    return events, position


def test_the_same_batches_and_block_ends_as_the_plain_walk(gpt2_model):
    documents = list(open_corpus(SHORT_DOCS * 3))
    want, want_end = plain_walk(gpt2_model.tokenizer, documents)
    got, position = [], StreamPosition()

    def at_end(end) -> None:
        saved = end.position()
        got.append(("end", end.block, saved.to_json(), list(saved.read_digests)))

    for batch in prefetched_batches(documents, gpt2_model.tokenizer, PLAN, position, rank=0, world=1,
                                    on_block_end=at_end, depth=3):
        got.append(("batch", batch.block, [(w.doc, w.start, w.tokens) for w in batch.windows]))
    assert got == want and sum(e[0] == "end" for e in got) > 3
    assert position.to_json() == want_end.to_json() and list(position.read_digests) == list(want_end.read_digests)


def test_an_error_in_the_walk_is_raised_in_the_consumer(gpt2_model):
    def documents():
        yield from open_corpus(SHORT_DOCS)
        raise KvmemError("the corpus could not be read past document 6")

    batches = prefetched_batches(documents(), gpt2_model.tokenizer, PLAN, StreamPosition(), rank=0, world=1,
                                 on_block_end=lambda end: None)
    with pytest.raises(KvmemError, match="could not be read past document 6"):
        list(batches)


def test_a_consumer_that_stops_early_stops_the_thread(gpt2_model):
    documents = list(open_corpus(SHORT_DOCS * 20))
    batches = prefetched_batches(documents, gpt2_model.tokenizer, PLAN, StreamPosition(), rank=0, world=1,
                                 on_block_end=lambda end: None, depth=1)
    next(batches)
    batches.close()
    assert not any(t.name == "kvmem-prefetch" and t.is_alive() for t in threading.enumerate())
