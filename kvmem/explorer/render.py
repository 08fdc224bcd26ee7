"""The explorer's HTML: a Jinja2 environment over the package's templates, with autoescaping and the filters
the pages use (numbers, tokens shown faithfully, shaded contexts, URLs with changed parameters)."""

from __future__ import annotations

import math
from urllib.parse import urlencode

from jinja2 import Environment, PackageLoader, StrictUndefined, select_autoescape

from kvmem.report.safe_text import visible
from kvmem.schema import KEY_VECTOR_NAMES
from kvmem.shading import LEVELS, Cell, shown

__all__ = ["environment", "num", "cell_class"]


def num(value, spec: str = ".4g") -> str:
    """A number as a table shows it ('–' when missing or not finite)."""
    if value is None or isinstance(value, str):
        return "–" if value is None else value
    if isinstance(value, float) and not math.isfinite(value):
        return "–"
    return format(value, spec)


def pct(value, digits: int = 1) -> str:
    return num(value, f".{digits}%")


def chip(token) -> str:
    """A token on its own, on one line: every character visible (:func:`kvmem.report.safe_text.visible`: a newline is ``↵``);
    in a token of whitespace only, a space shows as ``␣`` and any other space character as ``⟨U+XXXX⟩``."""
    text = str(token)
    if text and text.strip() == "":  # only whitespace: every character named
        return "".join("␣" if char == " " else visible(char) if char in "\n\t\r" else f"⟨U+{ord(char):04X}⟩"
                       for char in text)
    return visible(text)


def cell_class(cell: Cell) -> str:
    """CSS classes of a shaded token: ``t`` plus ``p1``..``p8`` / ``n1``..``n8``, ``sat``, ``trig``."""
    names = ["t"]
    if cell.level:
        names.append(("p" if cell.level > 0 else "n") + str(min(abs(cell.level), LEVELS)))
    if cell.saturated:
        names.append("sat")
    if cell.trigger:
        names.append("trig")
    return " ".join(names)


def with_params(params, **changes) -> str:
    """A query string: ``params`` (pairs or a mapping, repeated keys kept) with ``changes`` (None removes)."""
    pairs = list(params.multi_items()) if hasattr(params, "multi_items") else list(
        params.items() if hasattr(params, "items") else params)
    pairs = [(k, v) for k, v in pairs if k not in changes]
    pairs += [(k, str(v)) for k, v in changes.items() if v is not None]
    return "?" + urlencode(pairs) if pairs else ""


def environment() -> Environment:
    env = Environment(loader=PackageLoader("kvmem.explorer", "templates"), autoescape=select_autoescape(["html"]),
                      undefined=StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    env.filters.update(num=num, pct=pct, tok=shown, chip=chip, inline=visible, cell_class=cell_class)
    env.globals.update(with_params=with_params, key_vector_names=KEY_VECTOR_NAMES)
    return env
