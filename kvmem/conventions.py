"""The one registry of projection conventions: how a value vector is read through the unembedding.

A convention turns vectors [n, d_model] (values v_i, or any residual direction) into the vectors that
are multiplied by W_U [d_model, vocab] to give vocabulary scores [n, vocab]. Tools disagree here
silently (LM-Debugger projects raw ``W_U^T v``; ffn-values projects ``lm_head(ln_f(v))``), so kvmem
names each convention and records its name and formula beside every number it produces.

What is projected is what a neuron writes into the residual stream: ``Model.written_values``
(v_i times the gain of a norm between the FFN and the residual, Gemma-2/3 and OLMo-2, times
Granite's residual multiplier; that norm's positive per-token 1/rms is left out, so rankings do not
depend on it). W_U is ``Model.unembedding()``, which already holds every linear map between the
residual and the logits (OPT's ``project_out``, Granite's ``logits_scaling``), under every convention.

Adding a convention is one entry in :data:`CONVENTIONS`: a name, a formula (text recorded in
manifests and reports) and the function that applies it.

:data:`DEFAULT_CONVENTION` is ``final_norm``: the model never multiplies W_U with an un-normed
residual, so the final norm's linear part is how the model itself reads a direction (its token
ranking equals ``lm_head(ln_f(v))``'s up to the bias's constant offset; with non-trivial gains, as
in Llama's RMSNorm, ``raw`` ranks tokens differently). Plots, reports, traces and atlas queries
use it when no convention is named. ``raw`` stays available by name: it is Geva et al. 2021's
reading (their adaptive softmax has no final norm) and LM-Debugger's.

Nothing here imports torch: the functions call methods of the tensors and :class:`~kvmem.models.Model`
they are given.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvmem.errors import KvmemError

if TYPE_CHECKING:
    from torch import Tensor

    from kvmem.models import Model

__all__ = ["CONVENTIONS", "DEFAULT_CONVENTION", "Convention", "convention_vectors", "get_convention", "value_vectors"]


@dataclass(frozen=True, kw_only=True)
class Convention:
    """One projection convention.

    ``name``: the key in :data:`CONVENTIONS` and in atlas tables. ``formula``: human-readable text
    recorded in manifests and reports. ``apply(model, vectors)``: vectors [n, d_model] -> the
    vectors [n, d_model] (float32) that are multiplied by ``model.unembedding()`` [d_model, vocab].
    """

    name: str
    formula: str
    apply: Callable[[Model, Tensor], Tensor]

    def __repr__(self) -> str:
        return f"Convention({self.name!r}: {self.formula})"


def _raw(model: Model, vectors: Tensor) -> Tensor:
    """The vectors themselves, as float32 [n, d_model]."""
    return vectors.float()


def _final_norm(model: Model, vectors: Tensor) -> Tensor:
    """The final norm's linear part (centring for LayerNorm, then gain) [n, d_model] float32."""
    return model.final_norm().linear_part(vectors.float()).float()


CONVENTIONS: dict[str, Convention] = {
    "raw": Convention(
        name="raw",
        formula="score = W_U^T w, w = the written value (v, times the post-FFN norm's gain where one sits "
                "between the FFN and the residual, with its positive per-token 1/rms left out, times any residual "
                "multiplier); W_U includes every linear map between the residual and the logits (LM-Debugger's "
                "reading: no final norm)",
        apply=_raw,
    ),
    "final_norm": Convention(
        name="final_norm",
        formula="score = W_U^T (gain * centre(w)) for LayerNorm, W_U^T (gain * w) for RMSNorm, w = the written "
                "value (v, times the post-FFN norm's gain where one sits between the FFN and the residual, with its "
                "positive per-token 1/rms left out, times any residual multiplier): the final norm's linear part "
                "(as ffn-values and OpenAI's neuron viewer); the positive scale 1/sigma and the bias are dropped, "
                "so rankings equal lm_head(ln_f(w)) up to the bias's constant offset; W_U includes every linear "
                "map between the residual and the logits",
        apply=_final_norm,
    ),
}

DEFAULT_CONVENTION = "final_norm"


def get_convention(name: str) -> Convention:
    """The registered convention called ``name``; a one-line :class:`KvmemError` naming the allowed ones."""
    try:
        return CONVENTIONS[name]
    except (KeyError, TypeError):
        raise KvmemError(f"unknown projection convention {name!r}; choose one of {', '.join(CONVENTIONS)}") from None


def convention_vectors(model: Model, vectors: Tensor, name: str) -> Tensor:
    """vectors [n, d_model] as convention ``name`` feeds them to W_U [d_model, vocab] -> [n, d_model] float32."""
    return get_convention(name).apply(model, vectors)


def value_vectors(model: Model, layer: int, name: str, rows: slice = slice(None)) -> Tensor:
    """The written values w_i of ``layer`` (``Model.written_values``) as convention ``name`` reads them
    [d_ff, d_model] float32 (``rows``: only those neurons)."""
    convention = get_convention(name)  # checked before the weights are read
    return convention.apply(model, model.written_values(layer, rows))
