"""Load a causal LM for kvmem: built-in offline names, local HF directories and hub ids, in a dtype,
onto a device (moved there before the TransformerLens bridge is built), with a weights fingerprint."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvmem.architectures import check_config
from kvmem.builtin import BUILTIN_ALIASES, BUILTIN_MODELS, SMOLLM2, gpt2_random_dir, sha256_file, smollm2_dir
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
        config = AutoConfig.from_pretrained(source, revision=revision) if is_local else _hub_config(source, revision)
    except ValueError as error:
        raise KvmemError(f"cannot read the model config of {source}: {str(error).splitlines()[0]}") from None
    except OSError as error:
        text = str(error)
        if is_local:
            raise KvmemError(f"{source} is not an HF model directory (no readable config.json): {text.splitlines()[0]}") from None
        raise KvmemError(f"cannot load {source!r} from the model hub: {text.splitlines()[0]}") from None
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


KNOWN_HUB_IDS = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl", "distilgpt2", "HuggingFaceTB/SmolLM2-135M",
                 "HuggingFaceTB/SmolLM2-360M", "HuggingFaceTB/SmolLM2-1.7B", "meta-llama/Llama-3.1-8B",
                 "google/gemma-3-1b-pt", "Qwen/Qwen3-0.6B", "EleutherAI/pythia-160m", "allenai/OLMo-2-0425-1B")


def _did_you_mean(name: str) -> str:
    """`` (did you mean 'x'?)`` for the closest built-in name, alias or well-known hub id, or ''."""
    import difflib

    candidates = [c for c in (*BUILTIN_MODELS, *BUILTIN_ALIASES, *KNOWN_HUB_IDS) if c.lower() != name.lower()]
    close = difflib.get_close_matches(name, candidates, n=1, cutoff=0.75) or difflib.get_close_matches(
        name.lower(), [c.lower() for c in candidates], n=1, cutoff=0.75)
    if not close:
        return ""
    match = next(c for c in candidates if c.lower() == close[0].lower())
    return f" (did you mean {match!r}?)"


def _hub_config(source: str, revision: str | None):
    """The config of a hub model: from the local HF cache when it is there (no network); otherwise after one
    short request that tells an unknown name and an unreachable hub apart in seconds, with no retries."""
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(source, revision=revision, local_files_only=True)
    except (OSError, ValueError):
        pass
    builtins = ", ".join(BUILTIN_MODELS)
    if constants.HF_HUB_OFFLINE:
        raise KvmemError(f"model {source!r} is not a local directory, a built-in model or in the local HF cache, and "
                         f"the hub is switched off (HF_HUB_OFFLINE){_did_you_mean(source)}; pass a local HF "
                         f"directory or a built-in model ({builtins})")
    try:
        HfApi().model_info(source, revision=revision, timeout=3)
    except RepositoryNotFoundError:
        raise KvmemError(f"unknown model {source!r}: not a local directory, a built-in model or a model on the hub"
                         f"{_did_you_mean(source)}; built-in offline models are {builtins}") from None
    except RevisionNotFoundError:
        raise KvmemError(f"model {source!r} has no revision {revision!r} on the hub; check --revision") from None
    except Exception as error:  # a network error of the HTTP client: no hub in reach
        if "40" in str(getattr(getattr(error, "response", None), "status_code", "")):
            raise KvmemError(f"the hub refused {source!r} ({error.response.status_code}): it may be gated; log in "
                             f"with `hf auth login`, or pass a local HF directory") from None
        raise KvmemError(f"could not reach the model hub to load {source!r}{_did_you_mean(source)}; pass a local HF "
                         f"directory, or a built-in offline model ({builtins})") from None
    return AutoConfig.from_pretrained(source, revision=revision)


def load_model(name_or_path: str | os.PathLike, *, device: Any = None, dtype: Any = None,
               revision: str | None = None) -> Model:
    """Load a causal LM for kvmem.

    ``name_or_path``: a built-in offline name (``smollm2-135m-instruct-q4_1``, short ``smollm2-135m``;
    ``gpt2-random``: :data:`kvmem.builtin.BUILTIN_MODELS` says what each is), a local
    HF directory (config + weights + tokenizer), or a hub id (``gpt2``, ``gpt2-medium``, a
    Llama-family id, ...). ``dtype``: ``float32`` (default), ``bfloat16`` or ``float16``.
    ``device``: ``None`` (CUDA if available, else CPU), ``cpu``, ``cuda`` or ``cuda:N``
    (:func:`kvmem.devices.resolve_device`; under torchrun ``cuda`` is ``cuda:LOCAL_RANK``). The
    weights are moved there before the TransformerLens bridge is built.

    >>> model = load_model("smollm2-135m")  # doctest: +SKIP
    >>> model.n_layers, model.d_ff, model.gated
    (30, 1536, True)
    """
    torch_dtype = _dtype(dtype)
    target = resolve_device(device)  # checked before any weight is read
    name = str(name_or_path)
    path = Path(name).expanduser()
    name = BUILTIN_ALIASES.get(name, name)
    if name == SMOLLM2:
        source, display, is_local = str(smollm2_dir()), SMOLLM2, True
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
                 revision=revision, dtype=torch_dtype, description=BUILTIN_MODELS.get(display))
