"""kvmem.experiments, part 2 (active memories, layer vs memories, provenance, plots, CLI, notebook): each metric pinned on cases whose answer is known exactly.

Pure cores on hand-built frames and tensors (agreement exactly 1/2, ranks of known scores, means of
known changes); end-to-end runs on tiny random GPT-2 / Llama models, some edited so the answer is
forced (a slot that is always on, a layer that sees only the current token, a value whose top token
is chosen); the recomputed coefficient equals the atlas's stored one; the CLI; the notebook's source.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import pandas as pd
import pytest
import torch

import kvmem
from kvmem import experiments as E
from kvmem.cli import main
from kvmem.errors import KvmemError
from kvmem.experiments.atlas_inputs import FingerprintWarning
from kvmem.experiments.forward import corpus_windows, read_positions, sample_positions, scan_plan

ROOT = Path(__file__).resolve().parents[1]
PROVENANCE_KEYS = {"experiment", "model", "fingerprint", "settings", "kvmem_version"}



# ---- active memories ----
def test_active_fractions_exact():
    m = torch.tensor([[1.0, -1.0, 0.0, 2.0], [0.5, 0.5, 0.5, 0.5]])
    out = E.active_fractions(m, threshold=0.0, abs_threshold=0.5)
    assert out["active"].tolist() == [0.5, 1.0]
    assert out["abs_active"].tolist() == [0.75, 0.0]
    # weights [1, 1, 0, 2] (norms 1): sorted cumulative 2, 3, 4 -> 3 slots reach 90% of 4
    assert out["mass90"].tolist() == [0.75, 1.0]
    out = E.active_fractions(m, value_norms=torch.tensor([10.0, 1.0, 1.0, 1.0]))
    assert out["mass90"].tolist()[0] == 0.5  # weights [10, 1, 0, 2]: 10 + 2 = 12 >= 11.7


def test_a_slot_that_is_always_on_is_the_only_active_one(always_on, corpus_file):
    frame = E.active_memories(always_on, corpus_file, positions=40, unit="paragraph", window=32, max_tokens=400)
    row = frame[frame.layer == 0].iloc[0]
    assert row["positions"] == 40
    assert row["active_mean"] == row["active_q1"] == row["active_q3"] == 1 / 256
    assert row["abs_active_mean"] == 1 / 256 and row["mass90_mean"] == 1 / 256
    assert 0.3 < frame.loc[frame.layer == 1, "active_mean"].item() < 0.7  # the untouched random layer
    assert frame.attrs["settings"]["positions"] == 40 and frame.attrs["corpus"].endswith("pydoc6.txt")


def test_sampled_positions_follow_the_tokenization_rule(gpt2_model, corpus_file):
    corpus = kvmem.corpus.open_corpus(corpus_file, unit="paragraph")
    plan = scan_plan(gpt2_model, window=16, max_tokens=300)
    windows = corpus_windows(gpt2_model, corpus, plan)
    assert sum(len(w.tokens) for w in windows) == 300 and all(len(w.tokens) <= 16 for w in windows)
    sampled = sample_positions(gpt2_model, corpus, positions=50, seed=3, plan=plan)
    assert len(sampled.doc) == 50 and len(set(zip(sampled.doc, sampled.pos))) == 50
    tokens = {d.index: gpt2_model.encode(d.text) for d in corpus}
    bos = gpt2_model.bos_token_id
    read = 0
    for sequence, reads in zip(sampled.sequences, sampled.reads):
        assert sequence[0] == bos
        for at in reads:  # the read token is the sampled document token
            assert sequence[at] == tokens[int(sampled.doc[read])][int(sampled.pos[read])]
            read += 1
    again = sample_positions(gpt2_model, corpus, positions=50, seed=3, plan=plan)
    assert again.pos.tolist() == sampled.pos.tolist()


def test_experiments_on_a_shard_atlas_read_only_its_positions(gpt2_model, corpus_file, tmp_path):
    """A shard atlas's plan keeps its shard: sampled positions all lie in blocks the shard scanned."""
    shard = kvmem.scan(gpt2_model, str(corpus_file), unit="paragraph", out=tmp_path / "s1", shard=(1, 2),
                       block_documents=1, window=16, top_k=2, top_n=2, progress=False)
    plan = scan_plan(gpt2_model, atlas=shard)
    assert plan.shard == (1, 2) and plan.window == 16
    corpus = kvmem.corpus.open_corpus(corpus_file, unit="paragraph")
    sampled = sample_positions(gpt2_model, corpus, positions=40, seed=0, plan=plan)
    assert len(sampled.doc) == 40 and all(doc % 2 == 1 for doc in sampled.doc.tolist())
    assert sampled.corpus_tokens == shard.manifest.tokens


def test_read_positions_leaves_no_hooks_also_after_an_exception(gpt2_model):
    def boom(index, captured):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        read_positions(gpt2_model, [[1, 2, 3]], [[2]], [gpt2_model.hook_name(1, "post")], boom)
    assert sum(len(h.fwd_hooks) for h in gpt2_model.bridge.hook_dict.values()) == 0
    got = {}
    read_positions(gpt2_model, [[5, 6, 7, 8], [9]], [[0, 3], [0]], [gpt2_model.hook_name(0, "post")],
                   lambda index, captured: got.update(zip(index.tolist(), captured["blocks.0.mlp.hook_post"])))
    store = {}
    with torch.no_grad(), gpt2_model.bridge.hooks(fwd_hooks=[("blocks.0.mlp.hook_post", lambda t, hook: store.update(m=t))]):
        gpt2_model.bridge(torch.tensor([[5, 6, 7, 8]]), return_type=None)
    torch.testing.assert_close(got[1], store["m"][0, 3])
    assert sum(len(h.fwd_hooks) for h in gpt2_model.bridge.hook_dict.values()) == 0


# ---- layer vs memories ----
def test_memory_agreement_exact():
    m = torch.tensor([[2.0, -3.0, 0.0, 1.0], [0.0, 0.0, 5.0, 0.0]])  # [n=2, d_ff=4]
    value_top, value_bottom = torch.tensor([10, 11, 12, 13]), torch.tensor([20, 21, 22, 23])
    ffn_top = torch.tensor([21, 10])  # row 0: slot 1 (m < 0) predicts its bottom token 21; row 1: nobody
    active = m.abs() > 0.5
    out = E.memory_agreement(m, ffn_top, value_top, value_bottom, active=active, weight=m.abs(), top_memories=1)
    assert out["active"].tolist() == [3, 1]
    assert out["matches_active"].tolist() == [True, False]
    assert out["matches_heaviest"].tolist() == [True, False]  # slot 1 is the heaviest of row 0
    out = E.memory_agreement(m, torch.tensor([13, 12]), value_top, value_bottom, active=active, weight=m.abs(),
                             top_memories=2)
    assert out["matches_active"].tolist() == [True, True]
    assert out["matches_top"].tolist() == [False, True]  # slot 3 is third heaviest in row 0


def test_one_active_memory_is_the_whole_layer(always_on, corpus_file):
    frame = E.layer_vs_memories(always_on, corpus_file, positions=30, unit="paragraph", window=32, max_tokens=400)
    row = frame[frame.layer == 0].iloc[0]
    assert (row["active"], row["ffn_matches_active"], row["ffn_matches_heaviest"], row["ffn_matches_none"]) == \
        (1.0, 1.0, 1.0, 0.0)
    last = frame[frame.layer == always_on.n_layers - 1].iloc[0]
    assert last["after_is_final"] == 1.0  # the lens after the last FFN is the model's own prediction
    shares = frame.after_is_before + frame.after_is_ffn + frame.after_is_neither
    assert (shares >= 1.0 - 1e-12).all()  # each position is counted at least once (before and ffn may coincide)
    assert frame.attrs["settings"]["residual_before"] == "hook_resid_mid"
    assert frame.attrs["convention"] == "final_norm" and frame.attrs["settings"]["value_tops_from"] == "model"
    # a GELU model is read with the positive side only, so the released comparison has one set of memories
    assert (frame.released_matches_none == frame.released_matches_none_positive).all()
    assert frame.attrs["settings"]["sides"] == ["positive"]


def test_layer_vs_memories_on_a_gated_model_uses_signed_coefficients(llama_model, corpus_file):
    frame = E.layer_vs_memories(llama_model, corpus_file, positions=20, unit="paragraph", window=32, max_tokens=300,
                                abs_threshold=0.01, top_memories=5)
    assert list(frame.layer) == [0, 1] and "ffn_matches_top5" in frame
    assert frame.attrs["settings"]["active_rule"] == "|m_i| > 0.01 (gated FFN)"
    assert frame[["ffn_matches_active", "after_is_final"]].apply(lambda c: c.between(0, 1)).all().all()
    assert frame.after_is_final.iloc[-1] == 1.0
    # signed: both sides' top tokens are memories, so "no memory's token" can only be rarer than with +v alone
    assert (frame.released_matches_none <= frame.released_matches_none_positive).all()
    assert frame.attrs["settings"]["sides"] == ["positive", "negative"]
    active = E.active_memories(llama_model, corpus_file, positions=20, unit="paragraph", window=32, max_tokens=300)
    assert active.abs_active_mean.between(0, 1).all() and active.attrs["gated"] is True


def test_layer_vs_memories_reads_value_tops_from_the_atlas(atlas, gpt2_model):
    with_atlas = E.layer_vs_memories(gpt2_model, atlas=atlas, positions=25)
    assert with_atlas.attrs["settings"]["value_tops_from"] == "atlas values table"
    assert with_atlas.attrs["settings"]["window"] == 32
    without = E.layer_vs_memories(gpt2_model, atlas.manifest.corpus["spec"], positions=25, window=32,
                                  max_tokens=atlas.manifest.tokenization["max_tokens"], unit="paragraph")
    cols = ["ffn_matches_active", "ffn_matches_top10", "after_is_final", "before_is_final"]
    pd.testing.assert_frame_equal(with_atlas[cols], without[cols])


# ---- provenance, fingerprints, plots ----
def test_fingerprint_mismatch_is_reported(atlas, always_on):
    with pytest.warns(FingerprintWarning, match="mix two models"):
        frame = E.agreement(atlas, model=always_on, top_triggers=(1,))
    assert frame.attrs["fingerprint_match"] is False
    assert frame.attrs["atlas_fingerprint"] != always_on.fingerprint
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert E.model_for_atlas(atlas) is not None  # the atlas's own model: no warning


def test_plots_return_axes(atlas, gpt2_model):
    import matplotlib.pyplot as plt

    frames = {
        "plot_agreement": E.agreement(atlas, n_boot=20),
        "plot_next_token_rank": E.next_token_rank(atlas, gpt2_model, n_boot=20),
        "plot_token_removal": E.token_removal(atlas, gpt2_model, neurons_per_layer=2, triggers=1, n_boot=20),
        "plot_active_memories": E.active_memories(gpt2_model, atlas=atlas, positions=10),
        "plot_layer_vs_memories": E.layer_vs_memories(gpt2_model, atlas=atlas, positions=10),
    }
    for name, frame in frames.items():
        assert PROVENANCE_KEYS <= set(frame.attrs), name
        json.dumps(frame.attrs)  # serialisable
        _, ax = plt.subplots()
        assert getattr(E, name)(frame, ax=ax) is ax
        assert getattr(E, name)(frame).has_data()
        plt.close("all")
    with pytest.raises(KvmemError):
        E.plot_agreement(pd.DataFrame({"x": [1]}))


# ---- command line ----
def test_cli_agreement_and_outputs(atlas, tmp_path, capsys):
    out = tmp_path / "agreement.json"
    assert main(["experiment", "agreement", "--atlas", str(atlas.path), "--top-triggers", "1,2", "--kind", "top_doc",
                 "--out", str(out), "--plot", str(tmp_path / "agreement.png")]) == 0
    printed = capsys.readouterr().out
    assert "agree_top1" in printed and "convention raw, final_norm" in printed
    data = json.loads(out.read_text())
    assert data["provenance"]["settings"]["top_triggers"] == [1, 2] and len(data["rows"]) == 4  # 2 layers x 2 conventions
    assert (tmp_path / "agreement.png").stat().st_size > 0


def test_cli_runs_every_experiment_with_the_atlas_model(atlas, tmp_path, capsys):
    for name, extra in (("next-token-rank", []), ("token-removal", ["--neurons-per-layer", "2", "--triggers", "1"]),
                        ("active-memories", ["--positions", "15"]),
                        ("layer-vs-memories", ["--positions", "15", "--layers", "1"])):
        csv = tmp_path / f"{name}.csv"
        assert main(["experiment", name, "--atlas", str(atlas.path), "--out", str(csv), *extra]) == 0, name
        captured = capsys.readouterr()
        assert "model fingerprint matches the atlas" in captured.out
        assert "warning" not in captured.err
        # next-token-rank reports raw and final_norm per layer
        assert len(pd.read_csv(csv)) == {"layer-vs-memories": 1, "next-token-rank": 4}.get(name, 2)


def test_cli_reports_a_fingerprint_mismatch_and_user_errors(atlas, always_on, capsys):
    assert main(["experiment", "active-memories", "--atlas", str(atlas.path), "--model", always_on.source,
                 "--positions", "5"]) == 0
    captured = capsys.readouterr()
    assert "kvmem: warning:" in captured.err and "fingerprint" in captured.err
    assert "DIFFERS" in captured.out
    assert main(["experiment", "agreement", "--atlas", str(atlas.path), "--layers", "0-x"]) == 2
    assert "--layers expects" in capsys.readouterr().err
    assert main(["experiment", "agreement", "--atlas", str(atlas.path), "--layers", "7"]) == 2
    assert "not in atlas" in capsys.readouterr().err
    assert main(["experiment", "agreement", "--atlas", str(atlas.path) + "-missing"]) == 2
    assert main(["experiment", "agreement", "--atlas", str(atlas.path), "--out", "x.txt"]) == 2
    assert main(["experiment", "agreement", "--atlas", str(atlas.path), "--positions", "5"]) == 2
    assert "--positions does not apply to agreement" in capsys.readouterr().err
    assert main(["experiment", "geva2021", "--atlas", str(atlas.path)]) == 2
    assert "--out DIR" in capsys.readouterr().err


def test_the_cli_reads_its_experiments_from_the_registry(capsys):
    from kvmem.cli import build_parser
    from kvmem.experiments.registry import EXPERIMENTS

    sub = next(a for a in build_parser()._actions if a.dest == "command").choices["experiment"]
    name = next(a for a in sub._actions if a.dest == "name")
    assert list(name.choices) == list(EXPERIMENTS)
    for experiment in EXPERIMENTS.values():  # every registered function and plot exists, and E exposes it
        assert getattr(E, experiment.function) is experiment.load()
        assert experiment.plot is None or getattr(E, experiment.plot) is experiment.load_plot()
    assert "EXPERIMENTS" in E.__all__ and "bootstrap_ci" in E.__all__


def test_reproduction_writes_results_that_load_back(atlas, gpt2_model, tmp_path, capsys):
    out = tmp_path / "results"
    assert main(["experiment", "geva2021", "--atlas", str(atlas.path), "--out", str(out), "--positions", "10",
                 "--neurons-per-layer", "2", "--triggers", "1", "--n-boot", "20", "--bos", "default,none"]) == 0
    results = E.load_results(out)
    assert set(results) == set(E.RESULT_NAMES)
    assert results["agreement"].attrs["experiment"] == "agreement"
    assert results["lm_quality"].bos.tolist() == ["default", "none"]
    assert set(results["layer_vs_memories"].convention) == {"raw", "final_norm"}
    assert results["next_token_rank"].attrs["settings"]["kind"] == "top_doc"  # a per-document atlas: Geva's choice
    assert main(["experiment", "geva2021", "--atlas", str(atlas.path), "--out", str(out)]) == 2
    assert "exists" in capsys.readouterr().err


# ---- the notebook ----
def test_geva2021_notebook_is_generated_and_cleared():
    """The committed notebook is what notebooks/make_geva2021.py writes, outputs cleared (tests/test_notebooks.py
    executes every notebook with KVMEM_NOTEBOOK_TOKENS=800 and KVMEM_NOTEBOOK_FAST=1)."""
    import importlib.util

    import nbformat

    spec = importlib.util.spec_from_file_location("make_geva2021", ROOT / "notebooks" / "make_geva2021.py")
    generator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generator)
    committed = nbformat.read(ROOT / "notebooks" / "geva2021.ipynb", as_version=4)
    assert [c.source for c in committed.cells] == [c.source for c in generator.build().cells]
    assert not any(c.get("outputs") or c.get("execution_count") for c in committed.cells if c.cell_type == "code")
    source = "\n".join(c.source for c in committed.cells)
    for name in ("token_removal", "agreement", "next_token_rank", "active_memories", "layer_vs_memories",
                 "reproduce_geva2021", "load_results", "KVMEM_GEVA2021_RESULTS",
                 "KVMEM_NOTEBOOK_TOKENS", "KVMEM_NOTEBOOK_FAST", 'MODEL = "smollm2-135m"',
                 "hf:wikitext:wikitext-103-raw-v1:train"):
        assert name in source


# ---- the model as an LM ----
def test_lm_quality_is_the_models_own_loss(gpt2_model):
    docs = ["The cat sat on the mat and looked at the dog.", "Numbers: 1, 2, 3, 5, 8, 13, 21, 34."]
    frame = E.lm_quality(gpt2_model, docs, bos=("default", "none", "<|endoftext|>"), n_boot=20)
    assert frame.bos_token_id.tolist() == [50256, -1, 50256] and frame.bos.tolist() == ["default", "none", "<|endoftext|>"]
    tokens = [gpt2_model.encode(d) for d in docs]
    assert frame.predictions.tolist() == [sum(len(t) - 1 for t in tokens)] * 3  # the same targets for every BOS
    losses = []
    with torch.no_grad():
        for t in tokens:
            ids = torch.tensor([[50256] + t])
            logits = gpt2_model.hf_model(ids).logits[0, 1:-1]
            losses.append(torch.nn.functional.cross_entropy(logits, ids[0, 2:], reduction="sum"))
    nll = float(sum(losses)) / frame.predictions.iloc[0]
    assert frame.nll.iloc[0] == pytest.approx(nll, rel=1e-5)
    assert frame.perplexity.iloc[0] == pytest.approx(float(torch.tensor(nll).exp()), rel=1e-5)
    assert frame.nll.iloc[0] == pytest.approx(frame.nll.iloc[2])
    assert frame.accuracy.between(0, 1).all()
    with pytest.raises(KvmemError, match="not a single token"):
        E.lm_quality(gpt2_model, docs, bos="<|im_start|>")


@pytest.mark.slow
def test_smollm2_windows_start_with_endoftext_the_better_lm():
    """SmolLM2's default window start is <|endoftext|> (kvmem.builtin.SCAN_BOS), chosen because it predicts plain
    text better than the tokenizer's chat BOS <|im_start|>."""
    model = kvmem.load_model("smollm2-135m", device="cpu")
    assert model.bos_token_id == 0 and model.tokenizer.bos_token_id == 1
    frame = E.lm_quality(model, "stdlib-docs", unit="sentence", max_tokens=600, bos=("default", "<|im_start|>"),
                         n_boot=20)
    assert frame.bos_token.tolist() == ["<|endoftext|>", "<|im_start|>"]
    assert frame.perplexity.iloc[0] < frame.perplexity.iloc[1]


def test_layer_vs_memories_equals_plain_hf_hooks_and_numpy(gpt2_model, corpus_file):
    """Every per-layer fraction under the raw convention, recomputed from a plain HF forward per sampled sequence
    (hooks on ln_2's input, the MLP's activation and output, each block's output) and numpy: the logit lens is
    ln_f then lm_head, the raw projection W_U alone, and a memory's token its value's top (bottom when m < 0)."""
    import numpy as np

    from kvmem.experiments.active import sample_for

    settings = dict(positions=40, window=32, max_tokens=400, unit="paragraph", seed=3)
    frame = E.layer_vs_memories(gpt2_model, corpus_file, convention="raw", top_memories=3, **settings)
    sampled, _, _ = sample_for(gpt2_model, corpus_file, None, prepend_bos=None, **settings)
    hf = gpt2_model.hf_model
    blocks = hf.transformer.h
    w_u = hf.lm_head.weight.detach().numpy().astype(np.float64)  # [vocab, d]
    seen: dict = {}
    handles = []
    for layer, block in enumerate(blocks):
        def keep(name, layer=layer):
            return lambda module, args, output=None: seen.__setitem__(
                (layer, name), (args[0] if output is None else output[0] if isinstance(output, tuple) else output)[0])
        handles += [block.ln_2.register_forward_pre_hook(keep("mid")), block.mlp.register_forward_hook(keep("out")),
                    block.mlp.act.register_forward_hook(keep("m")), block.register_forward_hook(keep("post"))]
    rows = {key: [] for key in ("mid", "out", "m", "post")}
    with torch.no_grad():
        try:
            for sequence, reads in zip(sampled.sequences, sampled.reads):
                seen.clear()
                hf(torch.tensor([sequence]))
                for name in rows:
                    rows[name].append([seen[(layer, name)][reads].numpy() for layer in range(len(blocks))])
        finally:
            for handle in handles:
                handle.remove()
    at = {name: [np.concatenate([part[layer] for part in parts]) for layer in range(len(blocks))]
          for name, parts in rows.items()}

    def lens(x):
        return hf.lm_head(hf.transformer.ln_f(torch.from_numpy(x))).argmax(1).numpy()

    values = np.stack([b.mlp.c_proj.weight.detach().numpy() for b in blocks])  # [L, d_ff, d] (Conv1D)
    final = lens(at["post"][-1])
    for layer in range(len(blocks)):
        value_scores = values[layer].astype(np.float64) @ w_u.T  # [d_ff, vocab]
        top, bottom = value_scores.argmax(1), value_scores.argmin(1)
        m = at["m"][layer]
        ffn = (at["out"][layer] @ w_u.T.astype(np.float32)).argmax(1)
        released = (at["post"][layer] @ w_u.T.astype(np.float32)).argmax(1)
        before, after = lens(at["mid"][layer]), lens(at["post"][layer])
        predicted = np.where(m >= 0, top[None], bottom[None])
        heavy = np.argsort(-(np.abs(m) * np.linalg.norm(values[layer], axis=1)[None]), axis=1, kind="stable")[:, :3]
        agrees = predicted == ffn[:, None]
        expected = {
            "released_matches_none_positive": 1 - np.isin(released, top).mean(),
            "active": (m > 0).sum(1).mean(),
            "ffn_matches_active": (agrees & (m > 0)).any(1).mean(),
            "ffn_matches_top3": np.take_along_axis(agrees, heavy, 1).any(1).mean(),
            "before_is_final": (before == final).mean(), "after_is_final": (after == final).mean(),
            "after_is_before": (after == before).mean(), "after_is_ffn": (after == ffn).mean()}
        got = frame[frame.layer == layer].iloc[0]
        assert got["positions"] == len(m) == 40
        for column, value in expected.items():
            assert got[column] == pytest.approx(value, abs=1e-12), (layer, column)
