"""A Llama GGUF file as a float32 transformers checkpoint, read in one pass.

The built-in ``smollm2-135m`` ships as a 4-bit GGUF file (:mod:`kvmem.builtin`). transformers can load
it (``from_pretrained(..., gguf_file=...)``), but it parses the file's metadata three times (tokenizer,
config, weights) and builds a tensor-name table for every architecture llama.cpp knows: about 17 s on
2 cores, most of a newcomer's first command. This module reads the header once (the vocabulary's
100,000 strings walked with :mod:`struct`), dequantises each tensor (the file's block formats, Q4_1 and
Q8_0, in torch on all cores; any other with the ``gguf`` package's own :func:`gguf.quants.dequantize`),
names the tensors by the Llama layout and undoes llama.cpp's
rotary row order in the query and key weights. The config comes from the same metadata through
transformers' own GGUF key table. ``tests/test_gguf_conversion.py`` holds the result to
transformers' loading of the same file, tensor by tensor, bit for bit.

The GGUF layout (version 2 and 3): magic ``GGUF``, version (u32), tensor count and key count (u64),
the keys (string, value type, value), the tensor table (name, dimensions fastest first, ggml type,
offset), then the tensor data from the next multiple of ``general.alignment`` (default 32).
"""

from __future__ import annotations

import mmap
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvmem.errors import KvmemError

__all__ = ["GgufFile", "read_gguf", "llama_config", "llama_state_dict", "dequantize"]

# fixed-width value types -> struct format (8: string, 9: array)
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_FLOAT_TYPES = (6, 12)


@dataclass(frozen=True)
class Tensor:
    name: str
    shape: tuple[int, ...]  # numpy order (slowest first)
    ggml_type: int
    data: np.ndarray  # the stored bytes, uint8


@dataclass(frozen=True)
class GgufFile:
    metadata: dict
    tensors: dict[str, Tensor]


def _string(buffer, at: int) -> tuple[str, int]:
    (length,) = struct.unpack_from("<Q", buffer, at)
    at += 8
    return bytes(buffer[at:at + length]).decode("utf-8"), at + length


def _value(buffer, at: int, kind: int):
    if kind in _SCALAR:
        fmt = _SCALAR[kind]
        (value,) = struct.unpack_from(fmt, buffer, at)
        return value, at + struct.calcsize(fmt)
    if kind == 8:
        return _string(buffer, at)
    if kind == 9:
        item, count = struct.unpack_from("<IQ", buffer, at)
        at += 12
        if item in _SCALAR:
            fmt = _SCALAR[item]
            values = list(struct.unpack_from(f"<{count}{fmt[1]}", buffer, at))
            return values, at + count * struct.calcsize(fmt)
        values = []
        for _ in range(count):
            value, at = _value(buffer, at, item)
            values.append(value)
        return values, at
    raise KvmemError(f"GGUF metadata value of unknown type {kind}; the file may be damaged")


def read_gguf(path: str | Path) -> GgufFile:
    """The metadata and tensors (their stored bytes, memory-mapped) of a GGUF file."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    with open(path, "rb") as handle:
        buffer = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
    if buffer[:4] != b"GGUF":
        raise KvmemError(f"{path} is not a GGUF file (it does not start with 'GGUF')")
    version, tensor_count, key_count = struct.unpack_from("<IQQ", buffer, 4)
    if version not in (2, 3):
        raise KvmemError(f"{path} is GGUF version {version}; kvmem reads versions 2 and 3")
    at = 24
    metadata = {}
    for _ in range(key_count):
        key, at = _string(buffer, at)
        (kind,) = struct.unpack_from("<I", buffer, at)
        metadata[key], at = _value(buffer, at + 4, kind)
    table = []
    for _ in range(tensor_count):
        name, at = _string(buffer, at)
        (dims,) = struct.unpack_from("<I", buffer, at)
        shape = struct.unpack_from(f"<{dims}Q", buffer, at + 4)
        kind, offset = struct.unpack_from("<IQ", buffer, at + 4 + 8 * dims)
        at += 4 + 8 * dims + 12
        table.append((name, tuple(reversed(shape)), kind, offset))
    alignment = metadata.get("general.alignment", 32)
    start = -(-at // alignment) * alignment
    data = np.frombuffer(buffer, dtype=np.uint8)
    tensors = {}
    for name, shape, kind, offset in table:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
        stored = (*shape[:-1], shape[-1] // block * size)
        nbytes = int(np.prod(stored))
        tensors[name] = Tensor(name, shape, kind, data[start + offset:start + offset + nbytes].reshape(stored))
    return GgufFile(metadata, tensors)


def llama_config(gguf: GgufFile) -> dict:
    """The transformers config dict of a Llama GGUF file: its metadata renamed by transformers' own
    table of GGUF keys (``GGUF_TO_TRANSFORMERS_MAPPING``), the embeddings tied when the file has no
    ``output.weight``, and the vocabulary's size from its tokens where the metadata does not say."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_TO_TRANSFORMERS_MAPPING

    architecture = gguf.metadata.get("general.architecture")
    if architecture != "llama":
        raise KvmemError(f"kvmem converts Llama GGUF files only; this one is {architecture!r}")
    renames = GGUF_TO_TRANSFORMERS_MAPPING["config"]
    config = {"tie_word_embeddings": "output.weight" not in gguf.tensors}
    for key, value in gguf.metadata.items():
        prefix, _, rest = key.partition(".")
        name = renames.get(prefix, {}).get(rest)
        if name is None or name == -1:
            continue
        if isinstance(value, list) and len(value) == 1:
            value = value[0]
        config[name] = value
    if "vocab_size" not in config and "tokenizer.ggml.tokens" in gguf.metadata:
        config["vocab_size"] = len(gguf.metadata["tokenizer.ggml.tokens"])
    return config


# GGUF tensor name -> transformers' Llama parameter name
_LAYER = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
          "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
          "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")


def _hf_name(name: str) -> str:
    if match := _BLOCK.match(name):
        layer, part, kind = match.groups()
        if part in _LAYER:
            return f"model.layers.{layer}.{_LAYER[part]}.{kind}"
    else:
        part, _, kind = name.rpartition(".")
        if part in _TOP:
            return f"{_TOP[part]}.{kind}"
    raise KvmemError(f"GGUF tensor {name!r} has no place in a Llama checkpoint; kvmem cannot convert this file")


def _rotary_rows(weights, heads: int):
    """llama.cpp stores each head's query (key) rows with the two rotary halves interleaved; transformers
    wants them as halves: rows (head, pair, 2) -> (head, 2, pair)."""
    pair = weights.shape[0] // heads // 2
    return weights.reshape(heads, pair, 2, *weights.shape[1:]).transpose(1, 2).reshape(weights.shape)


def dequantize(tensor: Tensor):
    """A GGUF tensor as float32 torch [shape], the same bits as :func:`gguf.quants.dequantize`.

    Q4_1 blocks are (scale d: f16, minimum m: f16, 16 bytes of 4-bit q: the low nibbles are weights
    0-15, the high ones 16-31), each weight ``d * q + m``; Q8_0 blocks are (d: f16, 32 int8 q), each
    weight ``d * q``. Both are computed in float32, a product then a sum (never fused), as the
    ``gguf`` package computes them; other formats go to that package."""
    import torch
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    kind = GGMLQuantizationType(tensor.ggml_type)
    if kind in (GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0):
        per_block = GGML_QUANT_SIZES[kind][1]  # bytes of a block of 32 weights
        blocks = torch.from_numpy(tensor.data.reshape(-1, per_block).copy())  # the file's view is read-only
        scale = blocks[:, :2].contiguous().view(torch.float16).float()  # [blocks, 1]
        if kind == GGMLQuantizationType.Q8_0:
            weights = blocks[:, 2:].contiguous().view(torch.int8).float().mul_(scale)
        else:
            minimum = blocks[:, 2:4].contiguous().view(torch.float16).float()
            nibbles = blocks[:, 4:]
            low = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=1).float()  # [blocks, 32] in weight order
            weights = low.mul_(scale).add_(minimum)
        return weights.view(tensor.shape)
    from gguf.quants import dequantize as gguf_dequantize

    weights = gguf_dequantize(tensor.data, kind).reshape(tensor.shape)
    return torch.from_numpy(np.array(weights, dtype=np.float32))  # a copy: the file's view is read-only


def llama_state_dict(gguf: GgufFile, config: dict):
    """{transformers name: float32 tensor} of every tensor in the file, dequantised."""
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    state = {}
    for name, tensor in gguf.tensors.items():
        weights = dequantize(tensor)
        if ".attn_q." in name:
            weights = _rotary_rows(weights, heads)
        elif ".attn_k." in name:
            weights = _rotary_rows(weights, kv_heads)
        state[_hf_name(name)] = weights.contiguous()
    return state
