"""The tokenization plan: the one place that says which tokens a scan reads, and in which batch.

Every caller that turns a corpus into model inputs (the scan, its shards and ranks, the
experiments, token removal) goes through this module, so they agree to the token.

The rule, stable so anyone can recompute an activation:

- a document's text is tokenized alone, with no special tokens;
- window k of a document holds ``ids[k*W:(k+1)*W]``; the model reads ``[BOS] + window`` when
  ``bos_token_id`` is set (the BOS position is never scored);
- the first ``skip_first`` tokens of every window are read but not scored: the model computes them
  with no left context but BOS, and that is where position artefacts sit (massive activations on
  the first token, Sun et al. 2024, arXiv 2402.17762), which would otherwise lead the rankings;
- token ``pos`` of document ``doc`` is packed into one int64 *code* ``doc << 32 | pos``;
- documents are grouped into *blocks* of ``block_documents`` consecutive documents; with
  ``sort_by_length`` a block's documents are read shortest first (stable, so equal lengths keep
  corpus order; a document's windows stay together and in order), or with
  ``longest_windows_first`` its windows longest first: every full window in corpus order, then
  each document's shorter last window, longest first (stable); a batch holds consecutive
  windows of that order within one block, as many as fit ``batch_size × window`` padded positions
  (windows × the longest of them), so short documents (sentences) share a forward with little
  padding, and a document's short last window is not padded to a full one beside full windows;
  every batch is the same tensor whichever process computes it;
- ``max_tokens`` cuts the stream after that many scored tokens (the last window is shortened);
- a process with shard ``i/n`` and rank ``r`` of ``w`` takes the blocks ``b`` with
  ``b % n == i`` and ``(b // n) % w == r``.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from functools import partial

import numpy as np

from kvmem.errors import KvmemError
from kvmem.tokenization import CHUNK, encoder, token_pieces

__all__ = ["BATCH_SIZE_HELP", "parse_batch_size", "TokenPlan", "Batch", "WindowText", "pack", "unpack", "distinct_codes", "window_key", "iterate_batches", "DEFAULT_WINDOW",
           "DEFAULT_BLOCK_DOCUMENTS", "document_digest", "RULE"]

DEFAULT_WINDOW = 256
DEFAULT_BLOCK_DOCUMENTS = 64
RULE = ("each document is tokenized alone without special tokens; window k holds tokens "
        "[k*window, (k+1)*window); the model reads [BOS] + window when prepend_bos (BOS never scored); "
        "the first skip_first tokens of each window are read, not scored; "
        "a batch holds consecutive windows of one block of block_documents documents (shortest document "
        "first when sort_by_length, stable; when longest_windows_first, the block's full windows in corpus order, "
        "then each document's shorter last window, longest first, stable), as many as fit batch_size * window "
        "padded positions")


BATCH_SIZE_HELP = ("windows per forward (an integer), a token budget such as '4096 tokens' or '4096t' (whole "
                   "windows within it), or 'auto' (GPU: the largest batch that fits in 70%% of free memory; "
                   "CPU: 2048 tokens); the manifest records the number used")


def parse_batch_size(value) -> int | str:
    """An int >= 1 (windows), ``"N tokens"`` (a token budget, also ``"Nt"`` / ``"N tokens"``) or ``"auto"``;
    anything else is one line that says what is accepted."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    if isinstance(value, str):
        text = value.strip().lower().replace("_", "").replace(",", "")
        if text == "auto":
            return "auto"
        if text.isdigit() and int(text) >= 1:
            return int(text)
        for suffix in (" tokens", "tokens", " tok", "tok", "t"):
            number = text.removesuffix(suffix)
            if number != text and number.strip().isdigit() and int(number) >= 1:
                return f"{int(number)} tokens"
    raise KvmemError(f"batch size must be an integer >= 1 (windows per forward), a token budget like '4096 tokens', "
                     f"or 'auto'; got {value!r}")


MAX_DOCUMENTS = 1 << 31  # doc << 32 must stay below 2^63 (int64)
MAX_POSITIONS = 1 << 32  # pos fills the low 32 bits


def pack(doc, pos):
    """(doc, pos) -> int64 code ``doc << 32 | pos`` (ints, numpy arrays or torch tensors).

    Raises :class:`KvmemError` for a document index outside [0, 2^31) or a position outside [0, 2^32),
    which would otherwise wrap around into another document's codes.
    """
    _check_packable(doc, pos)
    if hasattr(doc, "to"):  # torch
        import torch

        return (doc.to(torch.int64) << 32) | pos.to(torch.int64)
    return (doc << 32) | pos


def _check_packable(doc, pos) -> None:
    for name, value, limit, fix in (
            ("document index", doc, MAX_DOCUMENTS, "scan fewer documents at once (a coarser --unit, or the "
                                                   "corpus in parts)"),
            ("token position", pos, MAX_POSITIONS, "split the document")):
        size = getattr(value, "size", None)
        if callable(getattr(value, "numel", None)):
            size = value.numel()
        if size == 0:
            continue
        low, high = (int(value.min()), int(value.max())) if size is not None else (int(value), int(value))
        if low < 0 or high >= limit:
            bad = low if low < 0 else high
            raise KvmemError(f"{name} {bad:,} is outside [0, {limit:,}), the range a (doc, pos) code packs "
                             f"(doc << 32 | pos); {fix}")


def unpack(code):
    """code -> (doc, pos)."""
    return code >> 32, code & 0xFFFFFFFF


def distinct_codes(arrays) -> np.ndarray:
    """The sorted distinct codes >= 0 (empty entries are -1) of int64 arrays of any shape.

    Hash-based (pandas), then a sort of the few distinct ones: millions of kept entries point to
    thousands of positions, and sorting them all would cost ten times more."""
    import pandas as pd

    parts = [pd.unique(np.asarray(a, np.int64).reshape(-1)) for a in arrays]  # small: no big concatenation
    distinct = pd.unique(np.concatenate(parts)) if parts else np.empty(0, np.int64)
    return np.sort(distinct[distinct >= 0])


@dataclass(frozen=True, kw_only=True)
class TokenPlan:
    """Which tokens are read and how they are batched (recorded in the manifest as ``tokenization``).

    window:          tokens per window (BOS not counted)
    bos_token_id:    token read before every window and never scored; None = no BOS
    batch_size:      windows per forward when they are full (the padded budget is batch_size × window)
    max_tokens:      tokens read after which the stream stops (None = the whole corpus)
    skip_first:      tokens at the start of every window that are read but not scored (they have no
                     left context but BOS: position artefacts sit there); 0 scores every token
    block_documents: documents per block (the unit that shards and ranks share out)
    shard:           (i, n): this process's part of the blocks, for batch schedulers
    sort_by_length:  read each block's documents shortest first, so batches of short documents
                     are padded little (codes then no longer increase along the stream)
    longest_windows_first: with sort_by_length, read each block's windows longest first instead:
                     its full windows in corpus order, then each document's shorter last window,
                     longest first, so a document's tail shares a forward with windows of about its
                     length (pydoc, 256-token windows, 100,000 tokens: real tokens are 98.2% of
                     the positions computed, against 93.2%). A document's windows are then no longer
                     together: a scan that keeps per-document bests reads documents shortest first.
    """

    window: int
    bos_token_id: int | None
    batch_size: int = 8
    max_tokens: int | None = None
    block_documents: int = DEFAULT_BLOCK_DOCUMENTS
    shard: tuple[int, int] = (0, 1)
    sort_by_length: bool = True
    longest_windows_first: bool = False
    skip_first: int = 0

    def __post_init__(self) -> None:
        for name in ("window", "batch_size", "block_documents"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise KvmemError(f"{name} must be an integer >= 1, got {value!r}")
        if not isinstance(self.skip_first, int) or isinstance(self.skip_first, bool) or not 0 <= self.skip_first < self.window:
            raise KvmemError(f"skip_first must be an integer in 0..{self.window - 1} (tokens of each {self.window}-token "
                             f"window read but not scored), got {self.skip_first!r}")
        index, count = self.shard
        if not (isinstance(index, int) and isinstance(count, int) and count >= 1 and 0 <= index < count):
            raise KvmemError(f"shard must be i/N with 0 <= i < N, got {index}/{count}")
        object.__setattr__(self, "shard", (int(index), int(count)))
        if self.longest_windows_first and not self.sort_by_length:
            raise KvmemError("longest_windows_first orders windows by length: it needs sort_by_length")

    @property
    def offset(self) -> int:
        """Index of a window's first token in the model's input (1 with BOS)."""
        return 0 if self.bos_token_id is None else 1

    def window_start(self, pos: int) -> int:
        """Document position where the window holding ``pos`` starts."""
        return (pos // self.window) * self.window

    def scored(self, length: int) -> range:
        """Indices into a window of ``length`` tokens of the ones that are scored."""
        return range(min(self.skip_first, length), length)

    def model_input(self, tokens) -> list[int]:
        """The ids the model reads for one window's tokens."""
        return ([self.bos_token_id] if self.bos_token_id is not None else []) + list(tokens)

    def takes_block(self, block: int, rank: int = 0, world: int = 1) -> bool:
        index, count = self.shard
        return block % count == index and (block // count) % world == rank

    def to_dict(self) -> dict:
        data = asdict(self)
        data["shard"] = list(self.shard)
        data["prepend_bos"] = self.bos_token_id is not None
        data["rule"] = RULE
        return data

    @classmethod
    def from_dict(cls, data: dict) -> TokenPlan:
        """From a manifest's ``tokenization`` (format 1 atlases lack the batching fields)."""
        return cls(window=int(data["window"]), bos_token_id=data.get("bos_token_id"),
                   batch_size=int(data.get("batch_size", 8)), max_tokens=data.get("max_tokens"),
                   block_documents=int(data.get("block_documents", DEFAULT_BLOCK_DOCUMENTS)),
                   shard=tuple(data.get("shard", (0, 1))),
                   sort_by_length=bool(data.get("sort_by_length", False)),  # absent: read in corpus order
                   longest_windows_first=bool(data.get("longest_windows_first", False)),  # absent: documents
                   skip_first=int(data.get("skip_first", 0)))  # absent: every token was scored


@dataclass
class WindowText:
    """The text of one window as the model read it: what a trigger's context is cut from.

    ``offsets`` [(start, end)] are character offsets into ``text`` (the whole document) of
    each read token, or None for tokenizers without offsets (pieces are then decoded tokens).
    """

    doc: int
    doc_id: str
    start: int  # document position of tokens[0]
    tokens: tuple[int, ...]
    following: int  # the document's token after the last read one, -1 at the end
    text: str = field(repr=False)
    offsets: tuple[tuple[int, int], ...] | None = field(repr=False, default=None)

    @property
    def key(self) -> int:
        return window_key(self.doc, self.start)


def window_key(doc: int, start: int) -> int:
    return (int(doc) << 32) | int(start)


@dataclass
class Batch:
    """Windows read in one forward, in reading order.

    ``ordered``: the batch's codes increase along it and exceed every code this process read
    before (always so without ``sort_by_length``); streaming top-k can then skip tie checks.
    """

    block: int
    windows: list[WindowText]
    tokens: int  # tokens read in this batch (BOS not counted)
    ordered: bool = True


def document_digest(doc_id: str, text: str) -> str:
    return hashlib.sha256(doc_id.encode() + b"\0" + text.encode()).hexdigest()


def short_digest(digest: str) -> int:
    """The first 60 bits of a document's sha256 (hex) as a non-negative int64: what a resume compares."""
    return int(digest[:15], 16)


@dataclass
class StreamPosition:
    """Where the stream stands (all processes agree on it): enough to resume at a block boundary.

    ``read_digests`` holds :func:`short_digest` of every document read, in reading order (8 bytes a
    document); a resumed stream checks the documents it skips against them.
    """

    blocks_done: int = 0  # blocks fully read (by any process)
    tokens: int = 0  # scored tokens of the whole stream so far (all shards and ranks)
    documents: int = 0  # documents read so far
    corpus_digest: str = ""  # chained sha256 over (id, text) of every document read
    read_digests: array = field(default_factory=lambda: array("q"), repr=False, compare=False)

    def to_json(self) -> dict:
        """Every field but ``read_digests`` (saved as a tensor beside the state)."""
        return {name: getattr(self, name) for name in ("blocks_done", "tokens", "documents", "corpus_digest")}


def _check_unchanged(document, checked: int, position: StreamPosition) -> None:
    """Refuse a resumed stream whose already-read documents differ from what was read before."""
    digests = position.read_digests
    if checked >= len(digests):
        if not digests:  # a state from before digests were kept: nothing to check against
            return
        raise KvmemError(f"the corpus changed since the checkpoint: document {document.index} ({document.id!r}) "
                         f"lies in a block that was complete with {len(digests)} documents; rerun on the "
                         f"original corpus, or start over without --resume")
    if short_digest(document_digest(document.id, document.text)) != digests[checked]:
        raise KvmemError(f"the corpus changed since the checkpoint: document {document.index} ({document.id!r}) "
                         f"differs from the one read before; rerun on the original corpus, or start over "
                         f"without --resume")


class _ReadDocument:
    """One document of a block, its windows made when they are read (see :func:`iterate_batches`).

    A document that fits one tokenizer piece keeps its ids and offsets; a longer one keeps
    only its token count and is tokenized again, piece by piece, when its windows are read, so its
    memory is a piece and a batch, whatever its length.
    """

    def __init__(self, document, tokens: int, window: int, pieces: Callable[[], Iterator], kept=None):
        self.document, self.tokens, self.window = document, tokens, window
        self._pieces, self._kept = pieces, kept

    def windows(self) -> Iterator[WindowText]:
        pieces = iter([self._kept] if self._kept is not None else self._pieces())
        w, total, doc = self.window, self.tokens, self.document
        ids: list[int] = []
        offsets: list | None = []
        at = 0  # ids[at] is the token at document position `base`
        base = 0
        while base < total:
            n = min(w, total - base)
            while len(ids) - at <= n:  # the window and the token after it (if the document has one)
                piece = next(pieces, None)
                if piece is None:
                    break
                if at > len(ids) // 2:  # drop what was read, now and then (cheap: amortised)
                    del ids[:at]
                    if offsets is not None:
                        del offsets[:at]
                    at = 0
                ids.extend(piece[0])
                if piece[1] is None:
                    offsets = None
                elif offsets is not None:
                    offsets.extend(piece[1])
            following = ids[at + n] if len(ids) - at > n else -1
            yield WindowText(doc.index, doc.id, base, tuple(ids[at:at + n]), following, doc.text,
                             tuple(offsets[at:at + n]) if offsets is not None else None)
            at += n
            base += n


def _longest_windows_first(reads: list[_ReadDocument]) -> Iterator[WindowText]:
    """The windows of a block's documents (``reads``, in corpus order) longest first, stable: every full
    window in corpus order, then each document's shorter last window (or only one), longest first. A
    last window is made with its document's others and kept (at most ``window`` tokens each)."""
    tails: list[WindowText] = []
    for read in reads:
        walk = read.windows()
        for _ in range(read.tokens // read.window):
            yield next(walk)
        if read.tokens % read.window:
            tails.append(next(walk))
    yield from sorted(tails, key=lambda tail: -len(tail.tokens))


def iterate_batches(documents, tokenizer, plan: TokenPlan, position: StreamPosition, *, rank: int = 0,
                    world: int = 1, on_block_end: Callable[[int], None] | None = None) -> Iterator[Batch]:
    """Walk the corpus under ``plan`` from ``position``; yield this process's batches.

    ``on_block_end(block)`` is called each time every block before ``block`` is complete (after
    the last batch of those blocks was yielded and consumed), so the caller can checkpoint there.
    ``position`` is updated in place as documents are read. Documents of blocks before
    ``position.blocks_done`` are skipped without tokenizing them (each is checked against its
    recorded digest). Foreign blocks are tokenized only when ``max_tokens`` needs their counts. A
    document longer than two tokenizer pieces (:mod:`kvmem.tokenization`) is held as its token count
    and tokenized again, piece by piece, as its windows are read: memory stays bounded by a piece and
    a batch, however long the document.
    """
    encode = encoder(tokenizer)
    block_docs = plan.block_documents
    current_block = position.blocks_done
    block_reads: list[_ReadDocument] = []  # this block's documents (of this process), in corpus order
    last_code = -1  # the highest code read so far by this process

    def batches() -> Iterator[Batch]:
        nonlocal block_reads
        if plan.longest_windows_first:
            windows = _longest_windows_first(block_reads)
        else:
            order = sorted(block_reads, key=lambda r: r.tokens) if plan.sort_by_length else block_reads
            windows = (w for read in order for w in read.windows())
        block_reads = []
        budget = plan.batch_size * plan.window  # padded positions per forward
        pending: list[WindowText] = []
        longest = 0
        for window in windows:
            n = len(window.tokens)
            if pending and (len(pending) + 1) * max(longest, n) > budget:
                yield _batch(pending)
                pending, longest = [], 0
            pending.append(window)
            longest = max(longest, n)
        if pending:
            yield _batch(pending)

    def _batch(windows: list[WindowText]) -> Batch:
        nonlocal last_code
        firsts = [window_key(w.doc, w.start) for w in windows]
        ordered = firsts[0] > last_code and all(a < b for a, b in zip(firsts, firsts[1:]))
        last_code = max(last_code, max(window_key(w.doc, w.start + len(w.tokens) - 1) for w in windows))
        return Batch(current_block, windows, sum(len(w.tokens) for w in windows), ordered)

    checked = 0  # documents of the blocks already done, compared with their recorded digests
    recorded = len(position.read_digests)  # documents read before this (resumed) stream
    for document in documents:
        block = document.index // block_docs
        if block < position.blocks_done:
            _check_unchanged(document, checked, position)
            checked += 1
            continue
        if checked < recorded:
            raise KvmemError(f"the corpus changed since the checkpoint: it now has {checked} documents where "
                             f"{recorded} were read before (document {document.index}, {document.id!r}, comes "
                             f"early); rerun on the original corpus, or start over without --resume")
        if block != current_block:
            yield from batches()
            position.blocks_done = block
            if on_block_end is not None:
                on_block_end(block)  # every block before `block` is complete
            current_block = block
        if plan.max_tokens is not None and position.tokens >= plan.max_tokens:
            break
        position.documents += 1
        digest = document_digest(document.id, document.text)
        position.corpus_digest = hashlib.sha256((position.corpus_digest + digest).encode()).hexdigest()
        position.read_digests.append(short_digest(digest))
        mine = plan.takes_block(block, rank, world)
        if not mine and plan.max_tokens is None:
            continue
        text = document.text
        pieces = partial(token_pieces, encode, text, chunk=CHUNK)
        if len(text) <= 2 * CHUNK:  # one piece (kvmem.tokenization): kept, not tokenized twice
            kept = encode(text)
            count = len(kept[0])
        else:  # counted now, tokenized again piece by piece when its windows are read
            kept, count = None, sum(len(ids) for ids, _ in pieces())
        if plan.max_tokens is not None:
            count = min(count, max(0, plan.max_tokens - position.tokens))
        position.tokens += count
        if mine and count:
            block_reads.append(_ReadDocument(document, count, plan.window, pieces, kept))
    if checked < recorded and position.documents == recorded:
        raise KvmemError(f"the corpus changed since the checkpoint: it ends after {checked} documents, and "
                         f"{recorded} were read before; rerun on the original corpus, or start over without "
                         f"--resume")
    yield from batches()
