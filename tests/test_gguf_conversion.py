"""kvmem.gguf_conversion against transformers' own GGUF loading: the built-in SmolLM2's converted
checkpoint holds the same tensors, bit for bit, the same config and the same tokenizer as
``AutoModelForCausalLM.from_pretrained(..., gguf_file=...)`` and ``AutoTokenizer`` of the same file.
Files transformers writes for the two are compared byte for byte."""

from __future__ import annotations

import filecmp
import struct

import numpy as np
import pytest
import torch

import kvmem
from kvmem.builtin import SMOLLM2_INSTALL, SMOLLM2_PACKAGE, _package_dir

pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def gguf_file():
    try:
        package = _package_dir(SMOLLM2_PACKAGE, SMOLLM2_INSTALL)
    except kvmem.KvmemError as error:
        pytest.fail(str(error))
    return package, sorted(package.glob("*.gguf"))[0]


def test_the_builtin_conversion_equals_transformers_gguf_loading(gguf_file, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvmem.builtin import smollm2_dir

    monkeypatch.setenv("KVMEM_CACHE", str(tmp_path / "cache"))
    converted = smollm2_dir()  # converted here, into an empty cache

    package, path = gguf_file
    reference = AutoModelForCausalLM.from_pretrained(package, gguf_file=path.name, dtype=torch.float32)
    ours = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32)
    theirs, mine = reference.state_dict(), ours.state_dict()
    assert sorted(theirs) == sorted(mine)
    for name, tensor in theirs.items():
        assert mine[name].dtype == tensor.dtype == torch.float32, name
        assert torch.equal(mine[name].view(torch.int32), tensor.view(torch.int32)), name
    config, expected = ours.config.to_dict(), reference.config.to_dict()
    assert config["architectures"] == ["LlamaForCausalLM"]  # set by save_pretrained, None on the reference
    for volatile in ("_name_or_path", "quantization_config", "transformers_version", "architectures"):
        config.pop(volatile, None)
        expected.pop(volatile, None)
    assert config == expected

    reference.config.__dict__.pop("quantization_config", None)
    (tmp_path / "reference").mkdir()
    reference.generation_config.save_pretrained(tmp_path / "reference")
    AutoTokenizer.from_pretrained(package, gguf_file=path.name).save_pretrained(tmp_path / "reference")
    # the weights file is the one HF's save_pretrained writes for the same tensors (kvmem writes it without
    # building a model): the same bytes, so the same weights fingerprint whichever wrote it
    ours.save_pretrained(tmp_path / "resaved")
    assert filecmp.cmp(converted / "model.safetensors", tmp_path / "resaved" / "model.safetensors", shallow=False)
    assert filecmp.cmp(converted / "config.json", tmp_path / "resaved" / "config.json", shallow=False)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        assert filecmp.cmp(converted / name, tmp_path / "reference" / name, shallow=False), name


def test_rotary_rows_are_transformers_reverse_permutation():
    """The query/key row order against transformers' own reverse permutation, for grouped heads."""
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    from kvmem.gguf_conversion import _rotary_rows

    rows = np.random.default_rng(0).standard_normal((4 * 2 * 8, 6)).astype(np.float32)
    processor = LlamaTensorProcessor(config={"num_attention_heads": 8, "num_key_value_heads": 2})
    for name, heads in (("blk.0.attn_q.weight", 8), ("blk.0.attn_k.weight", 2)):
        expected = processor.process(weights=rows[: heads * 8], name=name).weights
        assert np.array_equal(_rotary_rows(torch.from_numpy(rows[: heads * 8]), heads).numpy(), expected)


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0", "F16", "Q5_0"])
def test_dequantisation_is_the_gguf_package_s_bit_for_bit(kind):
    """Blocks of random bytes (every scale and weight bit pattern, NaN and infinite scales included)
    against gguf.quants.dequantize: the same float32 bits. Q4_1 and Q8_0 run in torch; the others
    (here F16, Q5_0) are handed to the gguf package."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    from kvmem.gguf_conversion import Tensor, dequantize

    kind = GGMLQuantizationType[kind]
    block, size = GGML_QUANT_SIZES[kind]
    shape = (6, 4 * block)  # 24 blocks
    raw = np.random.default_rng(int(kind)).integers(0, 256, (6, 4 * size), dtype=np.uint8)
    if kind == GGMLQuantizationType.Q4_1:  # one scale and one minimum NaN, one scale infinite
        raw[0, 0:2] = np.array([np.nan], np.float16).view(np.uint8)
        raw[1, 2:4] = np.array([np.nan], np.float16).view(np.uint8)
        raw[2, 0:2] = np.array([np.inf], np.float16).view(np.uint8)
    raw.flags.writeable = False  # as the file's memory map
    ours = dequantize(Tensor("t", shape, int(kind), raw))
    with np.errstate(invalid="ignore", over="ignore"):  # inf * 0 in the reference
        expected = np.ascontiguousarray(gguf_dequantize(raw, kind).reshape(shape), dtype=np.float32)
    assert ours.dtype == torch.float32 and tuple(ours.shape) == shape
    assert np.array_equal(ours.numpy().view(np.int32), expected.view(np.int32))


def test_files_kvmem_cannot_convert_get_one_line_errors(tmp_path):
    from gguf import GGUFWriter

    from kvmem.gguf_conversion import llama_config, llama_state_dict, read_gguf

    text = tmp_path / "notes.gguf"
    text.write_text("these are not weights")
    with pytest.raises(kvmem.KvmemError, match="is not a GGUF file"):
        read_gguf(text)

    old = tmp_path / "old.gguf"
    old.write_bytes(b"GGUF" + struct.pack("<IQQ", 1, 0, 0))
    with pytest.raises(kvmem.KvmemError, match="version 1; kvmem reads versions 2 and 3"):
        read_gguf(old)

    def written(name: str, architecture: str, tensors: dict) -> object:
        writer = GGUFWriter(tmp_path / name, architecture)
        writer.add_block_count(1)
        writer.add_head_count(2)
        writer.add_head_count_kv(1)
        for tensor, values in tensors.items():
            writer.add_tensor(tensor, values)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        return read_gguf(tmp_path / name)

    weights = np.arange(8 * 4, dtype=np.float32).reshape(8, 4)
    with pytest.raises(kvmem.KvmemError, match="Llama GGUF files only; this one is 'gpt2'"):
        llama_config(written("gpt2.gguf", "gpt2", {"token_embd.weight": weights}))
    strange = written("strange.gguf", "llama", {"blk.0.attn_qkv.weight": weights})
    with pytest.raises(kvmem.KvmemError, match="'blk.0.attn_qkv.weight' has no place in a Llama checkpoint"):
        llama_state_dict(strange, llama_config(strange))
    plain = written("plain.gguf", "llama", {"token_embd.weight": weights, "output.weight": weights})
    assert llama_config(plain)["tie_word_embeddings"] is False
    state = llama_state_dict(plain, llama_config(plain))
    assert torch.equal(state["lm_head.weight"], torch.from_numpy(weights))
