"""The ``tokens`` explainer and the ``tokens`` judge over a whole layer at once, as numpy array operations.

The per-side path (:class:`~kvmem.autointerp.explainers.tokens.TokensExplainer`, the scorers'
``build`` / ``evaluate`` and :class:`~kvmem.autointerp.judges.TokensJudge`) loops over examples and
tokens in Python. Here the same computations run on :class:`~kvmem.autointerp.layertable.LayerExamples`:

- every token of every context gets, for each rule kind, the id of the key that kind reads there
  (:class:`KeyTables`: the normalised token, the previous one, the last two or three), so applying
  a rule is a membership test of (rule, key id) pairs, for all queries at once;
- the explainer's counts ``pos_k`` / ``neg_k`` are one ``np.unique`` over (side, key) pairs, and
  its ranking one ``np.lexsort`` by (side, -gain, -pos_k, key text);
- the scorers' side of the judge is :mod:`kvmem.autointerp.array_scores`.

The results equal the per-side path's exactly (a test compares both on real atlases): the same
examples in the same order, the same floating-point operations in the same order where order
matters (sums of gains).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvmem.autointerp.explanation import Explanation
from kvmem.autointerp.token_rules import RULE_KINDS, Rule, normalize

__all__ = ["KeyTables", "explain_layer", "segment_rank", "KINDS"]

KINDS = tuple(RULE_KINDS)


@dataclass(frozen=True, eq=False)
class KeyTables:
    """keys [kinds, C, W]: dense id of the key each rule kind reads at each context token (-1: none);
    parts [D, 3] the normalised token ids of each key (-1 padded); kind [D]; order [D]: rank of the key's
    ``str()`` (the explainer's last tie-break); lookup: per kind, tuple of token ids -> dense id."""

    keys: np.ndarray
    parts: np.ndarray
    kind: np.ndarray
    order: np.ndarray
    lookup: list
    vocab: list
    vocab_index: dict

    @classmethod
    def build(cls, contexts) -> KeyTables:
        norm = contexts.norm  # [C, W]
        n_vocab = max(len(contexts.vocab), 1)
        inside = norm >= 0
        shifted = [norm]
        for back in (1, 2):
            s = np.full_like(norm, -1)
            s[:, back:] = norm[:, :-back]
            shifted.append(s)
        width = {kind: RULE_KINDS[kind][0] for kind in KINDS}
        raw_keys, parts_of = [], []
        for kind in KINDS:
            if kind == "current_token":
                cols = [shifted[0]]
            elif kind == "previous_token":
                cols = [shifted[1]]
            else:
                cols = [shifted[b] for b in range(width[kind] - 1, -1, -1)]  # oldest token first
            valid = inside & np.all([c >= 0 for c in cols], axis=0)
            packed = np.zeros_like(norm)
            for c in cols:
                packed = packed * n_vocab + np.maximum(c, 0)
            raw_keys.append(np.where(valid, packed, -1))
            parts_of.append(cols)
        keys = np.full((len(KINDS),) + norm.shape, -1, np.int64)
        parts, kinds, lookup, offset = [], [], [], 0
        for k in range(len(KINDS)):
            valid = raw_keys[k] >= 0
            distinct, inverse = np.unique(raw_keys[k][valid], return_inverse=True)
            keys[k][valid] = inverse + offset
            digits = []
            rest = distinct.copy()
            for _ in range(len(parts_of[k])):
                digits.append(rest % n_vocab)
                rest //= n_vocab
            digits = np.stack(digits[::-1], axis=1) if len(digits) else np.zeros((0, 0), np.int64)
            padded = np.full((len(distinct), 3), -1, np.int64)
            padded[:, :digits.shape[1]] = digits
            parts.append(padded)
            kinds.append(np.full(len(distinct), k, np.int64))
            lookup.append({tuple(row.tolist()): offset + i for i, row in enumerate(digits)})
            offset += len(distinct)
        parts, kinds = np.concatenate(parts), np.concatenate(kinds)
        vocab = contexts.vocab
        text = [vocab[p[0]] if k < 2 else str(tuple(vocab[i] for i in p if i >= 0))
                for p, k in zip(parts.tolist(), kinds.tolist())]
        order = np.empty(len(text), np.int64)
        order[sorted(range(len(text)), key=text.__getitem__)] = np.arange(len(text))
        return cls(keys=keys, parts=parts, kind=kinds, order=order, lookup=lookup, vocab=vocab,
                   vocab_index={v: i for i, v in enumerate(vocab)})

    def key_tokens(self, key: int):
        """The rule token of a dense key: a string, or a tuple of strings for n-grams."""
        k = int(self.kind[key])
        items = [self.vocab[i] for i in self.parts[key].tolist() if i >= 0]
        return items[0] if k < 2 else tuple(items)

    def rule_keys(self, rule: Rule) -> tuple[int, np.ndarray]:
        """(kind index, dense key ids) of a rule; keys that occur in no context are dropped (they never fire)."""
        k = KINDS.index(rule.kind)
        out = []
        for token in rule.tokens:
            items = (token,) if isinstance(token, str) else tuple(token)
            ids = tuple(self.vocab_index.get(t, -1) for t in items)
            if -1 not in ids and len(ids) == RULE_KINDS[rule.kind][0]:
                dense = self.lookup[k].get(ids)
                if dense is not None:
                    out.append(dense)
        return k, np.asarray(sorted(set(out)), np.int64)


def segment_rank(groups: np.ndarray) -> np.ndarray:
    """[n] 0, 1, 2, ... within each run of equal values of sorted ``groups``."""
    if not len(groups):
        return np.zeros(0, np.int64)
    starts = np.r_[True, groups[1:] != groups[:-1]]
    first = np.maximum.accumulate(np.where(starts, np.arange(len(groups)), 0))
    return np.arange(len(groups)) - first


def explain_layer(table, keys: KeyTables, *, max_tokens: int = 6, min_support: int = 2, writes: int = 8,
                  name: str = "tokens") -> list[Explanation]:
    """The ``tokens`` explanation of every side of ``table`` (equal to ``TokensExplainer.explain_side``)."""
    n_sides = len(table.side)
    seen = ~table.held
    owner, ctx, index = table.owner[seen], table.ctx[seen], table.index[seen]
    active = table.active[seen]
    n_active = np.bincount(owner[active], minlength=n_sides)
    n_inactive = np.bincount(owner[~active], minlength=n_sides)
    n_pos, n_neg = np.maximum(n_active, 1).astype(np.float64), np.maximum(n_inactive, 1).astype(np.float64)
    space = max(len(keys.kind), 1)
    best_score = np.full(n_sides, np.nan)
    best_kind = np.zeros(n_sides, np.int64)
    best_keys: list = [np.zeros(0, np.int64)] * n_sides
    for k in range(len(KINDS)):
        key = keys.keys[k][ctx, index]
        has = key >= 0
        pairs_pos, pos = np.unique(owner[has & active] * space + key[has & active], return_counts=True)
        pairs_neg, neg_counts = np.unique(owner[has & ~active] * space + key[has & ~active], return_counts=True)
        at = np.searchsorted(pairs_neg, pairs_pos)
        at_ok = np.minimum(at, max(len(pairs_neg) - 1, 0))
        found = (at < len(pairs_neg)) & (pairs_neg[at_ok] == pairs_pos) if len(pairs_neg) else np.zeros(len(at), bool)
        neg = np.where(found, neg_counts[at_ok] if len(pairs_neg) else 0, 0)
        side, dense = pairs_pos // space, pairs_pos % space
        gain = pos / n_pos[side] - neg / n_neg[side]
        good = gain > 0
        side, dense, gain, pos = side[good], dense[good], gain[good], pos[good]
        order = np.lexsort((keys.order[dense], -pos, -gain, side))
        side, dense, gain, pos = side[order], dense[order], gain[order], pos[order]
        supported = pos >= min_support
        # rank among the supported keys of the side; the side's first key when none is supported
        rank = np.full(len(side), -1, np.int64)
        rank[supported] = segment_rank(side[supported])
        chosen = supported & (rank < max_tokens)
        has_supported = np.bincount(side[supported], minlength=n_sides) > 0
        first = np.r_[True, side[1:] != side[:-1]] if len(side) else np.zeros(0, bool)
        chosen |= first & ~has_supported[side]
        c_side, c_gain, c_dense = side[chosen], gain[chosen], dense[chosen]
        c_rank = segment_rank(c_side)
        total = np.zeros(n_sides)
        for j in range(int(c_rank.max(initial=-1)) + 1):  # sequential sums, as Python's sum of the chosen gains
            pick = c_rank == j
            total[c_side[pick]] += c_gain[pick]
        score = 0.5 + total / 2
        cuts = np.searchsorted(c_side, np.arange(n_sides + 1))
        better = score > best_score + 1e-12 if k else np.ones(n_sides, bool)  # ties: the simpler kind
        for s in np.flatnonzero(better):
            best_keys[s] = c_dense[cuts[s]:cuts[s + 1]]
        best_score = np.where(better, score, best_score)
        best_kind = np.where(better, k, best_kind)
    out = []
    seen_start = np.searchsorted(owner, np.arange(n_sides + 1))
    seen_codes = table.code[seen]
    for s in range(n_sides):
        if n_active[s] == 0:
            rule, score = Rule(kind="current_token", tokens=()), float("nan")
        else:
            rule = Rule(kind=KINDS[best_kind[s]], tokens=tuple(keys.key_tokens(d) for d in best_keys[s].tolist()))
            score = float(best_score[s])
        written = table.writes[s][:writes]
        rule = Rule(kind=rule.kind, tokens=rule.tokens, writes=tuple(dict.fromkeys(normalize(t) for t in written)))
        text = rule.text[0].upper() + rule.text[1:]
        if written:
            text += "; it writes " + ", ".join(repr(t) for t in written)
        out.append(Explanation(layer=table.layer, neuron=int(table.neuron[s]), side=table.side[s], text=text,
                               rule=rule.to_json(), explainer=name,
                               explain_codes=tuple(seen_codes[seen_start[s]:seen_start[s + 1]].tolist()),
                               explain_score=score))
    return out
