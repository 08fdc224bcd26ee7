"""FFN anatomy: the seeds' figures, and counts of real parameters beside the formula."""

from __future__ import annotations

import ast
from pathlib import Path

import pandas as pd
import pytest

import kvmem
import kvmem.anatomy
from kvmem.anatomy import attention_params, ffn_flops_per_token, ffn_params, ffn_share, hidden_activation_memory


def test_seed_figures():
    assert ffn_params(768) == 8 * 768**2 + 5 * 768 == 4_722_432
    assert ffn_params(512) == 2_099_712
    assert attention_params(768, qkv_bias=False) == 4 * 768**2 + 768 == 2_360_064
    assert attention_params(768) == 4 * 768**2 + 4 * 768  # GPT-2's real attention has Q, K, V biases too
    assert round(ffn_share(ffn_params(768), attention_params(768, qkv_bias=False)), 3) == 0.667
    assert ffn_flops_per_token(768) == 16 * 768**2
    memory = hidden_activation_memory(8, 1024, 4 * 768)
    assert memory.entries == 25_165_824 and round(memory.entries / 1e6, 1) == 25.2
    assert memory.bytes == 100_663_296 and round(memory.megabytes) == 101  # "100 MB" in float32


def test_gated_counts():
    assert ffn_params(576, 1536, gated=True, bias=False) == 3 * 576 * 1536 == 2_654_208
    assert ffn_params(4096, 11008, gated=True, bias=False) == 3 * 4096 * 11008
    assert ffn_params(10, 20, gated=True, bias=True) == 3 * 10 * 20 + 2 * 20 + 10
    assert ffn_flops_per_token(576, 1536, gated=True) == 6 * 576 * 1536
    # d_ff ≈ 8d/3 keeps a gated FFN at 8d² parameters
    assert ffn_params(768, 2048, gated=True, bias=False) == 8 * 768**2
    assert attention_params(576, d_kv=192, qkv_bias=False, out_bias=False) == 2 * 576 * 576 + 2 * 576 * 192


@pytest.mark.parametrize("bad", [0, -3, 2.5])
def test_bad_sizes(bad):
    with pytest.raises(kvmem.KvmemError, match="must be a positive integer"):
        ffn_params(bad)


def test_model_anatomy_counts_real_parameters(tiny_model):
    table = tiny_model.anatomy()
    assert list(table.layer) == list(range(tiny_model.n_layers))
    assert (table.ffn_params == table.ffn_formula).all()
    # the sum of the real FFN parameters' sizes
    expected = sum(tiny_model.keys(i).numel() + tiny_model.values(i).numel()
                   + sum(t.numel() for t in (tiny_model.gate_keys(i), tiny_model.key_bias(i), tiny_model.value_bias(i),
                                             tiny_model.gate_bias(i)) if t is not None)
                   for i in range(tiny_model.n_layers))
    assert table.ffn_params.sum() == expected
    if tiny_model.gated:  # tiny Llama: 3·64·96, no biases; attention with grouped KV (2 of 4 heads)
        assert table.ffn_params.iloc[0] == 3 * 64 * 96
        assert table.attention_params.iloc[0] == attention_params(64, d_kv=32, qkv_bias=False, out_bias=False)
    else:
        assert table.ffn_params.iloc[0] == ffn_params(64) and table.attention_params.iloc[0] == attention_params(64)
    # both spellings of the public API give the same table
    pd.testing.assert_frame_equal(kvmem.anatomy.model_anatomy(tiny_model), table)


def test_anatomy_sits_below_models():
    """models.py imports anatomy (Model.anatomy()); anatomy imports nothing of models, not even for typing."""
    tree = ast.parse(Path(kvmem.anatomy.__file__).read_text())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    assert not any(name and name.startswith("kvmem.models") for name in imported), imported


def test_anatomy_cli(gpt2_dir, capsys):
    from kvmem.cli import main

    assert main(["anatomy", str(gpt2_dir)]) == 0
    out = capsys.readouterr().out
    assert " 33088 " in out and "formula matches every layer: True" in out
