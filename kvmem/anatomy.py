"""FFN anatomy: parameter counts, share of the block, FLOPs and activation memory.

Pure arithmetic on sizes (the seeds' sums, made a tool), plus :func:`model_anatomy` which
counts a loaded model's real parameters layer by layer beside the formula.

Plain FFN:  W1 [d_ff, d], b1 [d_ff], W2 [d, d_ff], b2 [d]      -> 2·d·d_ff + d_ff + d
Gated FFN:  W_gate, W_up [d_ff, d], W_down [d, d_ff] (+ biases) -> 3·d·d_ff (+ 2·d_ff + d)
With d_ff = 4d the plain count is 8d² + 5d (GPT-2 small, d=768: 4,722,432).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from kvmem.errors import KvmemError

if TYPE_CHECKING:
    import pandas as pd

__all__ = [
    "ffn_params",
    "attention_params",
    "ffn_share",
    "ffn_flops_per_token",
    "HiddenMemory",
    "hidden_activation_memory",
    "model_anatomy",
    "CountedModel",
]


def _positive(**sizes: int | None) -> None:
    for name, value in sizes.items():
        if value is not None and (not isinstance(value, int) or value < 1):
            raise KvmemError(f"{name} must be a positive integer, got {value!r}")


def ffn_params(d_model: int, d_ff: int | None = None, *, gated: bool = False, bias: bool = True) -> int:
    """Parameters of one FFN. ``d_ff`` defaults to 4·d_model.

    >>> ffn_params(768), ffn_params(512)
    (4722432, 2099712)
    >>> ffn_params(576, 1536, gated=True, bias=False)
    2654208
    """
    d_ff = 4 * d_model if d_ff is None else d_ff
    _positive(d_model=d_model, d_ff=d_ff)
    matrices = (3 if gated else 2) * d_model * d_ff
    biases = ((2 if gated else 1) * d_ff + d_model) if bias else 0
    return matrices + biases


def attention_params(d_model: int, *, d_kv: int | None = None, qkv_bias: bool = True, out_bias: bool = True) -> int:
    """Parameters of one attention sublayer: W_Q, W_O [d, d], W_K, W_V [d_kv, d] and biases.

    ``d_kv`` (= n_kv_heads · d_head) defaults to d_model (no grouped-query attention).
    GPT-2 has all biases: 4d² + 4d. The seeds count 4d² + d (``qkv_bias=False``):

    >>> attention_params(768, qkv_bias=False)
    2360064
    """
    d_kv = d_model if d_kv is None else d_kv
    _positive(d_model=d_model, d_kv=d_kv)
    weights = 2 * d_model * d_model + 2 * d_model * d_kv
    return weights + ((d_model + 2 * d_kv) if qkv_bias else 0) + (d_model if out_bias else 0)


def ffn_share(ffn: int, attention: int) -> float:
    """The FFN's fraction of a block's FFN + attention parameters (norms excluded).

    >>> round(ffn_share(ffn_params(768), attention_params(768, qkv_bias=False)), 3)
    0.667
    """
    if ffn < 0 or attention < 0 or ffn + attention == 0:
        raise KvmemError(f"parameter counts must be non-negative and not both zero, got {ffn}, {attention}")
    return ffn / (ffn + attention)


def ffn_flops_per_token(d_model: int, d_ff: int | None = None, *, gated: bool = False) -> int:
    """Multiply-add FLOPs (2 per weight) of one FFN for one token; biases and activation ignored.

    >>> ffn_flops_per_token(768) == 16 * 768**2
    True
    """
    d_ff = 4 * d_model if d_ff is None else d_ff
    _positive(d_model=d_model, d_ff=d_ff)
    return 2 * (3 if gated else 2) * d_model * d_ff


@dataclass(frozen=True)
class HiddenMemory:
    """Size of the hidden (coefficient) tensor [batch, seq, d_ff] of one FFN layer."""

    entries: int
    bytes: int
    gated_intermediates: int  # extra [batch, seq, d_ff] tensors alive in a gated FFN (gate and up)

    @property
    def megabytes(self) -> float:
        return self.bytes / 1e6

    def __repr__(self) -> str:
        return f"HiddenMemory(entries={self.entries:,}, bytes={self.bytes:,} ({self.megabytes:.1f} MB))"


def hidden_activation_memory(batch: int, seq: int, d_ff: int, *, bytes_per_value: int = 4,
                             gated: bool = False) -> HiddenMemory:
    """Entries and bytes of the FFN hidden tensor for one layer.

    >>> hidden_activation_memory(8, 1024, 4 * 768)
    HiddenMemory(entries=25,165,824, bytes=100,663,296 (100.7 MB))
    """
    _positive(batch=batch, seq=seq, d_ff=d_ff, bytes_per_value=bytes_per_value)
    entries = batch * seq * d_ff
    return HiddenMemory(entries, entries * bytes_per_value, 2 if gated else 0)


class CountedModel(Protocol):
    """What :func:`model_anatomy` reads from a loaded model; a :class:`kvmem.models.Model` has it all
    (this module stays below ``kvmem.models``, which imports it)."""

    n_layers: int
    d_model: int
    d_ff: int
    gated: bool
    has_bias: bool
    parameter_counts: dict[int, tuple[int, int]]  # layer -> (FFN, attention) parameters counted in the HF modules

    def describe(self) -> dict: ...


def model_anatomy(model: CountedModel) -> pd.DataFrame:
    """Per-layer counts of a loaded model's real parameters beside the formula.

    Counts are taken from the HF modules as loaded (``Model.parameter_counts``), before the
    TransformerLens bridge wraps them.

    Columns: layer, ffn_params (counted), ffn_formula, attention_params (counted), ffn_share,
    ffn_flops_per_token. ``ffn_params == ffn_formula`` holds for every supported architecture.
    """
    import pandas as pd

    rows = []
    for layer in range(model.n_layers):
        ffn, attention = model.parameter_counts[layer]
        rows.append({
            "layer": layer,
            "ffn_params": ffn,
            "ffn_formula": ffn_params(model.d_model, model.d_ff, gated=model.gated, bias=model.has_bias),
            "attention_params": attention,
            "ffn_share": ffn_share(ffn, attention),
            "ffn_flops_per_token": ffn_flops_per_token(model.d_model, model.d_ff, gated=model.gated),
        })
    frame = pd.DataFrame(rows)
    frame.attrs["model"] = model.describe()
    return frame

