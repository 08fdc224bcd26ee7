"""One table that maps each supported architecture to its FFN parts.

Only :class:`kvmem.models.Model` reaches into a model's module tree, through :func:`get_spec`;
hook names (FFN sites and the residual stream around them) are formatted only by :func:`hook_name`,
which ``Model.hook_name`` wraps. (Exceptions still to be routed here: ``kvmem.experiments.composition``
formats ``blocks.L.hook_resid_*`` names itself.)

Notation (also in README): for layer L with ``d_ff`` neurons (memory slots),
- key k_i      = row i of W1 (plain FFN) or of W_up (gated FFN)      [d_ff, d_model]
- gate key g_i = row i of W_gate (gated FFN only)                      [d_ff, d_model]
- coefficient  m_i = act(x·k_i + b1_i)  or  act(x·g_i)·(x·u_i)         hook ``blocks.L.mlp.hook_post``
- value v_i    = column i of W2 / W_down, stored here as row i         [d_ff, d_model]
- FFN(x) = Σ_i m_i v_i + b2
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvmem.errors import KvmemError

__all__ = ["ArchitectureSpec", "ARCHITECTURES", "ACTIVATIONS", "get_spec", "hook_name", "HOOK_SITES"]

NormKind = Literal["layernorm", "rmsnorm"]


@dataclass(frozen=True, kw_only=True)
class ArchitectureSpec:
    """Where the FFN parts of one HF architecture live (module paths relative to the model).

    Defaults are the common case (a Linear FFN at ``mlp``, LayerNorm, ``lm_head``); a row names the rest.
    """

    family: str  # short name shown to users
    layers: str  # path of the ModuleList of blocks
    attention: str  # path of the attention sublayer inside a block
    key: str  # W1 / W_up, inside the FFN
    value: str  # W2 / W_down, inside the FFN
    embedding: str  # input embedding module (weight [vocab, d_model])
    final_norm: str  # final norm module before the unembedding
    mlp: str = "mlp"  # path of the FFN inside a block
    gate: str | None = None  # W_gate inside the FFN, None for a plain FFN
    conv1d: bool = False  # HF Conv1D stores weights as (in, out): transpose to (out, in)
    norm_kind: NormKind = "layernorm"
    norm_gain_offset: float = 0.0  # Gemma's RMSNorm multiplies by (1 + weight)
    unembedding: str = "lm_head"  # lm_head (weight [vocab, d_model])
    activation_fields: tuple[str, ...] = ("hidden_act",)  # config fields naming the activation, first found wins
    n_ctx_fields: tuple[str, ...] = ("max_position_embeddings",)


def _llama_like(family: str, **overrides) -> ArchitectureSpec:
    fields = dict(family=family, layers="model.layers", attention="self_attn", key="up_proj", value="down_proj",
                  gate="gate_proj", embedding="model.embed_tokens", final_norm="model.norm", norm_kind="rmsnorm")
    fields.update(overrides)
    return ArchitectureSpec(**fields)


# HF config.model_type -> spec
ARCHITECTURES: dict[str, ArchitectureSpec] = {
    "gpt2": ArchitectureSpec(family="gpt2", layers="transformer.h", attention="attn", key="c_fc", value="c_proj",
                             conv1d=True, embedding="transformer.wte", final_norm="transformer.ln_f",
                             activation_fields=("activation_function",), n_ctx_fields=("n_positions", "n_ctx")),
    "gpt_neox": ArchitectureSpec(family="gpt_neox", layers="gpt_neox.layers", attention="attention",
                                 key="dense_h_to_4h", value="dense_4h_to_h", embedding="gpt_neox.embed_in",
                                 final_norm="gpt_neox.final_layer_norm", unembedding="embed_out"),
    "llama": _llama_like("llama"),
    "mistral": _llama_like("mistral"),
    "qwen2": _llama_like("qwen2"),
    "qwen3": _llama_like("qwen3"),
    "gemma": _llama_like("gemma", norm_gain_offset=1.0, activation_fields=("hidden_activation", "hidden_act")),
    "gemma2": _llama_like("gemma2", norm_gain_offset=1.0, activation_fields=("hidden_activation", "hidden_act")),
}

# exact HF activation name -> (formula, how it is computed)
ACTIVATIONS: dict[str, str] = {
    "gelu_new": "GELU, tanh approximation",
    "gelu_pytorch_tanh": "GELU, tanh approximation",
    "gelu_fast": "GELU, tanh approximation (fast form)",
    "gelu": "GELU, exact erf form",
    "silu": "SiLU (swish)",
    "swish": "SiLU (swish)",
    "relu": "ReLU",
}

# hook sites of a block (its FFN and the residual stream around it), as TransformerLens names them
HOOK_SITES = {
    "in": "mlp.hook_in",  # FFN input (after the pre-FFN norm)      [batch, pos, d_model]
    "pre": "mlp.hook_pre",  # W1 x + b1, or the gate W_gate x        [batch, pos, d_ff]
    "pre_linear": "mlp.hook_pre_linear",  # W_up x (gated only)       [batch, pos, d_ff]
    "post": "mlp.hook_post",  # memory coefficients m                [batch, pos, d_ff]
    "out": "mlp.hook_out",  # FFN output Σ m_i v_i + b2             [batch, pos, d_model]
    "resid_pre": "hook_resid_pre",  # residual entering the block    [batch, pos, d_model]
    "resid_mid": "hook_resid_mid",  # residual before the FFN         [batch, pos, d_model]
    "resid_post": "hook_resid_post",  # residual after the FFN        [batch, pos, d_model]
}


def hook_name(layer: int, site: str = "post") -> str:
    """TransformerLens hook name of a block site, e.g. ``blocks.6.mlp.hook_post`` or ``blocks.6.hook_resid_mid``."""
    if site not in HOOK_SITES:
        raise KvmemError(f"unknown hook site {site!r}; choose one of {', '.join(HOOK_SITES)}")
    return f"blocks.{layer}.{HOOK_SITES[site]}"


def get_spec(model_type: str) -> ArchitectureSpec:
    """The spec for an HF ``config.model_type``; a clear error for anything else."""
    try:
        return ARCHITECTURES[model_type]
    except KeyError:
        raise KvmemError(
            f"unsupported architecture {model_type!r}: kvmem has no FFN table entry for it; "
            f"supported model types are {', '.join(sorted(ARCHITECTURES))}"
        ) from None
