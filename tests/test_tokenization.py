"""Long documents in pieces (kvmem/tokenization.py, kvmem/plan.py) against one tokenizer call over the
whole text: ids, offsets and windows equal, for the real GPT-2 tokenizer and for SentencePiece-style
tokenizers (a prepended marker, a Metaspace pre-tokenizer) where some cuts show and must be refused."""

from __future__ import annotations

import random

import pytest

import kvmem.plan
import kvmem.tokenization as tokenization
from kvmem.corpus import open_corpus
from kvmem.plan import StreamPosition, TokenPlan, iterate_batches
from kvmem.tokenization import encoder, token_pieces


def joined(pieces) -> tuple[list[int], list]:
    ids, offsets = [], []
    for piece_ids, piece_offsets in pieces:
        ids += piece_ids
        offsets += piece_offsets
    return ids, offsets


def adversarial(seed: int, parts: int = 3000) -> str:
    rng = random.Random(seed)
    atoms = ["word", " ", "  ", "\n", "\n\n", "\t", " \n", "123", "4567", "é", "日本語", "!!", "'s", " 's", "..",
             "\u00a0", "\u200b", "🙂"]
    return "".join(rng.choice(atoms) if rng.random() < 0.9 else "x" * rng.randint(1, 40) for _ in range(parts))


@pytest.fixture(scope="module")
def pydoc_text() -> str:
    return "\n\n".join(d.text for d in open_corpus("pydoc"))


def counted_cuts(monkeypatch) -> dict:
    """Count the cuts the exactness check accepts and refuses (the check itself runs unchanged)."""
    seen = {"accepted": 0, "refused": 0}
    real = tokenization._cut_is_exact

    def spy(*args, **kwargs):
        exact = real(*args, **kwargs)
        seen["accepted" if exact else "refused"] += 1
        return exact

    monkeypatch.setattr(tokenization, "_cut_is_exact", spy)
    return seen


def test_gpt2_pieces_equal_one_call(gpt2_model, pydoc_text, monkeypatch):
    encode = encoder(gpt2_model.tokenizer)
    cuts = counted_cuts(monkeypatch)
    assert joined(token_pieces(encode, pydoc_text, chunk=4096)) == encode(pydoc_text)
    assert cuts["accepted"] > 100 and cuts["refused"] == 0  # pydoc cuts cleanly: really in pieces
    for seed in range(12):
        text = adversarial(seed)
        assert joined(token_pieces(encode, text, chunk=1200)) == encode(text), seed


def sentencepiece_like(kind: str, texts: list[str]):
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    if kind == "prepend":  # Llama-2's legacy form: a marker before every text, spaces made markers
        tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tokenizer.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>"]))
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>")


@pytest.mark.parametrize("kind", ["prepend", "metaspace"])
def test_sentencepiece_style_pieces_equal_one_call(kind, pydoc_text, monkeypatch):
    """With a marker prepended to every text, a piece that starts at a cut would gain a marker: every cut
    is refused and the rest is tokenized in one call. Either way the tokens are those of one call."""
    encode = encoder(sentencepiece_like(kind, pydoc_text.split("\n\n")[:200]))
    text = pydoc_text[:200_000]
    cuts = counted_cuts(monkeypatch)
    assert joined(token_pieces(encode, text, chunk=4096)) == encode(text)
    if kind == "prepend":
        assert cuts == {"accepted": 0, "refused": 1}
    else:
        assert cuts["accepted"] > 0


def whole_document_windows(tokenizer, text: str, window: int) -> list[tuple]:
    ids, offsets = encoder(tokenizer)(text)
    return [(start, tuple(ids[start:start + window]), ids[start + window] if start + window < len(ids) else -1,
             tuple(offsets[start:start + window])) for start in range(0, len(ids), window)]


@pytest.mark.parametrize("max_tokens", [None, 5000])
def test_a_long_documents_windows_are_those_of_one_call(gpt2_model, pydoc_text, monkeypatch, max_tokens):
    """A document longer than two pieces is counted, then tokenized again piece by piece as its windows are
    read: the windows (tokens, offsets, the token after each) and batches equal those cut from one call."""
    monkeypatch.setattr(kvmem.plan, "CHUNK", 3000)
    text = pydoc_text[:60_000]
    documents = list(open_corpus(["a short first document", text, "and a short last one"]))
    plan = TokenPlan(window=64, bos_token_id=None, batch_size=3, max_tokens=max_tokens, sort_by_length=True)
    position = StreamPosition()
    got = [w for batch in iterate_batches(documents, gpt2_model.tokenizer, plan, position) for w in batch.windows]
    want = {d.index: whole_document_windows(gpt2_model.tokenizer, d.text, 64) for d in documents}
    by_doc = {doc: [(w.start, w.tokens, w.following, w.offsets) for w in got if w.doc == doc] for doc in want}
    if max_tokens is None:
        assert by_doc == want
        assert position.tokens == sum(len(encoder(gpt2_model.tokenizer)(d.text)[0]) for d in documents)
    else:
        assert position.tokens == max_tokens == sum(len(w.tokens) for w in got)
        first = len(want[0][0][1])
        long_windows = by_doc[1]
        assert long_windows[:-1] == want[1][:len(long_windows) - 1]
        start, tokens, following, offsets = long_windows[-1]
        assert (start, tokens, offsets) == (want[1][len(long_windows) - 1][0], want[1][len(long_windows) - 1][1][
            :len(tokens)], want[1][len(long_windows) - 1][3][:len(tokens)])
        assert sum(len(t) for _, t, _, _ in long_windows) == max_tokens - first
