"""The neuron taxonomy: weight statistics against numpy on the HF weights, atlas columns against brute force
over the atlas tables and a plain HF forward, planted neurons, the table's schema, CLI, plot and report."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import SHORT_DOCS

import kvmem
from kvmem.cli import main
from kvmem.errors import KvmemError
from kvmem.scanning.bins import MAGNITUDE_EDGES
from kvmem.taxonomy import COLUMNS, PENDING, Thresholds, build_taxonomy, read_taxonomy, write_taxonomy
from kvmem.taxonomy.exact_columns import NOT_KEPT
from kvmem.taxonomy.table import arrow_schema, read_taxonomy_metadata
from kvmem.taxonomy.weights import vocab_moments


# ---- the oracle: HF module weights read directly, statistics in numpy float64 ----
def _hf_parts(hf_model, layer: int) -> dict:
    """keys, gates, values [d_ff, d_model] and W_U [d_model, vocab] from the HF modules (float64 numpy)."""
    if hasattr(hf_model, "transformer"):  # GPT-2: Conv1D weights are [in, out]
        mlp = hf_model.transformer.h[layer].mlp
        keys, gates, values = mlp.c_fc.weight.T, None, mlp.c_proj.weight
    else:  # Llama
        mlp = hf_model.model.layers[layer].mlp
        keys, gates, values = mlp.up_proj.weight, mlp.gate_proj.weight, mlp.down_proj.weight.T
    as_np = lambda t: None if t is None else t.detach().double().numpy()  # noqa: E731
    return {"keys": as_np(keys), "gates": as_np(gates), "values": as_np(values),
            "w_u": as_np(hf_model.lm_head.weight.T)}


def _numpy_stats(parts: dict, k: int) -> dict:
    v, w_u = parts["values"], parts["w_u"]
    cos = (v / np.linalg.norm(v, axis=1, keepdims=True)) @ (w_u / np.linalg.norm(w_u, axis=0, keepdims=True))
    centred = cos - cos.mean(axis=1, keepdims=True)
    m2, m3, m4 = ((centred ** p).mean(axis=1) for p in (2, 3, 4))
    u, _, _ = np.linalg.svd(w_u, full_matrices=False)  # singular values descending
    null = u[:, -k:]

    def row_cos(a, b):
        return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))

    out = {"key_norm": np.linalg.norm(parts["keys"], axis=1), "value_norm": np.linalg.norm(v, axis=1),
           "cos_key_value": row_cos(parts["keys"], v),
           "vocab_mean": cos.mean(axis=1), "vocab_std": np.sqrt(m2), "vocab_skew": m3 / m2 ** 1.5,
           "vocab_kurtosis": m4 / m2 ** 2 - 3,
           "null_space_fraction": ((v @ null) ** 2).sum(1) / (v ** 2).sum(1)}
    if parts["gates"] is not None:
        out["gate_norm"] = np.linalg.norm(parts["gates"], axis=1)
        out["cos_gate_value"] = row_cos(parts["gates"], v)
    return out


def test_weight_statistics_match_numpy_on_hf_weights(tiny_model):
    assert Thresholds().null_space_dim(tiny_model.d_model) == 1  # the default: round(0.01 * 64)
    thresholds = Thresholds(null_space_fraction_of_d_model=0.1)
    k = thresholds.null_space_dim(tiny_model.d_model)
    assert k == 6
    frame, metadata = build_taxonomy(tiny_model, thresholds=thresholds, block=37)  # a block that does not divide d_ff
    assert len(frame) == tiny_model.n_layers * tiny_model.d_ff and metadata["null_space_dim"] == k
    for layer in range(tiny_model.n_layers):
        expected = _numpy_stats(_hf_parts(tiny_model.hf_model, layer), k)
        got = frame[frame.layer == layer].sort_values("neuron")
        for column, values in expected.items():
            np.testing.assert_allclose(got[column].to_numpy(np.float64), values, rtol=2e-4, atol=2e-5,
                                       err_msg=f"layer {layer} {column}")
        if not tiny_model.gated:
            assert got.gate_norm.isna().all() and got.cos_gate_value.isna().all()
        flags = got.vocab_kurtosis.to_numpy() > thresholds.kurtosis
        assert (got.prediction.to_numpy() == (flags & (expected["vocab_skew"] > 0))).all()
        assert (got.suppression.to_numpy() == (flags & (expected["vocab_skew"] < 0))).all()


def test_vocab_moments_match_numpy_in_any_block_size():
    generator = torch.Generator().manual_seed(3)
    values = torch.randn(50, 16, generator=generator)
    values[7] = 0  # a zero vector: NaN statistics
    w_u = torch.randn(16, 300, generator=generator)
    unit = w_u / w_u.norm(dim=0, keepdim=True)
    full = vocab_moments(values, unit, block=1000)
    for block in (1, 7, 50):
        got = vocab_moments(values, unit, block=block)
        for name in full:
            np.testing.assert_array_equal(np.isnan(got[name]), np.isnan(full[name]))
            np.testing.assert_allclose(got[name], full[name], rtol=1e-5, atol=1e-7, equal_nan=True)
    assert np.isnan(full["kurtosis"][7])



def test_vocab_moments_of_a_row_do_not_depend_on_the_rows_taken_with_it(monkeypatch):
    """The float64 moments taken 16 rows at a time (a lone last row joined to the group before), 2 at a time or all
    at once: the same bits, since torch sums each row of a several-row reduction whole."""
    from kvmem.taxonomy import weights

    assert weights._row_groups(33, 16) == [(0, 16), (16, 33)] and weights._row_groups(1, 16) == [(0, 1)]
    generator = torch.Generator().manual_seed(4)
    values = torch.randn(33, 16, generator=generator)
    w_u = torch.randn(16, 40_000, generator=generator)  # rows long enough for torch to split a lone one over threads
    unit = w_u / w_u.norm(dim=0, keepdim=True)
    results = []
    for rows in (16, 2, 1000):
        monkeypatch.setattr(weights, "MOMENT_ROWS", rows)
        results.append(vocab_moments(values, unit, block=33))
    for got in results[1:]:
        for name in got:
            np.testing.assert_array_equal(got[name], results[0][name])

# ---- planted neurons: a small vocabulary so one token's column stands out (excess kurtosis ≈ d_model²/vocab) ----
@pytest.fixture(scope="module", params=["gpt2", "llama"])
def planted(request, tmp_path_factory):
    """A tiny model (d_model 128, vocab 256) whose layer-1 values 0, 1, 2 are W_U[:, 5], −W_U[:, 5] and
    3 × W_U's smallest left singular vector; the HF weights are edited, then loaded through kvmem."""
    from transformers import GPT2Config, GPT2LMHeadModel, GPT2TokenizerFast, LlamaConfig, LlamaForCausalLM

    from kvmem.builtin import gpt2_tokenizer_dir

    tokenizer = GPT2TokenizerFast.from_pretrained(gpt2_tokenizer_dir())
    torch.manual_seed(5)
    if request.param == "gpt2":
        model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_embd=128, n_layer=2, n_head=4, n_positions=64,
                                           bos_token_id=0, eos_token_id=0))
    else:
        model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=96,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                             max_position_embeddings=64, bos_token_id=0, eos_token_id=0))
    w_u = model.lm_head.weight.detach().T  # [d_model, vocab]
    smallest = torch.linalg.svd(w_u.double(), full_matrices=False)[0][:, -1].float()
    planted_values = torch.stack([w_u[:, 5], -w_u[:, 5], 3 * smallest])  # [3, d_model]
    with torch.no_grad():
        if request.param == "gpt2":
            model.transformer.h[1].mlp.c_proj.weight[:3] = planted_values
        else:
            model.model.layers[1].mlp.down_proj.weight[:, :3] = planted_values.T
    path = tmp_path_factory.mktemp(f"planted-{request.param}")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    loaded = kvmem.load_model(path, device="cpu")
    assert (loaded.d_model, loaded.vocab_size) == (128, 256)
    return loaded


def test_planted_prediction_suppression_and_null_space_neurons(planted):
    frame, _ = build_taxonomy(planted)
    layer = frame[frame.layer == 1].set_index("neuron")
    others = layer.drop(index=[0, 1, 2])
    column, negated, null = layer.loc[0], layer.loc[1], layer.loc[2]
    assert column.vocab_kurtosis > Thresholds().kurtosis > others.vocab_kurtosis.max()
    assert column.vocab_skew > 2 and column.prediction and not column.suppression
    assert negated.vocab_skew < -2 and negated.suppression and not negated.prediction
    assert negated.vocab_kurtosis == pytest.approx(column.vocab_kurtosis, rel=1e-5)
    assert null.null_space_fraction == pytest.approx(1.0, abs=1e-5)
    k = Thresholds().null_space_dim(128)
    assert others.null_space_fraction.mean() == pytest.approx(k / 128, rel=0.5)  # a random direction: k / d_model
    assert not others.prediction.any() and not others.suppression.any()


# ---- atlas columns ----
@pytest.fixture(scope="module")
def llama_atlas(llama_model, tmp_path_factory):
    return kvmem.scan(llama_model, SHORT_DOCS, out=tmp_path_factory.mktemp("taxonomy") / "atlas", window=16,
                      top_k=6, top_n=30, progress=False, context_activations=False)


def _hf_coefficients(model, atlas) -> dict[int, np.ndarray]:
    """Every scored coefficient [positions, d_ff] per layer, from a plain HF forward per window with a
    forward pre-hook on down_proj, on the windows of the plan's rule (tokenized alone, BOS first, the first
    ``skip_first`` tokens of a window read but not scored)."""
    plan = atlas.manifest.plan
    captured: dict[int, list] = {layer: [] for layer in atlas.layers}
    handles = [model.hf_model.model.layers[layer].mlp.down_proj.register_forward_pre_hook(
        lambda module, args, layer=layer: captured[layer].append(args[0][0].detach().clone()))
        for layer in atlas.layers]
    try:
        for text in SHORT_DOCS:
            ids = model.tokenizer(text, add_special_tokens=False)["input_ids"]
            for start in range(0, len(ids), plan.window):
                window = ([plan.bos_token_id] if plan.bos_token_id is not None else []) + ids[start:start + plan.window]
                with torch.no_grad():
                    model.hf_model(torch.tensor([window]))
                for layer in atlas.layers:  # drop BOS and the window's unscored first tokens (the plan's rule)
                    captured[layer][-1] = captured[layer][-1][plan.offset + plan.skip_first:]
    finally:
        for handle in handles:
            handle.remove()
    return {layer: torch.cat(parts).float().numpy() for layer, parts in captured.items()}


def test_activation_frequencies_equal_a_plain_hf_forward(llama_model, llama_atlas):
    thresholds = Thresholds(weak_edge=2.0 ** -7, active_edge=1.5 * 2.0 ** -7, strong_edge=2.0 ** -6)
    frame, _ = build_taxonomy(llama_model, atlas=llama_atlas, thresholds=thresholds)
    coefficients = _hf_coefficients(llama_model, llama_atlas)
    for layer, m in coefficients.items():
        assert m.shape[0] == llama_atlas.manifest.tokens
        got = frame[frame.layer == layer].sort_values("neuron")
        n = m.shape[0]
        for column, edge in (("freq_weak", thresholds.weak_edge), ("freq_active", thresholds.active_edge),
                             ("freq_strong", thresholds.strong_edge)):
            np.testing.assert_array_equal(np.round(got[column].to_numpy() * n).astype(int),
                                          (np.abs(m) >= edge).sum(0), err_msg=f"layer {layer} {column}")
            assert 0 < (np.abs(m) >= edge).mean() < 1  # the thresholds split this tiny model's coefficients
        np.testing.assert_array_equal(np.round(got.freq_positive_active.to_numpy() * n).astype(int),
                                      (m >= thresholds.active_edge).sum(0))
        np.testing.assert_allclose(got.frac_positive.to_numpy(), (m > 0).mean(0))
        np.testing.assert_allclose(got.max_abs.to_numpy(), np.abs(m).max(0), rtol=1e-5)
        dead = (np.abs(m) < thresholds.weak_edge).all(0)
        np.testing.assert_array_equal(got.dead.to_numpy(), dead)
        active = (np.abs(m) >= thresholds.active_edge).mean(0)
        np.testing.assert_array_equal(got.rare.to_numpy(), ~dead & (active < thresholds.rare_frequency))


def _brute_force_detector_and_self_suppression(frame, triggers, values, convention):
    kept = 0
    for row in frame.itertuples():
        top = triggers[(triggers.layer == row.layer) & (triggers.neuron == row.neuron) & (triggers.kind == "top")]
        mass: dict[int, float] = {}
        for trigger in top.itertuples():
            mass[trigger.token_id] = mass.get(trigger.token_id, 0.0) + max(float(trigger.activation), 0.0)
        total = sum(mass.values())
        assert row.detector_triggers == len(top)
        if total > 0:
            best = max(mass.values())
            assert row.detector_score == pytest.approx(best / total, rel=1e-9)
            assert row.detector_token_id == min(t for t, v in mass.items() if v == best)
        else:
            assert np.isnan(row.detector_score) and row.detector_token_id == -1
        first = top[top["rank"] == 0].token_id.iloc[0]
        suppressed = values[(values.layer == row.layer) & (values.neuron == row.neuron)
                            & (values.convention == convention) & (values.kind == "suppress")]
        ranks = dict(zip(suppressed.token_id, suppressed["rank"]))
        assert row.top_trigger_token_id == first
        assert row.self_suppression_rank == ranks.get(first, NOT_KEPT)
        kept += row.self_suppression_rank >= 0
    return kept


def test_detector_and_self_suppression_equal_brute_force_over_the_tables(llama_model, llama_atlas):
    frame, metadata = build_taxonomy(llama_model, atlas=llama_atlas, convention="final_norm")
    assert metadata["self_suppression_convention"]["name"] == "final_norm"
    triggers, values = llama_atlas.table("triggers"), llama_atlas.table("values")
    _brute_force_detector_and_self_suppression(frame, triggers, values, "final_norm")
    # a random-init value rarely lists its top trigger's token among 30 of 50,257: plant it in a copy of the
    # values table (neuron n gets the token at suppressed rank n % 30) so the kept branch is checked too
    from kvmem.taxonomy.exact_columns import self_suppression

    firsts = triggers[(triggers.kind == "top") & (triggers["rank"] == 0)].set_index(["layer", "neuron"]).token_id
    edited = values.copy()
    target = ((edited.convention == "final_norm") & (edited.kind == "suppress")
              & (edited["rank"] == edited.neuron % 30)).to_numpy()
    edited.loc[target, "token_id"] = [firsts[(lay, n)] for lay, n in zip(edited.layer[target], edited.neuron[target])]
    planted_ranks = self_suppression(triggers, edited, "final_norm")
    merged = frame.drop(columns=["self_suppression_rank"]).merge(planted_ranks, on=["layer", "neuron",
                                                                                   "top_trigger_token_id"])
    assert _brute_force_detector_and_self_suppression(merged, triggers, edited, "final_norm") == len(frame)
    assert (merged.self_suppression_rank == merged.neuron % 30).all()


def test_a_lazy_atlas_projects_only_the_one_conventions_values_layer_by_layer(llama_model, tmp_path, monkeypatch):
    """Self-suppression on an atlas without projection tables, from an empty per-model cache: each layer's values
    under the one convention are computed and kept (no whole tables of every convention, no keys), and the
    suppressed tokens and ranks equal numpy's bottom top_n of the final_norm scores."""
    from projection_oracle import top_bottom

    from kvmem.taxonomy.exact_columns import suppressed_values

    cache = tmp_path / "cache"
    monkeypatch.setenv("KVMEM_CACHE", str(cache))
    atlas = kvmem.scan(llama_model, SHORT_DOCS, out=tmp_path / "atlas", window=16, top_k=6, top_n=30, progress=False,
                       context_activations=False)
    assert not atlas.holds("values") and not (cache / "projections").exists()
    frame, _ = build_taxonomy(llama_model, atlas=atlas, convention="final_norm")
    kept = sorted(path.name for path in (cache / "projections" / "layers").iterdir())
    assert len(kept) == len(atlas.layers) and all(name.endswith("-values-final_norm") for name in kept)
    assert [path.name for path in (cache / "projections").iterdir()] == ["layers"]
    suppressed = suppressed_values(atlas, "final_norm")
    triggers = atlas.table("triggers")
    firsts = triggers[(triggers.kind == "top") & (triggers["rank"] == 0)].set_index(["layer", "neuron"]).token_id
    gain = llama_model.hf_model.model.norm.weight.detach().numpy()  # RMSNorm: final_norm is v * gain
    for layer in atlas.layers:
        parts = _hf_parts(llama_model.hf_model, layer)
        vectors = parts["values"].astype(np.float32) * gain  # one float32 product, as the convention rounds it
        bottom = top_bottom(vectors, parts["w_u"].astype(np.float32), 30)["bottom_ids"]
        here = suppressed[suppressed.layer == layer].sort_values(["neuron", "rank"])
        np.testing.assert_array_equal(here.token_id.to_numpy().reshape(atlas.d_ff, 30), bottom)
        got = frame[frame.layer == layer].set_index("neuron").self_suppression_rank
        for neuron in range(atlas.d_ff):
            ids = bottom[neuron].tolist()
            first = int(firsts[(layer, neuron)])
            assert got[neuron] == (ids.index(first) if first in ids else NOT_KEPT)


def test_unknown_convention_and_thresholds_off_the_bin_edges_are_refused(llama_model, llama_atlas):
    with pytest.raises(KvmemError, match="not in this atlas's values table"):
        build_taxonomy(llama_model, atlas=llama_atlas, convention="nope")
    with pytest.raises(KvmemError, match="not a histogram edge"):
        Thresholds(active_edge=0.3)
    with pytest.raises(KvmemError, match="lie in"):
        Thresholds(rare_frequency=2.0)
    with pytest.raises(KvmemError, match="lie in"):
        Thresholds(unigram_alignment=1.5)
    with pytest.raises(KvmemError, match="unigram_min_count must be an integer >= 1"):
        Thresholds(unigram_min_count=0)
    assert Thresholds(active_edge=MAGNITUDE_EDGES[3]).active_edge == 1.5 * 2.0 ** -6


# ---- the table on disk ----
def test_schema_file_and_sidecar(llama_model, llama_atlas, tmp_path):
    frame, metadata = build_taxonomy(llama_model, atlas=llama_atlas)
    path = write_taxonomy(frame, metadata, tmp_path / "t.parquet")
    import pyarrow.parquet as pq

    schema = pq.read_schema(path)
    assert schema.names == list(COLUMNS)
    assert [str(f.type) for f in schema] == [str(f.type) for f in arrow_schema()]
    back = read_taxonomy(path)
    pd.testing.assert_frame_equal(back.drop(columns=["detector_token", "top_trigger_token"]),
                                  _typed(frame).drop(columns=["detector_token", "top_trigger_token"]),
                                  check_dtype=False)
    sidecar = json.loads((tmp_path / "t.json").read_text())
    assert sidecar == read_taxonomy_metadata(path) == back.attrs["kvmem.taxonomy"]
    assert sidecar["model"]["fingerprint"] == llama_model.fingerprint
    assert sidecar["thresholds"] == Thresholds().to_dict() and sidecar["value_convention"]["name"] == "raw"
    assert set(sidecar["pending_columns"]) == set(PENDING)
    assert not set(PENDING) & set(COLUMNS)  # scan-time columns are listed, never faked
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary left behind


def _typed(frame):
    return frame.sort_values(["layer", "neuron"]).reset_index(drop=True)[list(COLUMNS)]


def test_weights_only_table_has_null_atlas_columns(gpt2_model, tmp_path):
    frame, metadata = build_taxonomy(gpt2_model)
    write_taxonomy(frame, metadata, tmp_path / "w.parquet")
    back = read_taxonomy(tmp_path / "w.parquet")
    atlas_columns = [c for c, (_, source, _) in COLUMNS.items() if source in ("atlas", "scan")]
    assert "unigram_alignment" in atlas_columns and back[atlas_columns].isna().all().all()
    assert metadata["atlas"] is None and len(back) == 2 * 256


def test_cli_atlas_and_model_and_atlas_property(llama_dir, llama_atlas, tmp_path, capsys):
    atlas_dir = tmp_path / "atlas"
    shutil.copytree(llama_atlas.path, atlas_dir)
    opened = kvmem.open(atlas_dir)
    with pytest.raises(KvmemError, match=f"run: kvmem taxonomy --atlas {atlas_dir}"):
        _ = opened.taxonomy
    # the manifest names the model by its directory; load_scanned_model reloads and checks its fingerprint
    assert main(["taxonomy", "--atlas", str(atlas_dir)]) == 0
    assert "wrote" in capsys.readouterr().out
    frame = kvmem.open(atlas_dir).taxonomy
    assert len(frame) == len(opened.neurons) and frame.positions.notna().all()
    assert (atlas_dir / "taxonomy.json").exists()
    assert main(["taxonomy", "--model", str(llama_dir), "--out", str(tmp_path / "m.parquet")]) == 0
    assert read_taxonomy(tmp_path / "m.parquet").dead.isna().all()
    assert main(["taxonomy", "--model", str(llama_dir)]) == 2
    assert "needs --out" in capsys.readouterr().err


def test_plot_taxonomy_and_report_row(llama_model, llama_atlas, tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    from kvmem.plots import plot_taxonomy
    from kvmem.report.html import render_neuron
    from kvmem.report.neuron_dict import neuron_data

    frame, metadata = build_taxonomy(llama_model, atlas=llama_atlas)
    ax = plot_taxonomy(frame, column="prediction", paper=0.5)
    line = ax.get_lines()[0]
    expected = frame.groupby("layer").prediction.mean().to_numpy()
    np.testing.assert_allclose(line.get_ydata(), expected)
    ax = plot_taxonomy(frame, column="vocab_kurtosis", statistic="median")
    np.testing.assert_allclose(ax.get_lines()[0].get_ydata(), frame.groupby("layer").vocab_kurtosis.median())
    with pytest.raises(KvmemError, match="not in the taxonomy frame"):
        plot_taxonomy(frame, column="nope")

    atlas_dir = tmp_path / "atlas"
    shutil.copytree(llama_atlas.path, atlas_dir)
    before = neuron_data(kvmem.open(atlas_dir), 1, 3)
    assert "taxonomy" not in before and "Taxonomy" not in render_neuron(before, [])
    write_taxonomy(frame, metadata, atlas_dir / "taxonomy.parquet")
    data = neuron_data(kvmem.open(atlas_dir), 1, 3)
    row = frame[(frame.layer == 1) & (frame.neuron == 3)].iloc[0]
    assert data["taxonomy"]["vocab_kurtosis"] == pytest.approx(float(row.vocab_kurtosis), rel=1e-6)
    assert data["taxonomy"]["dead"] == bool(row.dead)
    page = render_neuron(data, [])
    assert "<h2>Taxonomy</h2>" in page and "vocab_kurtosis" in page
