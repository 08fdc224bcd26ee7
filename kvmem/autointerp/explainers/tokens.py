"""The ``tokens`` explainer: the best token rule in a small hypothesis space, no model, deterministic.

For each rule kind (:data:`kvmem.autointerp.token_rules.RULE_KINDS`) it reads the key of every explain-set
example at its kept token, counts how often each key occurs among activating (``pos_k``) and
non-activating (``neg_k``) examples, and keeps the keys whose gain
``pos_k / |A| - neg_k / |N|`` is positive, seen at least ``min_support`` times (or the single best
key), strongest first, at most ``max_tokens`` of them. Each example has one key, so the balanced
accuracy of the set on the explain examples is ``0.5 + Σ gain / 2``; the kind with the highest wins
(ties: the simpler kind, in the order of ``RULE_KINDS``). The text appends what the memory writes
(its strongest written tokens of the explain set), and the rule records them (``writes``), so a
reader and the output scorer see both halves of the key-value pair.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from kvmem.autointerp.explanation import Explanation
from kvmem.autointerp.token_rules import RULE_KINDS, Rule, key_at, normalize
from kvmem.autointerp.vectorised import explain_layer
from kvmem.errors import KvmemError

__all__ = ["TokensExplainer", "fit_rule"]


def fit_rule(active: list[tuple[tuple[str, ...], int]], inactive: list[tuple[tuple[str, ...], int]], *,
             max_tokens: int = 6, min_support: int = 2, kinds=tuple(RULE_KINDS)) -> tuple[Rule, float]:
    """The best rule for ``active`` vs ``inactive`` examples ((tokens, index) pairs) and its balanced accuracy."""
    best: tuple[float, int, Rule] | None = None
    for order, kind in enumerate(kinds):
        pos = Counter(k for k in (key_at(kind, t, i) for t, i in active) if k is not None)
        neg = Counter(k for k in (key_at(kind, t, i) for t, i in inactive) if k is not None)
        n_pos, n_neg = max(len(active), 1), max(len(inactive), 1)
        gains = sorted(((pos[k] / n_pos - neg[k] / n_neg, pos[k], k) for k in pos),
                       key=lambda g: (-g[0], -g[1], str(g[2])))
        gains = [g for g in gains if g[0] > 0]
        chosen = [g for g in gains if g[1] >= min_support][:max_tokens] or gains[:1]
        score = 0.5 + sum(g[0] for g in chosen) / 2
        rule = Rule(kind=kind, tokens=tuple(g[2] for g in chosen))
        if best is None or score > best[0] + 1e-12:
            best = (score, order, rule)
    assert best is not None
    return best[2], best[0]


@dataclass(frozen=True, kw_only=True)
class TokensExplainer:
    """max_tokens: keys in a rule;  min_support: activating examples a key needs (but one key is always kept);
    writes: promoted tokens named in the text."""

    max_tokens: int = 6
    min_support: int = 2
    writes: int = 8
    name: str = "tokens"
    model: str = ""
    fingerprint: str = ""
    prompt_version: str = ""
    prompt_hash: str = ""

    def __post_init__(self) -> None:
        for field in ("max_tokens", "min_support"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise KvmemError(f"tokens explainer: {field} must be an integer >= 1, got {value!r}")

    def explain(self, evidence: list) -> list[Explanation]:
        return [self.explain_side(side) for side in evidence]

    def explain_layer(self, table, keys) -> list[Explanation]:
        """Every side of a :class:`~kvmem.autointerp.layertable.LayerExamples` at once (equal to ``explain_side``
        of each; :func:`kvmem.autointerp.vectorised.explain_layer`)."""
        return explain_layer(table, keys, max_tokens=self.max_tokens, min_support=self.min_support,
                             writes=self.writes, name=self.name)

    def explain_side(self, side) -> Explanation:
        seen = side.part(held_out=False)
        active = [(e.tokens, e.index) for e in seen if e.active]
        inactive = [(e.tokens, e.index) for e in seen if not e.active]
        if not active:
            rule, score = Rule(kind="current_token", tokens=()), float("nan")
        else:
            rule, score = fit_rule(active, inactive, max_tokens=self.max_tokens, min_support=self.min_support)
        written = side.writes[:self.writes]
        rule = Rule(kind=rule.kind, tokens=rule.tokens, writes=tuple(dict.fromkeys(normalize(t) for t in written)))
        text = rule.text[0].upper() + rule.text[1:]
        if written:
            text += "; it writes " + ", ".join(repr(t) for t in written)
        return Explanation(layer=side.layer, neuron=side.neuron, side=side.side, text=text, rule=rule.to_json(),
                           explainer=self.name, explain_codes=tuple(e.code for e in seen), explain_score=score)
