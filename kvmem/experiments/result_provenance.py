"""The provenance of an experiment's result: everything that identifies it, for ``frame.attrs``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvmem import __version__
from kvmem.conventions import CONVENTIONS

if TYPE_CHECKING:
    from kvmem.atlas import Atlas
    from kvmem.models import Model

__all__ = ["provenance"]


def provenance(experiment: str, *, model: Model | None = None, atlas: Atlas | None = None, corpus: Any = None,
               convention: str | None = None, settings: dict | None = None) -> dict:
    """Everything that identifies a result, for ``frame.attrs`` (JSON-serialisable)."""

    out: dict[str, Any] = {"experiment": experiment}
    if model is not None:
        out.update(model=model.name, fingerprint=model.fingerprint, dtype=str(model.dtype).removeprefix("torch."),
                   gated=model.gated, vocab_size=model.vocab_size)
    if atlas is not None:
        m = atlas.manifest
        out.setdefault("model", m.model["name"])
        out.setdefault("fingerprint", m.model["fingerprint"])
        out.setdefault("gated", m.model.get("gated"))
        out.setdefault("vocab_size", m.model.get("vocab_size"))
        out.update(atlas=str(atlas.path), atlas_fingerprint=m.model["fingerprint"], corpus=m.corpus["spec"],
                   corpus_unit=m.corpus.get("unit"), atlas_tokens=m.tokens, tokenization={
                       k: v for k, v in m.tokenization.items() if k != "rule"}, atlas_top_k=m.scan["top_k"])
        if model is not None:
            out["fingerprint_match"] = model.fingerprint == m.model["fingerprint"]
    elif corpus is not None:
        out["corpus"] = corpus.spec if hasattr(corpus, "spec") else str(corpus)
        out["corpus_unit"] = getattr(corpus, "unit", None)
    if convention is not None:
        out.update(convention=convention, convention_formula=CONVENTIONS[convention].formula)
    out["settings"] = dict(settings or {})
    out["kvmem_version"] = __version__
    return out
