"""Token rules: explanations a program can apply, as written by the ``tokens`` explainer.

A rule says at which positions a neuron side fires, from the tokens alone:

- ``current_token``:  the token at the position is in ``tokens``;
- ``previous_token``: the token before it is in ``tokens`` (never at the first token of a context);
- ``bigram``:         (previous, current) is one of ``tokens`` (pairs);
- ``trigram``:        (two before, previous, current) is one of ``tokens`` (triples).

Tokens are compared after :func:`normalize` (surrounding whitespace removed, lower case; a token
that is only whitespace stays as it is), which the rule records as ``"normalize": "strip-lower"``.
JSON form: ``{"kind": "current_token", "tokens": [" the", " a"], "normalize": "strip-lower"}``
(n-gram entries are lists).

A rule may also say what the memory writes (the output side): ``"writes": ["count", "counts"]``, the
normalised tokens its value promotes; :meth:`Rule.writes_token` applies it to a vocabulary token.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache

from kvmem.errors import KvmemError

__all__ = ["Rule", "RULE_KINDS", "normalize", "key_at"]

# kind -> (tokens read, ending at the position; readable phrase)
RULE_KINDS: dict[str, tuple[int, str]] = {
    "current_token": (1, "the current token is"),
    "previous_token": (1, "the previous token is"),
    "bigram": (2, "the last two tokens are"),
    "trigram": (3, "the last three tokens are"),
}
NORMALIZE = "strip-lower"


@lru_cache(maxsize=1 << 16)
def normalize(token: str) -> str:
    """The form rules compare: stripped and lower-cased; a whitespace-only token unchanged."""
    stripped = token.strip()
    return stripped.lower() if stripped else token


def key_at(kind: str, tokens, index: int):
    """The normalised key a rule of ``kind`` reads at ``tokens[index]``; None where it has no key."""
    if kind == "current_token":
        return normalize(tokens[index])
    if kind == "previous_token":
        return normalize(tokens[index - 1]) if index >= 1 else None
    width = RULE_KINDS[kind][0]
    if index + 1 < width:
        return None
    return tuple(normalize(t) for t in tokens[index + 1 - width:index + 1])


@dataclass(frozen=True, kw_only=True)
class Rule:
    """kind: one of :data:`RULE_KINDS`; tokens: normalised keys (str, or tuples for n-grams);  writes: normalised
    tokens the memory writes (its output side; empty when the rule says nothing about it)."""

    kind: str
    tokens: tuple
    writes: tuple = ()

    def __post_init__(self) -> None:
        if self.kind not in RULE_KINDS:
            raise KvmemError(f"unknown rule kind {self.kind!r}; choose one of {', '.join(RULE_KINDS)}")
        object.__setattr__(self, "_keys", frozenset(self.tokens))
        object.__setattr__(self, "_writes", frozenset(self.writes))

    def fires(self, tokens, index: int) -> bool:
        """Whether the rule fires at ``tokens[index]``."""
        key = key_at(self.kind, tokens, index)
        return key is not None and key in self._keys  # type: ignore[attr-defined]

    def writes_token(self, token: str) -> bool:
        """Whether the rule says the memory writes this vocabulary token (compared after :func:`normalize`)."""
        return normalize(token) in self._writes  # type: ignore[attr-defined]

    def fires_all(self, tokens) -> list[bool]:
        """[T] whether the rule fires at each token of a context."""
        return [self.fires(tokens, i) for i in range(len(tokens))]

    @property
    def text(self) -> str:
        """The rule in words, e.g. ``the current token is "the" or "a" (ignoring case and spaces)``."""
        phrase = RULE_KINDS[self.kind][1]
        if not self.tokens:
            return "never fires (no token pattern found)"
        items = [json.dumps(t, ensure_ascii=False) if isinstance(t, str)
                 else " ".join(json.dumps(p, ensure_ascii=False) for p in t) for t in self.tokens]
        listed = items[0] if len(items) == 1 else ", ".join(items[:-1]) + " or " + items[-1]
        return f"{phrase} {listed} (ignoring case and surrounding spaces)"

    def to_json(self) -> str:
        tokens = [t if isinstance(t, str) else list(t) for t in self.tokens]
        data = {"kind": self.kind, "tokens": tokens, "normalize": NORMALIZE}
        if self.writes:
            data["writes"] = list(self.writes)
        return json.dumps(data, ensure_ascii=False)

    @classmethod
    def from_json(cls, text: str) -> Rule:
        try:
            data = json.loads(text)
            kind, tokens = data["kind"], data["tokens"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise KvmemError(f"a rule must be JSON {{\"kind\": ..., \"tokens\": [...]}}, got {text[:80]!r}") from None
        if data.get("normalize", NORMALIZE) != NORMALIZE:
            raise KvmemError(f"rule normalisation {data['normalize']!r} is unknown; kvmem applies {NORMALIZE!r}")
        keys = tuple(normalize(t) if isinstance(t, str) else tuple(normalize(p) for p in t) for t in tokens)
        writes = data.get("writes") or []
        if not isinstance(writes, list) or not all(isinstance(t, str) for t in writes):
            raise KvmemError(f"a rule's writes must be a list of tokens, got {writes!r}")
        return cls(kind=kind, tokens=keys, writes=tuple(dict.fromkeys(normalize(t) for t in writes)))
