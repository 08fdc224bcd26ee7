"""One table that maps each supported architecture to its FFN parts and to what lies between them
and the logits.

Only :class:`kvmem.models.Model` reaches into a model's module tree, through :func:`get_spec`;
hook names (FFN sites and the residual stream around them) are formatted only by :func:`hook_name`,
which ``Model.hook_name`` wraps. (Exceptions still to be routed here: ``kvmem.experiments.layer_prediction``
formats ``blocks.L.hook_resid_*`` names itself.)

Notation (also in README): for layer L with ``d_ff`` neurons (memory slots),
- key k_i      = row i of W1 (plain FFN) or of W_up (gated FFN)      [d_ff, d_model]
- gate key g_i = row i of W_gate (gated FFN only)                      [d_ff, d_model]
- coefficient  m_i = act(x·k_i + b1_i)  or  act(x·g_i)·(x·u_i)         hook ``blocks.L.mlp.hook_post``
- value v_i    = column i of W2 / W_down, stored here as row i         [d_ff, d_model]
- FFN(x) = Σ_i m_i v_i + b2
- written value w_i = what neuron i writes into the residual per unit m_i: v_i, times the gain of a
  norm between the FFN and the residual (``post_norm``: Gemma-2/3, OLMo-2; the positive per-token
  1/rms of that norm is left out), times Granite's ``residual_multiplier``.

Every row was validated on a tiny random-init model against the HF modules
(``tests/test_architectures.py``; the README's "Architectures" table says what was checked).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from kvmem.errors import KvmemError

__all__ = ["ArchitectureSpec", "ARCHITECTURES", "ACTIVATIONS", "MOE_FIELDS", "get_spec", "check_config",
           "hook_name", "parse_hook_name", "HOOK_SITES"]

NormKind = Literal["layernorm", "rmsnorm"]


@dataclass(frozen=True, kw_only=True)
class ArchitectureSpec:
    """Where the FFN parts of one HF architecture live (module paths relative to the model), and the
    maps between an FFN and the logits.

    Defaults are the common case (a Linear FFN at ``mlp``, LayerNorm, ``lm_head``, a serial block, no
    norm after the FFN); a row names the rest.
    """

    family: str  # short name shown to users
    ffn_kind: str  # shown in the README table: "GELU MLP", "SwiGLU", ...
    layers: str  # path of the ModuleList of blocks
    attention: str  # path of the attention sublayer inside a block
    key: str  # W1 / W_up, inside the FFN
    value: str  # W2 / W_down, inside the FFN
    embedding: str  # input embedding module (weight [vocab, d_embed])
    final_norm: str  # final norm module before the unembedding
    mlp: str = "mlp"  # path of the FFN inside a block ("" where its linears sit in the block, as in OPT)
    ffn_norm: str | None = None  # norm between the residual and the FFN, inside a block: its input is the residual
    #                              the FFN reads (hook_resid_mid); None where the FFN reads the residual unnormed
    gate: str | None = None  # W_gate inside the FFN, None for a plain FFN
    fused_gate_up: bool = False  # ``key`` holds the gate rows first and the up rows second (Phi-3)
    conv1d: bool = False  # HF Conv1D stores weights as (in, out): transpose to (out, in)
    norm_kind: NormKind = "layernorm"
    norm_gain_offset: float = 0.0  # Gemma's RMSNorm multiplies by (1 + weight); applies to every norm of the row
    post_norm: str | None = None  # norm between the FFN output and the residual, inside a block (sandwich norm)
    residual_multiplier_field: str | None = None  # config field scaling the FFN output before the residual
    embedding_multiplier_field: str | None = None  # config field scaling the embeddings (Granite)
    logits_scaling_field: str | None = None  # config field dividing the logits (Granite)
    logit_softcap_field: str | None = None  # config field of tanh soft-capping of the logits (Gemma-2)
    embedding_projection: str | None = None  # linear map embedding -> residual (OPT's project_in), may be absent
    unembedding_projection: str | None = None  # linear map final norm -> lm_head (OPT's project_out), may be absent
    parallel: bool = False  # attention and FFN read the same residual (GPT-J, Phi)
    parallel_field: str | None = None  # config field that makes the block parallel (GPT-NeoX)
    unembedding: str = "lm_head"  # lm_head (weight [vocab, d_embed])
    activation_fields: tuple[str, ...] = ("hidden_act",)  # config fields naming the activation, first found wins
    n_ctx_fields: tuple[str, ...] = ("max_position_embeddings",)
    refuse: Callable[[Any], str | None] | None = None  # config -> why kvmem cannot read it, or None

    def __post_init__(self) -> None:
        if (self.parallel or self.parallel_field) and (self.post_norm or self.residual_multiplier_field):
            raise ValueError(f"{self.family}: a parallel block with a post-FFN norm or multiplier is not modelled")
        if self.fused_gate_up and self.gate != self.key:
            raise ValueError(f"{self.family}: a fused gate/up projection names one module for gate and key")


def _llama_like(family: str, **overrides) -> ArchitectureSpec:
    fields = dict(family=family, ffn_kind="SwiGLU", layers="model.layers", attention="self_attn", key="up_proj",
                  value="down_proj", gate="gate_proj", embedding="model.embed_tokens", final_norm="model.norm",
                  norm_kind="rmsnorm", ffn_norm="post_attention_layernorm")
    fields.update(overrides)
    return ArchitectureSpec(**fields)


def _opt_refuse(config: Any) -> str | None:
    if not getattr(config, "do_layer_norm_before", True):
        return ("it normalises after each residual add (do_layer_norm_before=False, as OPT-350m), so every "
                "layer's output passes a LayerNorm of the whole residual; kvmem reads pre-norm OPT only")
    if getattr(config, "_remove_final_layer_norm", False):
        return "it has no final layer norm (_remove_final_layer_norm=True)"
    return None


_GEMMA = dict(norm_gain_offset=1.0, activation_fields=("hidden_activation", "hidden_act"), ffn_kind="GeGLU")

# HF config.model_type -> spec
ARCHITECTURES: dict[str, ArchitectureSpec] = {
    "gpt2": ArchitectureSpec(family="gpt2", ffn_kind="GELU MLP", layers="transformer.h", attention="attn",
                             key="c_fc", value="c_proj", conv1d=True, embedding="transformer.wte", ffn_norm="ln_2",
                             final_norm="transformer.ln_f", activation_fields=("activation_function",),
                             n_ctx_fields=("n_positions", "n_ctx")),
    "gpt_neo": ArchitectureSpec(family="gpt_neo", ffn_kind="GELU MLP", layers="transformer.h", attention="attn",
                                key="c_fc", value="c_proj", ffn_norm="ln_2", embedding="transformer.wte",
                                final_norm="transformer.ln_f", activation_fields=("activation_function",)),
    "gptj": ArchitectureSpec(family="gptj", ffn_kind="GELU MLP, parallel block", layers="transformer.h",
                             attention="attn", key="fc_in", value="fc_out", embedding="transformer.wte",
                             final_norm="transformer.ln_f", parallel=True, activation_fields=("activation_function",),
                             n_ctx_fields=("n_positions",)),
    "gpt_neox": ArchitectureSpec(family="gpt_neox", ffn_kind="GELU MLP, parallel block (use_parallel_residual)",
                                 layers="gpt_neox.layers", attention="attention", key="dense_h_to_4h",
                                 value="dense_4h_to_h", embedding="gpt_neox.embed_in", ffn_norm="post_attention_layernorm",
                                 final_norm="gpt_neox.final_layer_norm", parallel_field="use_parallel_residual"),
    "opt": ArchitectureSpec(family="opt", ffn_kind="ReLU MLP", layers="model.decoder.layers", attention="self_attn",
                            mlp="", key="fc1", value="fc2", embedding="model.decoder.embed_tokens", ffn_norm="final_layer_norm",
                            final_norm="model.decoder.final_layer_norm",
                            embedding_projection="model.decoder.project_in",
                            unembedding_projection="model.decoder.project_out",
                            activation_fields=("activation_function",), refuse=_opt_refuse),
    "phi": ArchitectureSpec(family="phi", ffn_kind="GELU MLP, parallel block", layers="model.layers",
                            attention="self_attn", key="fc1", value="fc2", embedding="model.embed_tokens",
                            final_norm="model.final_layernorm", parallel=True),
    "phi3": _llama_like("phi3", key="gate_up_proj", gate="gate_up_proj", fused_gate_up=True,
                        ffn_kind="SwiGLU, fused gate_up_proj"),
    "llama": _llama_like("llama"),
    "mistral": _llama_like("mistral"),
    "qwen2": _llama_like("qwen2"),
    "qwen3": _llama_like("qwen3"),
    "gemma": _llama_like("gemma", **_GEMMA),
    "gemma2": _llama_like("gemma2", post_norm="post_feedforward_layernorm", ffn_norm="pre_feedforward_layernorm", logit_softcap_field="final_logit_softcapping",
                          **{**_GEMMA, "ffn_kind": "GeGLU, post-FFN norm"}),
    "gemma3_text": _llama_like("gemma3_text", post_norm="post_feedforward_layernorm",
                               ffn_norm="pre_feedforward_layernorm",
                               logit_softcap_field="final_logit_softcapping",
                               **{**_GEMMA, "ffn_kind": "GeGLU, post-FFN norm"}),
    "olmo2": _llama_like("olmo2", post_norm="post_feedforward_layernorm", ffn_norm=None, ffn_kind="SwiGLU, post-FFN norm only"),
    "granite": _llama_like("granite", residual_multiplier_field="residual_multiplier",
                           embedding_multiplier_field="embedding_multiplier", logits_scaling_field="logits_scaling",
                           ffn_kind="SwiGLU, scaled residual"),
}

# config fields that mark mixture-of-experts FFN layers (router + experts: no single W2 per layer)
MOE_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts", "num_experts_per_tok")

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


def parse_hook_name(name: str) -> tuple[int, str]:
    """``blocks.L.<site>`` -> (L, site): the inverse of :func:`hook_name`; one line naming the accepted forms
    for anything else."""
    sites = {suffix: site for site, suffix in HOOK_SITES.items()}
    parts = name.split(".", 2) if isinstance(name, str) else []
    if len(parts) == 3 and parts[0] == "blocks" and parts[1].isdigit() and parts[2] in sites:
        return int(parts[1]), sites[parts[2]]
    raise KvmemError(f"unknown hook name {name!r}; kvmem reads blocks.L.<site> with site one of "
                     f"{', '.join(HOOK_SITES.values())}")


def get_spec(model_type: str) -> ArchitectureSpec:
    """The spec for an HF ``config.model_type``; a clear one-line error for anything else."""
    try:
        return ARCHITECTURES[model_type]
    except (KeyError, TypeError):
        raise KvmemError(
            f"unsupported architecture {model_type!r}: kvmem has no FFN table entry for it; "
            f"supported model types are {', '.join(sorted(ARCHITECTURES))}"
        ) from None


def check_config(config: Any) -> ArchitectureSpec:
    """The spec for an HF config, after checking kvmem can read this model: one line naming the model
    type and the supported ones for mixture-of-experts layers, unknown types and refused variants."""
    model_type = getattr(config, "model_type", None)
    supported = ", ".join(sorted(ARCHITECTURES))
    experts = next((f for f in MOE_FIELDS if (getattr(config, f, None) or 0) > 1), None)
    if experts is not None and model_type not in ARCHITECTURES:
        raise KvmemError(
            f"unsupported architecture {model_type!r}: its FFN layers are mixtures of experts "
            f"({experts}={getattr(config, experts)}), which kvmem cannot read as one key-value memory per layer; "
            f"supported model types are {supported}")
    spec = get_spec(model_type)
    reason = None if spec.refuse is None else spec.refuse(config)
    if reason is not None:
        raise KvmemError(f"unsupported {model_type!r} variant: {reason}; supported model types are {supported}")
    return spec
