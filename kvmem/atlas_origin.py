"""What an atlas was scanned from: its model and its corpus, reopened from the manifest, and the model check.

Each function takes an :class:`~kvmem.atlas.Atlas` or its :class:`~kvmem.manifest.Manifest` (merging
shards has only manifests).

The fingerprint policy, one for the whole package (:func:`check_model`): a model whose weights
fingerprint differs from the manifest's is

- refused (``on_mismatch="raise"``, :class:`~kvmem.errors.KvmemError`) where it recomputes the atlas's
  own numbers: activation records, exports, merging shards;
- reported (``on_mismatch="warn"``, :class:`FingerprintWarning`) where an experiment measures a model
  against an atlas: another model is then a choice (``--model``), recorded as ``fingerprint_match``.

>>> model = load_scanned_model(atlas)  # name, dtype and hub revision from the manifest  # doctest: +SKIP
>>> corpus = scanned_corpus(atlas)     # the very stream the atlas's doc indices refer to  # doctest: +SKIP
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

from kvmem import loading
from kvmem.corpus import open_corpus
from kvmem.errors import KvmemError

if TYPE_CHECKING:
    from kvmem.corpus import Corpus
    from kvmem.manifest import Manifest
    from kvmem.models import Model

__all__ = ["FingerprintWarning", "ON_MISMATCH", "check_model", "load_scanned_model", "scanned_corpus"]

# on_mismatch -> what a fingerprint mismatch does
ON_MISMATCH = {
    "raise": "refuse the model (KvmemError): it would recompute the atlas's numbers with other weights",
    "warn": "warn (FingerprintWarning) and go on: the numbers then mix two models' weights",
}


class FingerprintWarning(UserWarning):
    """The model's weights differ from the weights the atlas was scanned with."""


def _manifest(source) -> Manifest:
    return getattr(source, "manifest", source)


def _named(source) -> str:
    path = getattr(source, "path", None)
    return f"atlas {path}" if path is not None else "the atlas"


def check_model(source, model: Model, *, on_mismatch: str = "raise", stacklevel: int = 1) -> bool:
    """True when ``model`` has the weights ``source`` (an atlas or its manifest) was scanned with.

    Otherwise raise or warn, as ``on_mismatch`` says (:data:`ON_MISMATCH`), and return False.
    ``stacklevel``: the frame the warning names, counted from this function (1: its caller).
    """
    if on_mismatch not in ON_MISMATCH:
        raise KvmemError(f"on_mismatch must be one of {', '.join(ON_MISMATCH)}, got {on_mismatch!r}")
    scanned = _manifest(source).model
    expected = scanned["fingerprint"]
    if model.fingerprint == expected:
        return True
    message = (f"model {model.name!r} (fingerprint {model.fingerprint}) is not the scanned model "
               f"{scanned['name']!r} ({expected}) of {_named(source)}")
    if on_mismatch == "raise":
        raise KvmemError(f"{message}; pass the model the atlas was scanned with")
    warnings.warn(f"{message}: the numbers mix two models' weights", FingerprintWarning, stacklevel=stacklevel + 1)
    return False


def load_scanned_model(source, *, device: Any = None, on_mismatch: str = "raise") -> Model:
    """The scanned model, loaded as the manifest names it: name (a built-in name, local directory or hub id),
    dtype and hub revision; its fingerprint is checked (:func:`check_model` with ``on_mismatch``)."""

    scanned = _manifest(source).model
    model = loading.load_model(scanned["name"], device=device, dtype=scanned.get("dtype"), revision=scanned.get("revision"))
    check_model(source, model, on_mismatch=on_mismatch, stacklevel=2)
    return model


def scanned_corpus(source, corpus: Any = None) -> Corpus:
    """The scanned corpus as a :class:`~kvmem.corpus.Corpus`: reopened from the manifest's spec, or ``corpus``
    (for a corpus the spec cannot reopen: an in-memory list or dataset), opened with the manifest's unit and
    text field. The atlas's doc indices refer to this stream, so it must be the very corpus that was scanned."""

    scanned = _manifest(source).corpus
    unit, text_field = scanned.get("unit", "document"), scanned.get("text_field", "text")
    if corpus is not None:
        return open_corpus(corpus, unit=unit, text_field=text_field)
    spec = str(scanned["spec"])
    if spec.startswith(("list[", "dataset[")):
        raise KvmemError(f"{_named(source)} was scanned from an in-memory corpus ({spec}) that cannot be reopened; "
                         f"pass the same corpus again (corpus=..., --corpus FILE for a saved copy)")
    return open_corpus(spec, unit=unit, text_field=text_field)
