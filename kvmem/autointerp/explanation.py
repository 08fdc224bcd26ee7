"""An explanation of one neuron side, as an explainer writes it (before scoring)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Explanation"]


@dataclass(frozen=True, kw_only=True)
class Explanation:
    """layer, neuron, side: the memory;  text: the explanation in words;  rule: a
    :class:`~kvmem.autointerp.token_rules.Rule` as JSON, or "" when the explainer wrote none;
    explainer: its registry spec (``tokens``, ``hf:PATH``, ``openai:URL``);  explainer_model, explainer_fingerprint:
    the model that wrote it ("" for ``tokens``);  prompt_version, prompt_hash: the template used
    ("" for ``tokens``);  explain_codes: position codes of the examples it was shown;
    explain_score: the explainer's own fit on those examples (balanced accuracy; NaN if none)."""

    layer: int
    neuron: int
    side: str
    text: str
    rule: str
    explainer: str
    explainer_model: str = ""
    explainer_fingerprint: str = ""
    prompt_version: str = ""
    prompt_hash: str = ""
    explain_codes: tuple[int, ...] = ()
    explain_score: float = float("nan")
