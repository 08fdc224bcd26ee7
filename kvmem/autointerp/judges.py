"""Judges answer the scorers' queries from an explanation: the ``tokens`` rule itself, or an LLM backend.

A judge takes jobs ``(explanation, scorer, query)`` (:class:`~kvmem.autointerp.scorers.base.Query`) and
returns one answer each: a bool for detection, fuzzing and output, [T] floats in 0..10 for simulation,
0, 1 or None (undecided) for intervention's choice between two continuations. An LLM judge sends
every job of a call to its backend at once (batched or concurrent).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvmem.autointerp.prompts import PROMPTS, parse_choice, parse_simulation, parse_yes_no, render_context
from kvmem.autointerp.token_rules import Rule
from kvmem.errors import KvmemError

__all__ = ["TokensJudge", "LLMJudge", "rule_of"]


def _label(e) -> str:
    return f"L{e.layer}/{e.neuron} {e.side}"


def rule_of(explanation) -> Rule:
    """The rule of an explanation (anything with ``rule``, ``layer``, ``neuron``, ``side``); one line if it has none."""
    if not explanation.rule:
        raise KvmemError(f"the explanation of {_label(explanation)} has no rule, and the tokens judge only "
                         f"applies rules; score free text with --judge hf:PATH or --judge openai:URL")
    return Rule.from_json(explanation.rule)


@dataclass(frozen=True, kw_only=True)
class TokensJudge:
    """Applies the explanation's rule: fires where the rule fires (simulation: 10 there, 0 elsewhere; a whole
    window: anywhere in it; highlighted tokens: on at least half of them); output: the rule's ``writes`` hold the
    token; intervention: the continuation with more of the rule's written tokens (None on a tie)."""

    name: str = "tokens"
    prompt_hash: str = ""

    def answer(self, jobs) -> list:
        rules: dict[str, Rule] = {}
        out = []
        for explanation, scorer, query in jobs:
            rule = rules.get(explanation.rule) or rules.setdefault(explanation.rule, rule_of(explanation))
            if scorer == "simulation":
                out.append([10.0 if f else 0.0 for f in rule.fires_all(query.tokens)])
            elif scorer == "output":
                out.append(rule.writes_token(query.tokens[0]))
            elif scorer == "intervention":
                counts = [sum(rule.writes_token(t) for t in option) for option in query.options]
                out.append(None if counts[0] == counts[1] else int(counts[1] > counts[0]))
            elif query.whole:
                out.append(any(rule.fires_all(query.tokens)))
            elif query.highlights:
                out.append(2 * sum(rule.fires(query.tokens, i) for i in query.highlights) >= len(query.highlights))
            else:
                out.append(rule.fires(query.tokens, query.index))
        return out


@dataclass(frozen=True, kw_only=True)
class LLMJudge:
    """Asks an LLM backend (``backend.chat(requests) -> answers``), with :data:`kvmem.autointerp.prompts.PROMPTS`."""

    backend: object
    name: str = ""
    max_tokens: int = 8

    @property
    def prompt_hash(self) -> str:
        return ",".join(f"{n}:{PROMPTS[n].version}:{PROMPTS[n].hash}" for n in ("detection", "fuzzing", "simulation",
                                                                              "output", "intervention"))

    def answer(self, jobs) -> list:
        requests = []
        for explanation, scorer, query in jobs:
            prompt = PROMPTS[scorer]
            if scorer == "simulation":
                tokens = "\n".join(f"{i + 1}. {t!r}" for i, t in enumerate(query.tokens))
                requests.append({"messages": prompt.messages(explanation=explanation.text, tokens=tokens),
                                 "max_tokens": 8 * len(query.tokens) + 16})
            elif scorer == "output":
                requests.append({"messages": prompt.messages(explanation=explanation.text, token=repr(query.tokens[0])),
                                 "max_tokens": self.max_tokens})
            elif scorer == "intervention":
                first, second = ("".join(option) for option in query.options)
                requests.append({"messages": prompt.messages(explanation=explanation.text,
                                                             context=render_context(query.tokens), first=repr(first),
                                                             second=repr(second)), "max_tokens": self.max_tokens})
            elif query.whole or query.highlights:
                prompt = PROMPTS[f"{scorer}-window"]
                requests.append({"messages": prompt.messages(explanation=explanation.text, context=render_context(
                    query.tokens, query.highlights or None)), "max_tokens": self.max_tokens})
            else:
                highlight = query.index if scorer == "fuzzing" else None
                requests.append({"messages": prompt.messages(explanation=explanation.text,
                                                             context=render_context(query.tokens, highlight)),
                                 "max_tokens": self.max_tokens})
        answers = self.backend.chat(requests)
        out = []
        for (_, scorer, query), text in zip(jobs, answers):
            if scorer == "simulation":
                out.append(parse_simulation(text, len(query.tokens))[0])
            else:
                out.append(parse_choice(text) if scorer == "intervention" else parse_yes_no(text))
        return out
