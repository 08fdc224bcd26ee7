"""A document's tokens, exactly as one tokenizer call over the whole text gives them, in pieces.

A scan reads documents of any length: a million-token document must not cost a million tokens of
Python objects at once. :func:`token_pieces` tokenizes a long text chunk by chunk and yields pieces
whose concatenation is the whole-text tokenization, ids and character offsets alike.

The rule for a cut, and the check that makes it exact:

- a chunk ends at a *cut*: a position ``q`` where a non-space character is followed by whitespace
  (every pre-tokenizer of the GPT-2, Llama-3, Qwen and SentencePiece families splits there);
- the cut is accepted only if a context around it, ``text[s:q+V]`` with ``s`` another cut
  ``MARGIN`` characters or more before ``q``, tokenizes with a token starting at ``q``, with the
  chunk's own tokens before ``q`` (from 64 characters past ``s``), and with the tokens of
  ``text[q:q+V]`` after ``q`` (up to 64 characters before ``q+V``). So the
  cut is invisible from either side: nothing at the end of the left chunk depends on what follows,
  and nothing at the start of the right chunk on where it starts (a prefix space, a prepended
  marker);
- where no cut passes (one word longer than a chunk, a tokenizer that splits elsewhere), the rest
  of the text is tokenized in one call: exact, with memory linear in that rest.

Short texts (at most ``2 * CHUNK`` characters) always take one call.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

__all__ = ["CHUNK", "Encode", "encoder", "token_pieces"]

CHUNK = 1 << 16  # characters per piece of a long text (about 15,000 GPT-2 tokens of English)
MARGIN = 512  # characters of context checked on each side of a cut

Encode = Callable[[str], "tuple[list[int], list[tuple[int, int]] | None]"]


def encoder(tokenizer) -> Encode:
    """text -> (ids, character offsets or None), no special tokens: the scan's one tokenizer call."""
    if getattr(tokenizer, "is_fast", False):
        def encode(text: str):
            encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
            return encoded["input_ids"], [tuple(o) for o in encoded["offset_mapping"]]
    else:
        def encode(text: str):
            return tokenizer(text, add_special_tokens=False)["input_ids"], None
    return encode


def _cut_before(text: str, end: int, low: int) -> int | None:
    """The last cut in (low, end]: text[q-1] is not whitespace and text[q] is."""
    for q in range(min(end, len(text) - 1), low, -1):
        if text[q].isspace() and not text[q - 1].isspace():
            return q
    return None


def _from(ids: list[int], offsets: list[tuple[int, int]], start: int) -> int | None:
    """Index of the token that starts at character ``start`` (None if no token starts there)."""
    for index, (begin, _) in enumerate(offsets):
        if begin == start:
            return index
        if begin > start:
            return None
    return None


def _cut_is_exact(encode: Encode, text: str, s: int, q: int, left: tuple[list, list], a: int) -> bool:
    """Whether cutting ``text`` at ``q`` is invisible (see the module docstring). ``left``: the tokens
    of ``text[a:q]`` (offsets relative to ``a``)."""
    v = min(len(text), q + MARGIN)
    ctx_ids, ctx_off = encode(text[s:v])
    right_ids, right_off = encode(text[q:v])
    at_q = _from(ctx_ids, ctx_off, q - s)
    if at_q is None or not right_ids or right_off[0][0] != 0:
        return False
    # the left chunk equals the context from its first token 64 characters past s (clear of any effect
    # of the context's own start) up to q, token for token
    first = next((i for i, (b, _) in enumerate(ctx_off[:at_q]) if b >= 64), None)
    if first is None:
        return False
    left_first = _from(left[0], left[1], s + ctx_off[first][0] - a)
    if left_first is None or left[0][left_first:] != ctx_ids[first:at_q]:
        return False
    if [(b + a - s, e + a - s) for b, e in left[1][left_first:]] != list(ctx_off[first:at_q]):
        return False
    # after q, the right chunk's first tokens equal the context's, except near v (where both are cut)
    keep = [i for i, (_, e) in enumerate(right_off) if e + q <= v - 64]
    if not keep:
        return False
    n = keep[-1] + 1
    return (ctx_ids[at_q:at_q + n] == right_ids[:n]
            and [(b + s - q, e + s - q) for b, e in ctx_off[at_q:at_q + n]] == list(right_off[:n]))


def token_pieces(encode: Encode, text: str, *, chunk: int = CHUNK) -> Iterator[tuple[list[int], list | None]]:
    """Pieces (ids, offsets into ``text`` or None) whose concatenation is ``encode(text)``."""
    a = 0
    while True:
        if len(text) - a <= 2 * chunk:
            yield _shifted(encode(text[a:]), a)
            return
        q = _cut_before(text, a + chunk, a + chunk // 2)
        s = _cut_before(text, q - MARGIN, a) if q is not None else None
        if s is None:
            yield _shifted(encode(text[a:]), a)
            return
        left = encode(text[a:q])
        if left[1] is None or not _cut_is_exact(encode, text, s, q, left, a):
            yield _shifted(encode(text[a:]), a)  # no offsets to check a cut with, or the cut shows: one call
            return
        yield _shifted(left, a)
        a = q


def _shifted(piece: tuple[list[int], list | None], by: int) -> tuple[list[int], list | None]:
    ids, offsets = piece
    if offsets is None or by == 0:
        return ids, offsets
    return ids, [(b + by, e + by) for b, e in offsets]
