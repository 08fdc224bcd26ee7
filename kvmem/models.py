"""A causal LM read as key-value memories (:class:`Model`): raw HF weights, read by the scan as HF runs
them (``Model.unbridged``) and by tracing and interventions behind a TransformerLens bridge (``Model.bridge``,
built on first use).

:func:`kvmem.loading.load_model` builds one.

No weight processing: LayerNorm is not folded, W_U is not centred. Every FFN part is read
through the architecture table in :mod:`kvmem.architectures`. Two readings of a value exist:
``Model.values`` (the raw W2 columns) and ``Model.written_values`` (what a neuron writes into the
residual stream, the one every projection uses). The linear maps between the residual and the
vocabulary (OPT's ``project_out`` and ``project_in``, Granite's scalings, Gemma's embedding scale)
are folded into ``Model.unembedding`` and ``Model.embedding``, so both act on the residual stream.

Device rule (:func:`kvmem.devices.resolve_device`): :func:`kvmem.loading.load_model` moves the HF model to its
device before anything else reads it, so before the TransformerLens bridge is built (TransformerLens leaves a pre-loaded model where
it is and builds its split copies, e.g. Phi-3's gate and up, from the weights it finds), so every
tensor the bridge holds lives there; ``Model.device`` reads where the parameters are.

Shapes use one vocabulary: ``layer``, ``d_model``, ``d_ff``, ``vocab``, ``batch``, ``pos``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

from kvmem.anatomy import model_anatomy
from kvmem.architectures import ACTIVATIONS, ArchitectureSpec, hook_name
from kvmem.devices import resolve_device
from kvmem.errors import KvmemError
from kvmem.model_tokens import ModelTokens
from kvmem.unbridged import separate_tree, unbridged

if TYPE_CHECKING:
    import pandas as pd
    import torch
    from torch import Tensor

__all__ = ["Model", "FinalNorm"]


@dataclass(frozen=True)
class FinalNorm:
    """The final norm before the unembedding, as kvmem's ``final_norm`` convention uses it.

    ``gain`` is the effective per-channel gain [d_model] (Gemma's ``1 + weight`` already added).
    """

    kind: str  # "layernorm" | "rmsnorm"
    gain: Tensor  # [d_model]
    bias: Tensor | None  # [d_model] or None
    eps: float

    def linear_part(self, vectors: Tensor) -> Tensor:
        """The norm's linear map: centring (LayerNorm only) then gain; no division by the scale.

        vectors [..., d_model] -> [..., d_model]. The dropped scale 1/σ is positive, so it never
        changes a ranking; the dropped bias is a constant offset shared by every vector.
        """
        if self.kind == "layernorm":
            vectors = vectors - vectors.mean(dim=-1, keepdim=True)
        return vectors * self.gain.to(vectors.device)

    def apply(self, x: Tensor) -> Tensor:
        """The full norm as the model applies it (scale, gain, bias), in float32: [..., d_model]."""
        import torch

        x = x.float()
        if self.kind == "layernorm":
            x = x - x.mean(dim=-1, keepdim=True)
        x = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.eps) * self.gain.float().to(x.device)
        return x if self.bias is None else x + self.bias.float().to(x.device)


class Model(ModelTokens):
    """A causal LM read as key-value memories. Build it with :func:`kvmem.loading.load_model`.

    Attributes: ``name``, ``fingerprint`` (hub revision or sha256 of the weight files),
    ``n_layers``, ``d_model``, ``d_ff``, ``n_ctx``, ``vocab_size``, ``activation`` (exact HF
    name, e.g. ``gelu_new``), ``gated``, ``has_bias``, ``parallel_block`` (attention and FFN read
    the same residual), ``device`` (where the parameters are), ``attention`` (the HF attention
    implementation the scan's forward runs); ``bridge`` (TransformerLens ``TransformerBridge``, built
    on first use), ``unbridged`` (the HF model as HF runs it), ``hf_model`` and ``tokenizer``.
    """

    def __init__(self, hf_model, tokenizer, *, spec: ArchitectureSpec, name: str, source: str,
                 fingerprint: str, revision: str | None, dtype: torch.dtype, device: str | None = None,
                 description: str | None = None):
        self.spec = spec
        self.name = name
        self.description = description  # what a built-in model is (kvmem.builtin.BUILTIN_MODELS), else None
        self.source = source
        self.fingerprint = fingerprint
        self.revision = revision
        self.dtype = dtype
        self.tokenizer = tokenizer
        hf_model.eval()
        if device is not None:
            hf_model.to(device=resolve_device(device))  # before the bridge copies anything
        self.hf_model = hf_model
        # HF's own choice (sdpa where supported)
        self.attention: str = getattr(hf_model.config, "_attn_implementation", None) or "eager"
        self._folded: dict[str, tuple[tuple, Tensor]] = {}
        self.parameter_counts: dict[int, tuple[int, int]] = {
            layer: (self._count(layer, self._ffn_paths()), self._count(layer, (spec.attention,)))
            for layer in range(len(self._module(spec.layers)))}
        config = hf_model.config
        self.model_type: str = config.model_type
        self.n_layers: int = len(self._module(spec.layers))
        self.d_model: int = self.values(0).shape[1]
        self.d_ff: int = self.values(0).shape[0]
        self.vocab_size: int = self._module(spec.unembedding).weight.shape[0]
        self.n_ctx: int = next((getattr(config, f) for f in spec.n_ctx_fields if getattr(config, f, None)), 0)
        self.activation: str = next(
            (getattr(config, f) for f in spec.activation_fields if getattr(config, f, None)), "unknown"
        )
        self.gated: bool = spec.gate is not None
        self.has_bias: bool = self.key_bias(0) is not None
        self.parallel_block: bool = spec.parallel or bool(spec.parallel_field and getattr(config, spec.parallel_field))

    @property
    def device(self) -> str:
        """Where the parameters are, e.g. ``cpu`` or ``cuda:0``."""
        return str(next(self.hf_model.parameters()).device)

    @cached_property
    def bridge(self):
        """A TransformerLens ``TransformerBridge`` over :attr:`hf_model`'s weights, built on first use
        (importing TransformerLens and booting take seconds; kvmem itself never needs it: every reading and
        edit goes through plain torch hooks on the HF modules, :mod:`kvmem.capture`).

        Booting a bridge rewires the module tree it is given (its components in place of the HF modules,
        eager attention). It is booted here on a tree of its own (:func:`kvmem.unbridged.separate_tree`) that
        shares the parameter tensors, so :attr:`hf_model` keeps its modules, state_dict keys, attention
        implementation and logits; a weight edited in place shows in both."""
        from transformer_lens.model_bridge import TransformerBridge

        bridge = TransformerBridge.boot_transformers(self.source, hf_model=separate_tree(self.hf_model),
                                                     tokenizer=self.tokenizer, device=self.device, dtype=self.dtype)
        bridge.eval()
        return bridge

    @cached_property
    def unbridged(self):
        """The HF model as HF runs it: the same modules and weights without the bridge's components,
        with the attention implementation it was loaded with (:func:`kvmem.unbridged.unbridged`)."""
        return unbridged(self.hf_model, self.attention)

    def site_location(self, layer: int, site: str) -> tuple[str, str, int | None]:
        """Where a hook site of a block (:data:`kvmem.architectures.HOOK_SITES`) is computed in the HF module
        tree -> (module path from the model's root, ``"input"`` or ``"output"`` of that module, the half of
        the output: 0 gate, 1 up of a fused gate/up projection, None all of it).

        FFN sites: ``post`` the coefficients m, the input of the down projection W2; ``pre`` the gate
        pre-activation W_gate x (a plain FFN: W1 x + b); ``pre_linear`` the up pre-activation W_up x (gated
        FFNs only); ``in`` the FFN's input (after the pre-FFN norm); ``out`` the FFN's output Σ m_i v_i + b2
        (before a post-FFN norm or multiplier). Residual sites: ``resid_pre`` the block's input,
        ``resid_post`` its output, ``resid_mid`` the residual the FFN reads in a serial block (the input of
        the pre-FFN norm; without one, the FFN's own input); a parallel block has no ``resid_mid``.
        """
        self._check_layer(layer)
        spec = self.spec
        block = f"{spec.layers}.{layer}"
        ffn = ".".join(p for p in (block, spec.mlp) if p)
        parts: dict[str, tuple[str | None, str, int | None]] = {
            "post": (f"{ffn}.{spec.value}", "input", None),
            "pre": (f"{ffn}.{spec.gate or spec.key}", "output", 0 if spec.fused_gate_up else None),
            "pre_linear": (f"{ffn}.{spec.key}" if spec.gate else None, "output", 1 if spec.fused_gate_up else None),
            "in": (f"{ffn}.{spec.key}", "input", None),
            "out": (f"{ffn}.{spec.value}", "output", None),
            "resid_pre": (block, "input", None),
            "resid_post": (block, "output", None),
            "resid_mid": (None if self.parallel_block else
                          f"{block}.{spec.ffn_norm}" if spec.ffn_norm else f"{ffn}.{spec.key}", "input", None),
        }
        if site not in parts:
            raise KvmemError(f"unknown hook site {site!r}; choose one of {', '.join(parts)}")
        path, where, half = parts[site]
        if path is None:
            have = ", ".join(name for name, part in parts.items() if part[0])
            kind = "parallel block" if site == "resid_mid" else "plain FFN"
            raise KvmemError(f"site {site!r} does not exist in this {kind} ({self.spec.family}); its sites are {have}")
        return path, where, half

    def has_site(self, layer: int, site: str) -> bool:
        """Whether block ``layer`` of this model has hook site ``site`` (:meth:`site_location`)."""
        try:
            self.site_location(layer, site)
        except KvmemError:
            return False
        return True

    def ffn_site(self, layer: int, site: str) -> tuple[torch.nn.Module, str, int | None]:
        """Where an FFN site (``post``, ``pre``, ``pre_linear``) is computed in :attr:`unbridged`, the scan's
        view -> (module, ``"input"`` or ``"output"``, the half of the output; see :meth:`site_location`)."""
        if site not in ("post", "pre", "pre_linear"):
            raise KvmemError(f"FFN site {site!r} is not one the scan reads: choose post, pre or pre_linear")
        path, where, half = self.site_location(layer, site)
        return _walk(self.unbridged, path), where, half

    # ---- module access (the only place that walks the HF module tree) ----
    def _module(self, path: str):
        return _walk(self.hf_model, path)

    def _optional(self, path: str | None):
        """The module at ``path``, or None where the row names none or this model lacks it."""
        if path is None:
            return None
        try:
            return self._module(path)
        except (AttributeError, IndexError):
            return None

    def _ffn_paths(self) -> tuple[str, ...]:
        """Module paths inside a block that hold the FFN's parameters."""
        if self.spec.mlp:
            return (self.spec.mlp,)
        return tuple(dict.fromkeys(p for p in (self.spec.key, self.spec.gate, self.spec.value) if p))

    def _count(self, layer: int, paths: tuple[str, ...]) -> int:
        return sum(p.numel() for path in paths for p in self._module(f"{self.spec.layers}.{layer}.{path}").parameters())

    def _block_module(self, layer: int, path: str):
        return self._module(f"{self.spec.layers}.{layer}.{path}")

    def _linear(self, layer: int, part: str | None, *, half: int | None = None) -> tuple[Tensor, Tensor | None] | None:
        """(weight [out, in], bias [out] or None) of an FFN linear layer; ``half`` 0/1 takes the first or
        second half of the output rows (a fused gate/up projection)."""
        if part is None:
            return None
        self._check_layer(layer)
        module = self._block_module(layer, ".".join(p for p in (self.spec.mlp, part) if p))
        weight = module.weight.detach()
        if self.spec.conv1d:
            weight = weight.T
        bias = getattr(module, "bias", None)
        bias = None if bias is None else bias.detach()
        if half is not None:
            weight = weight.chunk(2, dim=0)[half]
            bias = None if bias is None else bias.chunk(2, dim=0)[half]
        return weight, bias

    def _key(self, layer: int):
        return self._linear(layer, self.spec.key, half=1 if self.spec.fused_gate_up else None)

    def _gate(self, layer: int):
        return self._linear(layer, self.spec.gate, half=0 if self.spec.fused_gate_up else None)

    def _check_layer(self, layer: int) -> None:
        n = len(self._module(self.spec.layers))
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < n:
            raise KvmemError(f"layer {layer!r} is out of range; this model has layers 0..{n - 1}")

    def _config_float(self, field: str | None, default: float) -> float:
        value = None if field is None else getattr(self.hf_model.config, field, None)
        return default if value is None else float(value)

    # ---- FFN parts ----
    def keys(self, layer: int) -> Tensor:
        """Keys k_i (W1 rows, or W_up rows when gated; Phi-3: the second half of gate_up_proj) [d_ff, d_model]."""
        return self._key(layer)[0]

    def key_bias(self, layer: int) -> Tensor | None:
        """b1 [d_ff], or None."""
        return self._key(layer)[1]

    def gate_keys(self, layer: int) -> Tensor | None:
        """Gate keys g_i (W_gate rows; Phi-3: the first half of gate_up_proj) [d_ff, d_model]; None for a plain FFN."""
        linear = self._gate(layer)
        return None if linear is None else linear[0]

    def gate_bias(self, layer: int) -> Tensor | None:
        linear = self._gate(layer)
        return None if linear is None else linear[1]

    def values(self, layer: int) -> Tensor:
        """Values v_i, the raw columns of W2 / W_down (as rows) [d_ff, d_model]: FFN(x) = Σ_i m_i v_i + b2.

        What a neuron writes into the residual stream is :meth:`written_values`; the two differ where a
        norm or a multiplier sits between the FFN and the residual (Gemma-2/3, OLMo-2, Granite).
        """
        return self._linear(layer, self.spec.value)[0].T

    def value_bias(self, layer: int) -> Tensor | None:
        """b2 [d_model], or None."""
        return self._linear(layer, self.spec.value)[1]

    def post_norm_gain(self, layer: int) -> Tensor | None:
        """Elementwise gain [d_model] of the norm between the FFN and the residual (Gemma's ``1 + w``,
        OLMo-2's ``w``); None where the FFN output goes to the residual unnormed."""
        self._check_layer(layer)
        if self.spec.post_norm is None:
            return None
        return self._block_module(layer, self.spec.post_norm).weight.detach().float() + self.spec.norm_gain_offset

    @property
    def residual_multiplier(self) -> float:
        """The scalar the FFN output is multiplied by before the residual add (Granite), else 1."""
        return self._config_float(self.spec.residual_multiplier_field, 1.0)

    def written_values(self, layer: int, rows: slice = slice(None)) -> Tensor:
        """What neuron i writes into the residual stream per unit of m_i [d_ff, d_model] float32
        (``rows``: only those neurons, e.g. ``slice(None, None, 16)``, without building the rest).

        w_i = residual_multiplier · gain ⊙ v_i, with ``gain`` the post-FFN norm's elementwise gain
        (:meth:`post_norm_gain`; 1 without one). That norm also divides by the per-token rms of the
        whole FFN output, a positive scale left out here: the residual update at a token is
        Σ_i m_i w_i / rms. Without a post-FFN norm or multiplier this is :meth:`values` (in float32).
        """
        values = self.values(layer)[rows].float()  # [d_ff, d_model]
        gain = self.post_norm_gain(layer)
        if gain is not None:
            values = values * gain.to(values.device)
        multiplier = self.residual_multiplier
        return values * multiplier if multiplier != 1.0 else values

    def _fold(self, key: str, parts: tuple, build) -> Tensor:
        """A folded matrix, rebuilt when one of its source tensors changed in place."""
        stamp = tuple((id(t), t._version) for t in parts)
        cached = self._folded.get(key)
        if cached is None or cached[0] != stamp:
            self._folded[key] = (stamp, build())
        return self._folded[key][1]

    def embedding(self) -> Tensor:
        """What token t adds to the residual stream, row t [vocab, d_model].

        The input embedding's weight, then every map to the residual the model applies: OPT's
        ``project_in``, Gemma's ``embed_scale`` (sqrt(d_model)), Granite's ``embedding_multiplier``.
        The raw weight where there is none (then in the model's dtype, else float32).
        """
        module = self._module(self.spec.embedding)
        weight = module.weight.detach()  # [vocab, d_embed]
        project = self._optional(self.spec.embedding_projection)
        scale = getattr(module, "embed_scale", None)
        multiplier = self._config_float(self.spec.embedding_multiplier_field, 1.0)
        if project is None and scale is None and multiplier == 1.0:
            return weight
        parts = (weight,) + (() if project is None else (project.weight,))

        def build() -> Tensor:
            folded = weight.float()
            if project is not None:
                folded = folded @ project.weight.detach().float().T  # [vocab, d_model]
            if scale is not None:
                folded = folded * scale.to(weight.dtype).float()
            return folded * multiplier

        return self._fold("embedding", parts, build)

    def unembedding(self) -> Tensor:
        """W_U [d_model, vocab]: the map from the residual after the final norm to the logits.

        ``lm_head``'s weight, with every linear map between the final norm and the logits folded in:
        OPT's ``project_out`` and Granite's division by ``logits_scaling``, so that
        logits = final_norm(x) @ W_U + b_U (Gemma-2's tanh soft-cap, monotone, is applied by
        :meth:`logits` only). The raw weight where there is none (model dtype), else float32.
        """
        weight = self._module(self.spec.unembedding).weight.detach()  # [vocab, d_embed]
        project = self._optional(self.spec.unembedding_projection)
        scaling = self._config_float(self.spec.logits_scaling_field, 1.0)
        if project is None and scaling == 1.0:
            return weight.T
        parts = (weight,) + (() if project is None else (project.weight,))

        def build() -> Tensor:
            folded = weight.float().T  # [d_embed, vocab]
            if project is not None:
                folded = project.weight.detach().float().T @ folded  # [d_model, vocab]
            return folded / scaling

        return self._fold("unembedding", parts, build)

    def unembedding_bias(self) -> Tensor | None:
        """b_U [vocab] (GPT-J, Phi), scaled like W_U; None without one."""
        bias = getattr(self._module(self.spec.unembedding), "bias", None)
        if bias is None:
            return None
        scaling = self._config_float(self.spec.logits_scaling_field, 1.0)
        return bias.detach() if scaling == 1.0 else bias.detach().float() / scaling

    def final_norm(self) -> FinalNorm:
        module = self._module(self.spec.final_norm)
        gain = module.weight.detach() + self.spec.norm_gain_offset
        bias = getattr(module, "bias", None)
        eps = float(getattr(module, "eps", None) or getattr(module, "variance_epsilon", 1e-5))
        return FinalNorm(self.spec.norm_kind, gain, None if bias is None else bias.detach(), eps)

    def logits(self, resid: Tensor) -> Tensor:
        """The model's own logits from residuals entering the final norm: [..., d_model] -> [..., vocab] float32.

        The full final norm, W_U and b_U (:meth:`unembedding`), then Gemma-2's tanh soft-cap where the
        config has one: what the model computes at its last position.
        """
        import torch

        logits = self.final_norm().apply(resid) @ self.unembedding().float().to(resid.device)
        bias = self.unembedding_bias()
        if bias is not None:
            logits = logits + bias.float().to(resid.device)
        cap = self._config_float(self.spec.logit_softcap_field, 0.0)
        return cap * torch.tanh(logits / cap) if cap else logits

    def hook_name(self, layer: int, site: str = "post") -> str:
        """TransformerLens hook name, e.g. ``blocks.3.mlp.hook_post`` (coefficients m)."""
        self._check_layer(layer)
        return hook_name(layer, site)

    # ---- description ----
    def anatomy(self) -> pd.DataFrame:
        """Per-layer FFN and attention parameter counts of this model beside the formula."""
        return model_anatomy(self)

    def describe(self) -> dict:
        """Everything that identifies this model and its FFN, for manifests."""
        return {
            "name": self.name,
            "description": self.description,
            "fingerprint": self.fingerprint,
            "revision": self.revision,
            "model_type": self.model_type,
            "family": self.spec.family,
            "n_layers": self.n_layers,
            "d_model": self.d_model,
            "d_ff": self.d_ff,
            "n_ctx": self.n_ctx,
            "vocab_size": self.vocab_size,
            "activation": self.activation,
            "activation_description": ACTIVATIONS.get(self.activation, "unknown"),
            "gated": self.gated,
            "has_bias": self.has_bias,
            "final_norm": self.spec.norm_kind,
            "post_ffn_norm": self.spec.post_norm,
            "residual_multiplier": self.residual_multiplier,
            "parallel_block": self.parallel_block,
            "dtype": str(self.dtype).removeprefix("torch."),
            "attention": self.attention,
        }

    def __repr__(self) -> str:
        ffn = "gated" if self.gated else "plain"
        return (f"Model({self.name!r}, {self.n_layers} layers, d_model={self.d_model}, d_ff={self.d_ff}, "
                f"{ffn} FFN, act={self.activation}, vocab={self.vocab_size})")


def _walk(root, path: str):
    """The module at dotted ``path`` under ``root`` (digits index a ModuleList)."""
    module = root
    for part in path.split("."):
        module = module[int(part)] if part.isdigit() else getattr(module, part)
    return module
