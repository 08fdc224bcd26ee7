"""Untrusted text (corpus contexts, token strings, model names) made safe for each output format.

Every string that reaches a report passes through here. Three steps, in this order:

``clean``    lone surrogates (which cannot be UTF-8 encoded) become U+FFFD;
``visible``  invisible or reordering characters (bidi overrides, zero-width, other controls) become
             visible markers such as ``⟨U+202E⟩``; newline and tab become ``↵`` and ``⇥``;
``html_text`` / ``md_text`` / ``md_code``  escape for the target format, so nothing renders as markup.
"""

from __future__ import annotations

import html
import re
import unicodedata

__all__ = ["clean", "html_text", "md_code", "md_text", "mpl_text", "visible", "write_text"]

_SURROGATES = re.compile("[\ud800-\udfff]")
_SHOWN = {"\n": "↵", "\t": "⇥", "\r": "␍"}
_MD_PUNCTUATION = re.compile(r"([!-/:-@\[-`{-~])")  # every ASCII punctuation character


def clean(text) -> str:
    """``text`` as a str that can always be UTF-8 encoded (lone surrogates -> U+FFFD)."""
    return _SURROGATES.sub("\ufffd", text if isinstance(text, str) else str(text))


def _marker(char: str) -> str:
    if char in _SHOWN:
        return _SHOWN[char]
    if unicodedata.category(char) in ("Cc", "Cf", "Zl", "Zp", "Cs"):
        return f"⟨U+{ord(char):04X}⟩"
    return char


def visible(text) -> str:
    """Cleaned text whose every character shows: controls, bidi and zero-width marks become markers."""
    return "".join(_marker(char) for char in clean(text))


def html_text(text) -> str:
    """Visible text escaped for HTML element content and quoted attribute values."""
    return html.escape(visible(text), quote=True)


def md_text(text, *, lead: bool = True) -> str:
    """Visible text for Markdown prose or a table cell: ASCII punctuation backslash-escaped.

    CommonMark treats a backslash-escaped punctuation character as a literal, so ``<script>``,
    ``*``, ``|``, ``[..](..)`` and ``&amp;`` all show as typed. ``lead``: leading spaces become ``␣``
    (a table cell or paragraph would drop them).
    """
    text = _MD_PUNCTUATION.sub(r"\\\1", visible(text))
    if not lead:
        return text
    stripped = text.lstrip(" ")
    return "␣" * (len(text) - len(stripped)) + stripped


def md_code(text, *, table: bool = True) -> str:
    """Visible text as a Markdown code span; ``table``: escape ``|`` as GitHub tables require.

    An all-space token shows as ``␣`` (a code span of spaces would look empty).
    """
    body = visible(text)
    if body.strip(" ") == "":
        body = "␣" * len(body)
    if table:
        body = body.replace("|", "\\|")
    if not body:
        return "(empty)"
    fence = "`" * (max((len(run) for run in re.findall("`+", body)), default=0) + 1)
    padded = f" {body} " if body.startswith("`") or body.endswith("`") else body
    return f"{fence}{padded}{fence}"


def mpl_text(text, *, limit: int | None = None) -> str:
    """Visible text for a matplotlib label, cut at ``limit`` characters, ``$`` escaped (no mathtext)."""
    text = visible(text)
    if limit is not None and len(text) > limit:
        text = text[:limit - 1] + "…"
    return text.replace("$", r"\$")


def write_text(path, text: str) -> None:
    """Write ``text`` to ``path`` as UTF-8; lone surrogates were cleaned, so this never fails on content."""
    path.write_bytes(text.encode("utf-8", errors="replace"))
