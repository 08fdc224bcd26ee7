"""Judges answer the scorers' queries from an explanation: the ``tokens`` rule itself, or an LLM backend.

A judge takes jobs ``(explanation, scorer, query)`` (:class:`~kvmem.autointerp.scorers.base.Query`) and
returns one answer each: a bool for detection and fuzzing, [T] floats in 0..10 for simulation. An
LLM judge sends every job of a call to its backend at once (batched or concurrent).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvmem.autointerp.prompts import PROMPTS, parse_simulation, parse_yes_no, render_context
from kvmem.autointerp.rules import Rule
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
    """Applies the explanation's rule: fires where the rule fires (simulation: 10 there, 0 elsewhere)."""

    name: str = "tokens"
    prompt_hash: str = ""

    def answer(self, jobs) -> list:
        rules: dict[str, Rule] = {}
        out = []
        for explanation, scorer, query in jobs:
            rule = rules.get(explanation.rule) or rules.setdefault(explanation.rule, rule_of(explanation))
            if scorer == "simulation":
                out.append([10.0 if f else 0.0 for f in rule.fires_all(query.tokens)])
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
        return ",".join(f"{n}:{PROMPTS[n].version}:{PROMPTS[n].hash}" for n in ("detection", "fuzzing", "simulation"))

    def answer(self, jobs) -> list:
        requests = []
        for explanation, scorer, query in jobs:
            prompt = PROMPTS[scorer]
            if scorer == "simulation":
                tokens = "\n".join(f"{i + 1}. {t!r}" for i, t in enumerate(query.tokens))
                requests.append({"messages": prompt.messages(explanation=explanation.text, tokens=tokens),
                                 "max_tokens": 8 * len(query.tokens) + 16})
            else:
                highlight = query.index if scorer == "fuzzing" else None
                requests.append({"messages": prompt.messages(explanation=explanation.text,
                                                             context=render_context(query.tokens, highlight)),
                                 "max_tokens": self.max_tokens})
        answers = self.backend.chat(requests)
        out = []
        for (_, scorer, query), text in zip(jobs, answers):
            out.append(parse_simulation(text, len(query.tokens))[0] if scorer == "simulation" else parse_yes_no(text))
        return out
