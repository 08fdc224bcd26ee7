"""Load a causal LM as a kvmem :class:`Model`: raw HF weights behind a TransformerLens bridge.

No weight processing: LayerNorm is not folded, W_U is not centred. Every FFN part is read
through the architecture table in :mod:`kvmem.architectures`.

Shapes use one vocabulary: ``layer``, ``d_model``, ``d_ff``, ``vocab``, ``batch``, ``pos``.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvmem.anatomy import model_anatomy
from kvmem.architectures import ACTIVATIONS, ArchitectureSpec, get_spec, hook_name
from kvmem.builtin import BUILTIN_MODELS, gpt2_random_dir, sha256_file, smollm2_dir
from kvmem.errors import KvmemError

if TYPE_CHECKING:
    import pandas as pd
    import torch
    from torch import Tensor

__all__ = ["load_model", "Model", "FinalNorm"]


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
        return vectors * self.gain

    def apply(self, x: Tensor) -> Tensor:
        """The full norm as the model applies it (scale, gain, bias), in float32: [..., d_model]."""
        import torch

        x = x.float()
        if self.kind == "layernorm":
            x = x - x.mean(dim=-1, keepdim=True)
        x = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.eps) * self.gain.float()
        return x if self.bias is None else x + self.bias.float()


def _dtype(dtype: Any) -> torch.dtype:
    import torch

    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    names = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
             "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
    if dtype not in names:
        raise KvmemError(f"unknown dtype {dtype!r}; choose one of {', '.join(names)}")
    return names[dtype]


def _resolve_device(device: Any) -> str:
    import torch

    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    return str(device)


def _weights_fingerprint(directory: Path) -> str:
    """sha256 over the weight files; remembered in kvmem's own (immutable) cache directories."""
    import json

    files = sorted(directory.glob("*.safetensors")) or sorted(directory.glob("*.bin"))
    stamp = {f.name: [f.stat().st_size, f.stat().st_mtime_ns] for f in files}
    meta_path = directory / "kvmem-cache.json"
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else None
    if meta and meta.get("fingerprint_files") == stamp:
        return meta["fingerprint"]
    digest = hashlib.sha256()
    for file in files:
        digest.update(file.name.encode())
        digest.update(sha256_file(file).encode())
    fingerprint = "sha256:" + digest.hexdigest()
    if meta is not None:
        meta["fingerprint"], meta["fingerprint_files"] = fingerprint, stamp
        tmp = meta_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(meta, indent=2))
        os.replace(tmp, meta_path)
    return fingerprint


def _load_hf(source: str, *, revision: str | None, dtype: torch.dtype, is_local: bool):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if is_local and not (Path(source) / "config.json").exists():
        raise KvmemError(f"{source} is not an HF model directory (no config.json); pass a directory with "
                         f"config.json, weights and tokenizer files")
    try:
        config = AutoConfig.from_pretrained(source, revision=revision)
    except ValueError as error:
        raise KvmemError(f"cannot read the model config of {source}: {str(error).splitlines()[0]}") from None
    except OSError as error:
        text = str(error)
        if is_local:
            raise KvmemError(f"{source} is not an HF model directory (no readable config.json): {text.splitlines()[0]}") from None
        if "connect" in text or "offline" in text.lower() or "resolve" in text:
            raise KvmemError(
                f"could not reach the model hub to load {source!r}; pass a local HF directory instead, "
                f"or use the offline model 'smollm2-135m'"
            ) from None
        raise KvmemError(
            f"unknown model {source!r}: not a local directory and not a model on the hub; "
            f"built-in offline models are {', '.join(BUILTIN_MODELS)}"
        ) from None
    spec = get_spec(getattr(config, "model_type", "?"))
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # kvmem shows its own progress; keep loading quiet
    try:
        model = AutoModelForCausalLM.from_pretrained(source, revision=revision, dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(source, revision=revision)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    return model, tokenizer, spec


def load_model(name_or_path: str | os.PathLike, *, device: Any = None, dtype: Any = None,
               revision: str | None = None) -> Model:
    """Load a causal LM for kvmem.

    ``name_or_path``: a built-in offline name (``smollm2-135m``, ``gpt2-random``), a local
    HF directory (config + weights + tokenizer), or a hub id (``gpt2``, ``gpt2-medium``, a
    Llama-family id, ...). ``dtype``: ``float32`` (default), ``bfloat16`` or ``float16``.

    >>> model = load_model("smollm2-135m")  # doctest: +SKIP
    >>> model.n_layers, model.d_ff, model.gated
    (30, 1536, True)
    """

    torch_dtype = _dtype(dtype)
    name = str(name_or_path)
    path = Path(name).expanduser()
    if name == "smollm2-135m":
        source, display, is_local = str(smollm2_dir()), "smollm2-135m", True
    elif name == "gpt2-random":
        source, display, is_local = str(gpt2_random_dir()), "gpt2-random", True
    elif path.is_dir():
        source, display, is_local = str(path), str(path), True
    elif path.exists():
        raise KvmemError(f"model path {name} is a file, not a directory; pass an HF model directory or a hub id")
    elif name.startswith(("/", "./", "../", "~")):
        raise KvmemError(f"model directory {name} does not exist; pass an existing HF model directory or a hub id")
    else:
        source, display, is_local = name, name, False

    hf_model, tokenizer, spec = _load_hf(source, revision=revision, dtype=torch_dtype, is_local=is_local)
    if is_local:
        fingerprint = _weights_fingerprint(Path(source))
    else:
        fingerprint = "revision:" + str(getattr(hf_model.config, "_commit_hash", None) or revision or "unknown")
    return Model(hf_model, tokenizer, spec=spec, name=display, source=source, fingerprint=fingerprint,
                 revision=revision, device=_resolve_device(device), dtype=torch_dtype)


class Model:
    """A causal LM read as key-value memories. Build it with :func:`load_model`.

    Attributes: ``name``, ``fingerprint`` (hub revision or sha256 of the weight files),
    ``n_layers``, ``d_model``, ``d_ff``, ``n_ctx``, ``vocab_size``, ``activation`` (exact HF
    name, e.g. ``gelu_new``), ``gated``, ``has_bias``; ``bridge`` (TransformerLens
    ``TransformerBridge``), ``hf_model`` and ``tokenizer``.
    """

    def __init__(self, hf_model, tokenizer, *, spec: ArchitectureSpec, name: str, source: str,
                 fingerprint: str, revision: str | None, device: str, dtype: torch.dtype):
        from transformer_lens.model_bridge import TransformerBridge

        self.spec = spec
        self.name = name
        self.source = source
        self.fingerprint = fingerprint
        self.revision = revision
        self.dtype = dtype
        self.device = device
        self.tokenizer = tokenizer
        hf_model.eval()
        self.hf_model = hf_model
        # counted before the bridge wraps the modules (it adds split Q/K/V copies for GPT-2)
        self.parameter_counts: dict[int, tuple[int, int]] = {
            layer: tuple(sum(p.numel() for p in self._module(f"{spec.layers}.{layer}.{part}").parameters())
                         for part in (spec.mlp, spec.attention))
            for layer in range(len(self._module(spec.layers)))}
        self.bridge = TransformerBridge.boot_transformers(source, hf_model=hf_model, tokenizer=tokenizer,
                                                          device=device, dtype=dtype)
        self.bridge.eval()
        config = hf_model.config
        self.model_type: str = config.model_type
        self.n_layers: int = len(self._module(spec.layers))
        self.d_model: int = self.values(0).shape[1]
        self.d_ff: int = self.values(0).shape[0]
        self.vocab_size: int = self.unembedding().shape[1]
        self.n_ctx: int = next((getattr(config, f) for f in spec.n_ctx_fields if getattr(config, f, None)), 0)
        self.activation: str = next(
            (getattr(config, f) for f in spec.activation_fields if getattr(config, f, None)), "unknown"
        )
        self.gated: bool = spec.gate is not None
        self.has_bias: bool = self.key_bias(0) is not None

    # ---- module access (the only place that walks the HF module tree) ----
    def _module(self, path: str):
        module = self.hf_model
        for part in path.split("."):
            module = module[int(part)] if part.isdigit() else getattr(module, part)
        return module

    def _linear(self, layer: int, part: str | None) -> tuple[Tensor, Tensor | None] | None:
        """(weight [out, in], bias [out] or None) of an FFN linear layer."""
        if part is None:
            return None
        self._check_layer(layer)
        module = self._module(f"{self.spec.layers}.{layer}.{self.spec.mlp}.{part}")
        weight = module.weight.detach()
        if self.spec.conv1d:
            weight = weight.T
        bias = getattr(module, "bias", None)
        return weight, (bias.detach() if bias is not None else None)

    def _check_layer(self, layer: int) -> None:
        n = len(self._module(self.spec.layers))
        if not isinstance(layer, int) or not 0 <= layer < n:
            raise KvmemError(f"layer {layer!r} is out of range; this model has layers 0..{n - 1}")

    # ---- FFN parts ----
    def keys(self, layer: int) -> Tensor:
        """Keys k_i (W1 rows, or W_up rows when gated) [d_ff, d_model]."""
        return self._linear(layer, self.spec.key)[0]

    def key_bias(self, layer: int) -> Tensor | None:
        """b1 [d_ff], or None."""
        return self._linear(layer, self.spec.key)[1]

    def gate_keys(self, layer: int) -> Tensor | None:
        """Gate keys g_i (W_gate rows) [d_ff, d_model]; None for a plain FFN."""
        linear = self._linear(layer, self.spec.gate)
        return None if linear is None else linear[0]

    def gate_bias(self, layer: int) -> Tensor | None:
        linear = self._linear(layer, self.spec.gate)
        return None if linear is None else linear[1]

    def values(self, layer: int) -> Tensor:
        """Values v_i (columns of W2 / W_down, as rows) [d_ff, d_model]."""
        return self._linear(layer, self.spec.value)[0].T

    def value_bias(self, layer: int) -> Tensor | None:
        """b2 [d_model], or None."""
        return self._linear(layer, self.spec.value)[1]

    def embedding(self) -> Tensor:
        """Input embedding W_E [vocab, d_model]."""
        return self._module(self.spec.embedding).weight.detach()

    def unembedding(self) -> Tensor:
        """Unembedding W_U [d_model, vocab] (logits = final_norm(x) @ W_U + b_U)."""
        return self._module(self.spec.unembedding).weight.detach().T

    def unembedding_bias(self) -> Tensor | None:
        bias = getattr(self._module(self.spec.unembedding), "bias", None)
        return None if bias is None else bias.detach()

    def final_norm(self) -> FinalNorm:
        module = self._module(self.spec.final_norm)
        gain = module.weight.detach() + self.spec.norm_gain_offset
        bias = getattr(module, "bias", None)
        eps = float(getattr(module, "eps", None) or getattr(module, "variance_epsilon", 1e-5))
        return FinalNorm(self.spec.norm_kind, gain, None if bias is None else bias.detach(), eps)

    def hook_name(self, layer: int, site: str = "post") -> str:
        """TransformerLens hook name, e.g. ``blocks.3.mlp.hook_post`` (coefficients m)."""
        self._check_layer(layer)
        return hook_name(layer, site)

    # ---- tokens ----
    @cached_property
    def bos_token_id(self) -> int | None:
        """The token a scanned window starts with: the tokenizer's BOS, unless :data:`kvmem.builtin.SCAN_BOS`
        names a better one for this built-in model."""
        from kvmem.builtin import SCAN_BOS

        if self.name in SCAN_BOS:
            return int(self.tokenizer.convert_tokens_to_ids(SCAN_BOS[self.name]))
        return self.tokenizer.bos_token_id

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` with no special tokens added."""
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def token_str(self, token_id: int) -> str:
        """The text of one token (decoded, so GPT-2's 'Ġ' shows as a space)."""
        return self.tokenizer.decode([int(token_id)])

    @cached_property
    def vocab_strings(self) -> list[str]:
        """Decoded text of every token id [vocab] (ids past the tokenizer's vocabulary show as '<id N>')."""
        n_tok = len(self.tokenizer)
        out = self.tokenizer.batch_decode([[i] for i in range(min(n_tok, self.vocab_size))])
        return out + [f"<id {i}>" for i in range(len(out), self.vocab_size)]

    # ---- description ----
    def anatomy(self) -> pd.DataFrame:
        """Per-layer FFN and attention parameter counts of this model beside the formula."""
        return model_anatomy(self)

    def describe(self) -> dict:
        """Everything that identifies this model and its FFN, for manifests."""
        return {
            "name": self.name,
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
            "dtype": str(self.dtype).removeprefix("torch."),
        }

    def __repr__(self) -> str:
        ffn = "gated" if self.gated else "plain"
        return (f"Model({self.name!r}, {self.n_layers} layers, d_model={self.d_model}, d_ff={self.d_ff}, "
                f"{ffn} FFN, act={self.activation}, vocab={self.vocab_size})")
