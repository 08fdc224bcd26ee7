"""The scan: streaming top-k, statistics and projections against brute force; resume, shards, disk."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import SHORT_DOCS
from projection_oracle import top_bottom

import kvmem
import kvmem.schema
from kvmem.scanning.bins import HIST_BINS, reference_bin

WINDOW = 8
K = 4


def brute_force(model, docs, *, window=WINDOW, bos=True, skip=1):
    """Coefficients of every scored position (each window's tokens but its first ``skip``, a scan's default
    rule) with plain HF forward pre-hooks on W2 / down_proj.

    -> (codes [T] as (doc, pos) tuples, {layer: m [T, d_ff]})
    """
    spec = model.spec
    captured: dict[int, torch.Tensor] = {}
    handles = []
    for layer in range(model.n_layers):
        # the original HF module, unwrapped from the TransformerLens bridge
        module = model._module(f"{spec.layers}.{layer}.{spec.mlp}.{spec.value}")
        module = getattr(module, "original_component", module)
        handles.append(module.register_forward_pre_hook(
            lambda mod, args, layer=layer: captured.__setitem__(layer, args[0].detach().clone())))
    rows, acts = [], {layer: [] for layer in range(model.n_layers)}
    try:
        with torch.no_grad():
            for doc, text in enumerate(docs):
                ids = model.encode(text)
                for start in range(0, len(ids), window):
                    chunk = ids[start:start + window]
                    inputs = ([model.bos_token_id] if bos else []) + chunk
                    model.hf_model(torch.tensor([inputs]))
                    offset = 1 if bos else 0
                    rows.extend((doc, start + j) for j in range(skip, len(chunk)))
                    for layer in acts:
                        acts[layer].append(captured[layer][0, offset + skip:])
    finally:
        for handle in handles:
            handle.remove()
    return rows, {layer: torch.cat(a).numpy() for layer, a in acts.items()}


@pytest.fixture(scope="module")
def gpt2_atlas(gpt2_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("atlas") / "gpt2"
    return kvmem.scan(gpt2_model, SHORT_DOCS, out=out, top_k=K, window=WINDOW, batch_size=3, per_document=True,
                      top_n=5, progress=False)


def check_against_brute_force(model, atlas, docs=SHORT_DOCS, *, per_document=True):
    rows, acts = brute_force(model, docs)
    for layer, m in acts.items():
        for neuron in (0, 7, model.d_ff - 1):
            column = m[:, neuron]
            for kind, order in (("top", np.argsort(-column, kind="stable")), ("bottom", np.argsort(column, kind="stable"))):
                got = atlas.triggers(layer, neuron, kind=kind)
                expected = order[:K]
                assert [(int(d), int(p)) for d, p in zip(got.doc, got.pos)] == [rows[i] for i in expected]
                np.testing.assert_allclose(got.activation, column[expected], rtol=1e-5, atol=1e-6)
            if not per_document:
                continue
            # one trigger per document: the best position of each document, then the best documents
            doc_of = np.array([r[0] for r in rows])
            best = sorted(((column[doc_of == d].max(), d) for d in set(doc_of.tolist())), reverse=True)[:K]
            got = atlas.triggers(layer, neuron, kind="top_doc")
            assert got.doc.tolist() == [d for _, d in best]
            np.testing.assert_allclose(got.activation, [v for v, _ in best], rtol=1e-5)
    return rows, acts


def test_topk_equals_brute_force_gpt2(gpt2_model, gpt2_atlas):
    check_against_brute_force(gpt2_model, gpt2_atlas)


def test_topk_equals_brute_force_llama(llama_model, tmp_path):
    atlas = kvmem.scan(llama_model, SHORT_DOCS, out=tmp_path / "a", top_k=K, window=WINDOW, batch_size=2,
                       per_document=True, top_n=5, context_activations=False, progress=False)
    rows, acts = check_against_brute_force(llama_model, atlas)
    assert (acts[0] < 0).any()  # gated coefficients are signed: bottom-k matters


def test_topk_and_statistics_equal_brute_force_reading_windows_longest_first(gpt2_model, tmp_path):
    """The default order reads each block's windows longest first, so a document's shorter last window
    is read apart from its others: the triggers and statistics are still those of every window read alone."""
    from kvmem.plan import StreamPosition, iterate_batches

    atlas = kvmem.scan(gpt2_model, SHORT_DOCS, out=tmp_path / "a", top_k=K, window=WINDOW, batch_size=3, top_n=5,
                       progress=False)
    plan = atlas.manifest.plan
    assert plan.longest_windows_first
    order = [(w.doc, w.start) for b in iterate_batches(kvmem.corpus.open_corpus(SHORT_DOCS), gpt2_model.tokenizer,
                                                       plan, StreamPosition()) for w in b.windows]
    read_at: dict[int, list[int]] = {}
    for i, (doc, _) in enumerate(order):
        read_at.setdefault(doc, []).append(i)
    assert any(at != list(range(at[0], at[0] + len(at))) for at in read_at.values())  # a document read apart
    rows, acts = check_against_brute_force(gpt2_model, atlas, per_document=False)
    neurons = atlas.neurons
    for layer, m in acts.items():
        frame = neurons[neurons.layer == layer].sort_values("neuron")
        assert (frame["count"] == len(rows)).all()
        np.testing.assert_allclose(frame["mean"], m.astype(np.float64).mean(0), rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(frame["min"], m.min(0), rtol=1e-6)
        np.testing.assert_allclose(frame["max"], m.max(0), rtol=1e-6)


def test_statistics_equal_numpy(gpt2_model, gpt2_atlas):
    rows, acts = brute_force(gpt2_model, SHORT_DOCS)
    neurons = gpt2_atlas.neurons
    for layer, m in acts.items():
        frame = neurons[neurons.layer == layer].sort_values("neuron")
        assert (frame["count"] == len(rows)).all() and gpt2_atlas.manifest.tokens == len(rows)
        m64 = m.astype(np.float64)
        np.testing.assert_allclose(frame["mean"], m64.mean(0), rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(frame["std"], m64.std(0), rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(frame["min"], m.min(0), rtol=1e-6)
        np.testing.assert_allclose(frame["max"], m.max(0), rtol=1e-6)
        np.testing.assert_allclose(frame["frac_positive"], (m > 0).mean(0))
        for neuron in (3, 100):
            expected = np.bincount([reference_bin(float(v)) for v in m[:, neuron]], minlength=HIST_BINS)
            assert gpt2_atlas.histogram(layer, neuron)["count"].tolist() == expected.tolist()
        np.testing.assert_allclose(frame["value_norm"], gpt2_model.values(layer).norm(dim=1).numpy(), rtol=1e-6)


def test_projections_equal_brute_force(gpt2_model, gpt2_atlas):
    """Against a float64 brute force (tests/projection_oracle.py): raw values and keys to the bit (ties
    by token id); the final-norm convention's vectors are rebuilt here, so its scores agree to rounding."""
    for layer in (0, 1):
        values = gpt2_model.values(layer)
        norm = gpt2_model.final_norm()
        for convention, vectors in (("raw", values), ("final_norm", (values - values.mean(1, keepdim=True)) * norm.gain)):
            want = top_bottom(vectors[[0, 255]].numpy(), gpt2_model.unembedding().numpy(), 5)
            for row, neuron in enumerate((0, 255)):
                got = gpt2_atlas.values(layer, neuron, convention=convention)
                promote, suppress = got[got.kind == "promote"], got[got.kind == "suppress"]
                assert promote.token_id.tolist() == want["top_ids"][row].tolist()
                assert suppress.token_id.tolist() == want["bottom_ids"][row].tolist()
                if convention == "raw":
                    assert promote.score.tolist() == want["top_scores"][row].tolist()
                    assert suppress.score.tolist() == want["bottom_scores"][row].tolist()
                np.testing.assert_allclose(promote.score, want["top_scores"][row], rtol=1e-5)
        want = top_bottom(gpt2_model.keys(layer)[9:10].numpy(), gpt2_model.embedding().T.numpy(), 5)
        got = gpt2_atlas.keys(layer, 9)
        assert got[got.kind == "promote"].token_id.tolist() == want["top_ids"][0].tolist()
        assert got[got.kind == "promote"].score.tolist() == want["top_scores"][0].tolist()


def test_gated_keys_projected_separately(llama_model, tmp_path):
    atlas = kvmem.scan(llama_model, SHORT_DOCS[:2], out=tmp_path / "a", top_k=2, window=WINDOW, top_n=3,
                       context_activations=False, progress=False)
    got = atlas.keys(1, 4)
    assert sorted(set(got.vector)) == ["gate", "key"]
    want = top_bottom(llama_model.gate_keys(1)[4:5].float().numpy(), llama_model.embedding().T.float().numpy(), 3)
    assert got[(got.vector == "gate") & (got.kind == "promote")].token_id.tolist() == want["top_ids"][0].tolist()
    assert not np.isnan(atlas.neurons.gate_norm).any()


def test_trigger_text(gpt2_model, gpt2_atlas):
    frame = gpt2_atlas.table("triggers")
    for row in frame.head(200).itertuples():
        assert "".join(row.context_tokens) == row.context
        assert row.context[row.span_start:row.span_end] == row.context_tokens[row.context_trigger]
        ids = gpt2_model.encode(SHORT_DOCS[row.doc])
        assert row.token_id == ids[row.pos] and row.token == gpt2_model.token_str(ids[row.pos])
        assert row.next_token_id == (ids[row.pos + 1] if row.pos + 1 < len(ids) else -1)
        assert row.doc_id == f"list:{row.doc}"
        # the context's own coefficient at the trigger token is the trigger's activation
        assert row.context_activations[row.context_trigger] == pytest.approx(row.activation, rel=1e-5, abs=1e-6)
        assert row.pos // WINDOW == (row.pos - row.context_trigger) // WINDOW  # context stays in the window


def test_byte_identical_and_round_trip(gpt2_model, gpt2_atlas, tmp_path):
    again = kvmem.scan(gpt2_model, SHORT_DOCS, out=tmp_path / "again", top_k=K, window=WINDOW, batch_size=3,
                       per_document=True, top_n=5, progress=False)
    for table in ("neurons", "triggers", "contexts", "samples", "histograms", "unigrams"):
        assert (gpt2_atlas.path / f"{table}.parquet").read_bytes() == (again.path / f"{table}.parquet").read_bytes()
    reopened = kvmem.open(gpt2_atlas.path)
    assert reopened.neurons.equals(gpt2_atlas.neurons)
    manifest = reopened.manifest
    assert manifest.model["fingerprint"] == gpt2_model.fingerprint and manifest.kvmem_version == kvmem.__version__
    assert manifest.tokenization["window"] == WINDOW and manifest.scan["top_k"] == K
    assert set(manifest.projection["conventions"]) == {"raw", "final_norm"}
    assert len(manifest.corpus["sha256_chain"]) == 64 and manifest.corpus["documents"] == len(SHORT_DOCS)


def test_queries(gpt2_model, gpt2_atlas):
    record = gpt2_atlas.neuron(1, 7)
    assert "Neuron 1:7" in repr(record) and "<mark>" in record._repr_html_()
    top = gpt2_atlas.values(1, 7, convention="final_norm", kind="promote")
    token = top.token.iloc[0]
    found = gpt2_atlas.top_neurons(token=token, by="value", convention="final_norm", k=50)
    assert ((found.layer == 1) & (found.neuron == 7)).any()
    trig = gpt2_atlas.triggers(0, 5, kind="top").iloc[0]
    if trig.next_token_id >= 0:
        fired = gpt2_atlas.top_neurons(token=int(trig.next_token_id), by="trigger", k=10_000)
        assert ((fired.layer == 0) & (fired.neuron == 5)).any()
    hits = gpt2_atlas.search(r"Paris")
    assert len(hits) and hits.context.str.contains("Paris").all()
    with pytest.raises(kvmem.KvmemError, match=r"neuron 256 is out of range; layer 0 has neurons 0\.\.255"):
        gpt2_atlas.neuron(0, 256)
    with pytest.raises(kvmem.KvmemError, match=r"layer 9 is not in this atlas; it holds layers 0\.\.1"):
        gpt2_atlas.triggers(9, 0)
    with pytest.raises(kvmem.KvmemError, match=r"' Parisian' is not one token: it tokenizes as \[' Paris', 'ian'\]"):
        gpt2_atlas.top_neurons(token=" Parisian", tokenizer=gpt2_model.tokenizer)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")], ids=["nan", "+inf", "-inf"])
def test_non_finite_coefficients_are_refused(gpt2_model, tmp_path, bad):
    """One NaN or ±inf coefficient (layer 1, the second batch) stops the scan with one line naming the
    layer and the batch; nothing is written."""
    from kvmem.scanning import runner

    real, batches = runner.capture_coefficients, [0]

    def poisoned(model, ids, layers, on_coefficients):
        def inject(layer, m):
            if layer == 1 and batches[0] == 1:
                m = m.clone()
                m[0, 2, 5] = bad  # a scored position (BOS is position 0, the window's first token 1)
            on_coefficients(layer, m)
        real(model, ids, layers, inject)
        batches[0] += 1

    runner.capture_coefficients = poisoned
    try:
        with pytest.raises(kvmem.KvmemError, match=r"layer 1 gave non-finite coefficients \(NaN or ±inf\) in batch 1 "
                                                   r".*scan in float32 or bfloat16"):
            kvmem.scan(gpt2_model, SHORT_DOCS, out=tmp_path / "a", top_k=2, window=WINDOW, batch_size=2,
                       per_document=True, progress=False)
    finally:
        runner.capture_coefficients = real
    assert batches[0] == 2 and not (tmp_path / "a").exists()


def test_max_tokens_and_layers(gpt2_model, tmp_path):
    every = kvmem.scan(gpt2_model, "pydoc", out=tmp_path / "a", max_tokens=100, layers=[1], top_k=2, window=32,
                       top_n=2, progress=False, skip_first=0)
    assert every.manifest.tokens == 100 and every.layers == [1]
    assert set(every.neurons.layer) == {1} and (every.neurons["count"] == 100).all()
    # by default the first token of each window is read, not scored: pydoc's first document has more than
    # 100 tokens, so 100 tokens read are windows of 32, 32, 32 and 4 tokens, of which 31 + 31 + 31 + 3 are scored
    atlas = kvmem.scan(gpt2_model, "pydoc", out=tmp_path / "b", max_tokens=100, layers=[1], top_k=2, window=32,
                       top_n=2, progress=False)
    assert atlas.manifest.tokens == 96 and (atlas.neurons["count"] == 96).all()
    assert atlas.manifest.tokenization["skip_first"] == 1 and every.manifest.tokenization["skip_first"] == 0


def test_scan_errors(gpt2_model, gpt2_atlas, tmp_path):
    with pytest.raises(kvmem.KvmemError, match="already exists; pass overwrite=True"):
        kvmem.scan(gpt2_model, SHORT_DOCS, out=gpt2_atlas.path)
    with pytest.raises(kvmem.KvmemError, match=r"layer\(s\) \[5\] out of range; this model has layers 0\.\.1"):
        kvmem.scan(gpt2_model, SHORT_DOCS, out=tmp_path / "x", layers=[5])
    with pytest.raises(kvmem.KvmemError, match="top_k must be an integer >= 1, got 0"):
        kvmem.scan(gpt2_model, SHORT_DOCS, out=tmp_path / "x", top_k=0)
    with pytest.raises(kvmem.KvmemError, match="unknown projection convention"):
        kvmem.scan(gpt2_model, SHORT_DOCS, out=tmp_path / "x", conventions=("logit",))
    with pytest.raises(kvmem.KvmemError, match="gave no tokens to scan"):
        kvmem.scan(gpt2_model, ["   "], out=tmp_path / "x")
    with pytest.raises(kvmem.KvmemError, match="window 500 exceeds the model's context"):
        kvmem.scan(gpt2_model, SHORT_DOCS, out=tmp_path / "x", window=500)
    with pytest.raises(kvmem.KvmemError, match="nothing to resume"):
        kvmem.scan(gpt2_model, SHORT_DOCS, out=tmp_path / "y", resume=True)
    assert not (tmp_path / "x").exists()


def test_missing_or_corrupt_atlas(gpt2_atlas, tmp_path):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(gpt2_atlas.path, broken)
    (broken / "histograms.parquet").unlink()
    with pytest.raises(kvmem.KvmemError, match=r"histograms.parquet is missing"):
        kvmem.open(broken).histogram(0, 0)
    (broken / "triggers.parquet").write_bytes(b"garbage")
    with pytest.raises(kvmem.KvmemError, match=r"triggers.parquet is corrupt"):
        kvmem.open(broken).triggers(0, 0)
    (broken / "manifest.json").write_text("{")
    with pytest.raises(kvmem.KvmemError, match=r"manifest.json is corrupt"):
        kvmem.open(broken)
    with pytest.raises(kvmem.KvmemError, match="does not exist"):
        kvmem.open(tmp_path / "none")


def test_cli_scan_and_queries(gpt2_dir, tmp_path, capsys):
    from kvmem.cli import main

    corpus = tmp_path / "c.jsonl"
    corpus.write_text("\n".join(json.dumps({"text": t}) for t in SHORT_DOCS))
    out = tmp_path / "atlas"
    assert main(["scan", "--model", str(gpt2_dir), "--corpus", str(corpus), "--out", str(out), "--top-k", "3",
                 "--window", "16", "--top-n", "4", "--quiet"]) == 0
    assert "scanned" in capsys.readouterr().out
    assert main(["scan", "--model", str(gpt2_dir), "--corpus", str(corpus), "--out", str(out)]) == 2
    assert "already exists" in capsys.readouterr().err
    assert main(["info", "--atlas", str(out)]) == 0 and "gelu_new" in capsys.readouterr().out
    assert main(["neuron", "--atlas", str(out), "1:3"]) == 0
    shown = capsys.readouterr().out
    assert "top triggers" in shown and "[[" in shown
    assert main(["neuron", "--atlas", str(out), "1:999"]) == 2
    assert capsys.readouterr().err.strip() == "kvmem: error: neuron 999 is out of range; layer 1 has neurons 0..255"
    assert main(["top", "--atlas", str(out), "--token", " Paris", "--by", "trigger"]) == 0
    assert main(["scan", "--model", str(gpt2_dir), "--corpus", str(corpus), "--out", str(tmp_path / "z"),
                 "--top-k", "0"]) == 2
    assert "top_k must be an integer >= 1" in capsys.readouterr().err


def test_hostile_text_scans(gpt2_model, tmp_path):
    docs = ['x <script>alert(1)</script> "><img src=x onerror=alert(1)>', "rtl \u202e mark, zero\u200bwidth, lone \ud800 end"]
    atlas = kvmem.scan(gpt2_model, docs, out=tmp_path / "a", top_k=2, window=16, top_n=2, progress=False)
    contexts = set(atlas.table("triggers").context)
    assert any("<script>" in c for c in contexts) and any("\ufffd" in c for c in contexts)


def test_key_projections_can_be_skipped(gpt2_model, tmp_path):
    atlas = kvmem.scan(gpt2_model, SHORT_DOCS[:2], out=tmp_path / "a", top_k=2, window=16, top_n=2,
                       key_projections=False, context_activations=False, progress=False)
    assert atlas.keys(0, 0).empty and len(atlas.values(0, 0)) == 2 * 2 * 2
    assert list(atlas.table("triggers", columns=["layer", "pos"]).columns) == ["layer", "pos"]
    with pytest.raises(kvmem.KvmemError, match="has no column"):
        atlas.table("triggers", columns=["nope"])


def test_samples_equal_brute_force(gpt2_model, gpt2_atlas):
    """The random sample is the positions with the smallest keys; each bin keeps its smallest keys under the rate."""
    from kvmem.plan import pack
    from kvmem.scanning.bins import bin_index
    from kvmem.scanning.ordering import KEY_BITS, position_keys

    rows, acts = brute_force(gpt2_model, SHORT_DOCS)
    codes = torch.tensor([int(pack(d, p)) for d, p in rows])
    keys = position_keys(codes, 0).numpy()
    config = gpt2_atlas.manifest.scan
    by_key = np.argsort(keys, kind="stable")
    for layer, m in acts.items():
        for neuron in (0, 17, gpt2_model.d_ff - 1):
            got = gpt2_atlas.samples(layer, neuron, kind="random")
            expected = by_key[:config["random_samples"]]
            assert [(int(d), int(p)) for d, p in zip(got.doc, got.pos)] == [rows[i] for i in expected]
            np.testing.assert_allclose(got.activation, m[expected, neuron], rtol=1e-5, atol=1e-6)
            for row in got.itertuples():
                assert row.context[row.span_start:row.span_end] == row.context_tokens[row.context_trigger]
                assert row.context_activations[row.context_trigger] == row.activation
            got = gpt2_atlas.samples(layer, neuron, kind="bin")
            bins = bin_index(torch.from_numpy(m[:, neuron].copy())).numpy()
            thinned = [i for i in by_key if keys[i] < int(config["sample_rate"] * (1 << KEY_BITS))]
            expected = []
            for b in sorted(set(bins[thinned].tolist())):
                expected += [(b, rows[i]) for i in [i for i in thinned if bins[i] == b][:config["bin_samples"]]]
            assert [(int(b), (int(d), int(p))) for b, d, p in zip(got.bin, got.doc, got.pos)] == expected
    bands = gpt2_atlas.quantile_samples(0, 3, bands=4, per_band=2)
    assert len(bands) == 4 and all(len(band) <= 2 for band in bands)

