"""The LLM explainer shared by ``hf:`` and ``openai:``: a prompt from the explain-set evidence, one request per side.

The prompt (:data:`kvmem.autointerp.prompts.PROMPTS` ``explain``) shows up to ``max_examples`` activating
explain-set examples, strongest first: triggers with their per-token side activations scaled to
0..10 by the side's strongest shown activation, bin samples with their kept token highlighted; and the
tokens the side's memory writes and pushes down (the value's promoted and suppressed tokens, swapped
for the negative side). The answer's 'Explanation:' line is the text.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvmem.autointerp.explanation import Explanation
from kvmem.autointerp.prompts import PROMPTS, parse_explanation, render_context

__all__ = ["LLMExplainer", "explain_messages"]


def explain_messages(side, *, max_examples: int = 12, writes: int = 10) -> tuple[list[dict], tuple[int, ...]]:
    """(chat messages, codes of the examples shown) for one side."""
    shown = sorted((e for e in side.part(held_out=False) if e.active), key=lambda e: -e.activation)[:max_examples]
    scale = max((e.activation for e in shown), default=1.0) or 1.0
    lines = []
    for e in shown:
        strengths = None if e.activations is None else \
            [max(0, min(10, round(10 * a / scale))) for a in e.activations]
        lines.append("- " + render_context(e.tokens, e.index, strengths))
    written = ", ".join(repr(t) for t in side.writes[:writes]) or "(unknown)"
    opposed = ", ".join(repr(t) for t in side.opposes[:writes]) or "(unknown)"
    return PROMPTS["explain"].messages(examples="\n".join(lines) or "(none)", writes=written, opposes=opposed), \
        tuple(e.code for e in shown)


@dataclass(frozen=True, kw_only=True)
class LLMExplainer:
    """backend: has ``chat(requests) -> answers``, ``model`` and ``fingerprint``;  name: the explainer spec."""

    backend: object
    name: str
    max_examples: int = 12
    max_tokens: int = 64

    @property
    def model(self) -> str:
        return self.backend.model

    @property
    def fingerprint(self) -> str:
        return self.backend.fingerprint

    def explain(self, evidence: list) -> list[Explanation]:
        prompts = [explain_messages(side, max_examples=self.max_examples) for side in evidence]
        answers = self.backend.chat([{"messages": m, "max_tokens": self.max_tokens} for m, _ in prompts])
        prompt = PROMPTS["explain"]
        return [Explanation(layer=side.layer, neuron=side.neuron, side=side.side,
                            text=parse_explanation(answer) or "(the model gave no explanation)", rule="", explainer=self.name, explainer_model=self.model,
                            explainer_fingerprint=self.fingerprint, prompt_version=prompt.version,
                            prompt_hash=prompt.hash, explain_codes=codes)
                for side, (_, codes), answer in zip(evidence, prompts, answers)]
