"""The prompts of the LLM explainer and judges: versioned templates, hashed, recorded with every result.

Each template has a ``version`` and a ``system`` and ``user`` text with ``{placeholders}``; its
``hash`` is the first 16 hex digits of sha256 over the name, version and both texts, so a changed
word changes the hash stored beside every explanation and score. Contexts are shown as their
tokens joined; a highlighted token is wrapped in ``<<`` ``>>``.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

__all__ = ["Prompt", "PROMPTS", "render_context", "parse_yes_no", "parse_choice", "parse_simulation",
           "parse_explanation"]


@dataclass(frozen=True, kw_only=True)
class Prompt:
    name: str
    version: str
    system: str
    user: str

    @property
    def hash(self) -> str:
        text = "\0".join((self.name, self.version, self.system, self.user))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def messages(self, **fields) -> list[dict]:
        return [{"role": "system", "content": self.system}, {"role": "user", "content": self.user.format(**fields)}]


PROMPTS: dict[str, Prompt] = {p.name: p for p in (
    Prompt(name="explain", version="2", system=(
        "You study one unit inside a language model. You see text excerpts where the unit fires strongly; "
        "the token where it fires most is wrapped in << >>, and a number after a token in [brackets] says how "
        "strongly it fires there (0 to 10). You also see the tokens the unit makes more likely and less likely "
        "when it fires. Describe in one short sentence which tokens or contexts make it fire, and what it "
        "writes."),
        user=("Excerpts where the unit fires:\n{examples}\n\nWhen it fires it makes these tokens more likely: "
              "{writes}\nand these less likely: {opposes}\n\nAnswer with one line that starts with "
              "'Explanation:'.")),
    Prompt(name="detection", version="1", system=(
        "You check an explanation of a unit inside a language model. Given the explanation and a text, say "
        "whether the unit fires on the LAST token of the text. Answer only yes or no."),
        user="Explanation: {explanation}\n\nText: {context}\n\nDoes the unit fire on the last token? yes or no:"),
    Prompt(name="fuzzing", version="1", system=(
        "You check an explanation of a unit inside a language model. Given the explanation and a text with one "
        "token wrapped in << >>, say whether the unit fires on that highlighted token. Answer only yes or no."),
        user="Explanation: {explanation}\n\nText: {context}\n\nDoes the unit fire on the highlighted token? yes or no:"),
    Prompt(name="detection-window", version="1", system=(
        "You check an explanation of a unit inside a language model. Given the explanation and a text, say "
        "whether the unit fires anywhere in the text. Answer only yes or no."),
        user="Explanation: {explanation}\n\nText: {context}\n\nDoes the unit fire anywhere in this text? yes or no:"),
    Prompt(name="fuzzing-window", version="1", system=(
        "You check an explanation of a unit inside a language model. Given the explanation and a text in which "
        "some tokens are wrapped in << >>, say whether the unit fires on the highlighted tokens. Answer only yes "
        "or no."),
        user="Explanation: {explanation}\n\nText: {context}\n\nDoes the unit fire on the highlighted tokens? yes or "
             "no:"),
    Prompt(name="output", version="1", system=(
        "You check an explanation of a unit inside a language model. When the unit fires it makes some tokens "
        "more likely as the next token. Given the explanation and one token, say whether the unit makes that "
        "token more likely. Answer only yes or no."),
        user="Explanation: {explanation}\n\nToken: {token}\n\nDoes the unit make this token more likely? yes or no:"),
    Prompt(name="intervention", version="1", system=(
        "You check an explanation of a unit inside a language model. A text was continued twice: once as the "
        "model wrote it, once with the unit switched on. Given the explanation, say which continuation had the "
        "unit switched on. Answer only 1 or 2."),
        user="Explanation: {explanation}\n\nText: {context}\n\nContinuation 1: {first}\nContinuation 2: {second}\n\n"
             "Which continuation had the unit switched on? 1 or 2:"),
    Prompt(name="simulation", version="1", system=(
        "You predict a unit inside a language model from an explanation. For each numbered token, predict how "
        "strongly the unit fires on it, from 0 (not at all) to 10 (as strongly as it ever does). Answer with "
        "one line per token, 'number: activation', and nothing else."),
        user="Explanation: {explanation}\n\nTokens:\n{tokens}\n\nPredictions:"),
)}


def render_context(tokens, highlight=None, strengths=None) -> str:
    """The tokens joined into text; ``highlight`` (an index or a set of them) wrapped in << >>; ``strengths`` [T]
    0-10 shown as [n] where > 0."""
    marked = set() if highlight is None else ({highlight} if isinstance(highlight, int) else set(highlight))
    parts = []
    for i, token in enumerate(tokens):
        piece = f"<<{token}>>" if i in marked else token
        if strengths is not None and strengths[i] > 0:
            piece += f"[{int(strengths[i])}]"
        parts.append(piece)
    return repr("".join(parts))


_YES_NO = re.compile(r"\b(yes|no)\b", re.IGNORECASE)
_PAIR = re.compile(r"(\d+)\s*[:=.)\-]\s*(-?\d+(?:\.\d+)?)")


def parse_yes_no(answer: str) -> bool:
    """True for an answer whose first yes/no word is yes; anything else is no."""
    found = _YES_NO.search(answer or "")
    return bool(found) and found.group(1).lower() == "yes"


_CHOICE = re.compile(r"\b([12])\b")


def parse_choice(answer: str) -> int | None:
    """0 for an answer whose first 1-or-2 is 1, 1 for 2, None when it names neither."""
    found = _CHOICE.search(answer or "")
    return None if not found else int(found.group(1)) - 1


def parse_simulation(answer: str, n_tokens: int) -> tuple[list[float], int]:
    """([n_tokens] predictions in 0..10, how many tokens the answer gave) from 'i: value' lines (1-based);
    missing tokens predict 0."""
    out = [0.0] * n_tokens
    given = set()
    for index, value in _PAIR.findall(answer or ""):
        i = int(index) - 1
        if 0 <= i < n_tokens and i not in given:
            out[i] = min(max(float(value), 0.0), 10.0)
            given.add(i)
    return out, len(given)


def parse_explanation(answer: str) -> str:
    """The text after 'Explanation:' (else the first non-empty line), one line, stripped."""
    text = answer or ""
    found = re.search(r"explanation\s*:\s*(.+)", text, re.IGNORECASE)
    line = found.group(1) if found else next((ln for ln in text.splitlines() if ln.strip()), "")
    return line.strip().strip('"').strip()
