"""Load a causal LM for kvmem: built-in offline names, local HF directories and hub ids, in a dtype,
onto a device (moved there before the TransformerLens bridge is built), with a weights fingerprint."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvmem.architectures import check_config
from kvmem.builtin import BUILTIN_MODELS, gpt2_random_dir, sha256_file, smollm2_dir
from kvmem.collector import collections_paused
from kvmem.devices import resolve_device
from kvmem.errors import KvmemError
from kvmem.models import Model

if TYPE_CHECKING:
    import torch

__all__ = ["load_model"]


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


def _weights_fingerprint(directory: Path) -> str:
    """sha256 over the weight files; remembered in kvmem's own (immutable) cache directories."""
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
    spec = check_config(config)
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
    ``device``: ``None`` (CUDA if available, else CPU), ``cpu``, ``cuda`` or ``cuda:N``
    (:func:`kvmem.devices.resolve_device`; under torchrun ``cuda`` is ``cuda:LOCAL_RANK``). The
    weights are moved there before the TransformerLens bridge is built.

    >>> model = load_model("smollm2-135m")  # doctest: +SKIP
    >>> model.n_layers, model.d_ff, model.gated
    (30, 1536, True)

    The garbage collector pauses while the model loads (:func:`kvmem.collector.collections_paused`).
    """
    with collections_paused():
        return _load_model(name_or_path, device=device, dtype=dtype, revision=revision)


def _load_model(name_or_path: str | os.PathLike, *, device: Any, dtype: Any, revision: str | None) -> Model:
    torch_dtype = _dtype(dtype)
    target = resolve_device(device)  # checked before any weight is read
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
    hf_model.to(device=target)  # before the bridge: TransformerLens keeps a pre-loaded model where it is
    if is_local:
        fingerprint = _weights_fingerprint(Path(source))
    else:
        fingerprint = "revision:" + str(getattr(hf_model.config, "_commit_hash", None) or revision or "unknown")
    return Model(hf_model, tokenizer, spec=spec, name=display, source=source, fingerprint=fingerprint,
                 revision=revision, dtype=torch_dtype)
