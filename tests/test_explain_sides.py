"""Scores on a real (tiny) atlas: split hygiene, each side's own negatives, the output side, intervention and
embedding scorers, the anchors' protocols through kvmem.score, the tidy view and the random-init population."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

import kvmem
from kvmem.autointerp import score_table, store
from kvmem.autointerp.bulk import layer_evidence
from kvmem.autointerp.scorers.detection import quiet_examples
from kvmem.cli import main


def _windows(codes, window):
    codes = np.asarray(list(codes), np.int64)
    return set(zip((codes >> 32).tolist(), ((codes & 0xFFFFFFFF) // window).tolist()))


def test_no_held_out_example_shares_a_window_or_a_token_with_an_explain_example(explain_atlas):
    rows = kvmem.explain(explain_atlas, neurons=[(0, n) for n in range(0, 256, 8)])
    scored = kvmem.score(explain_atlas, scorers="detection,fuzzing,simulation", n_boot=50)
    window = explain_atlas.manifest.tokenization["window"]
    assert (scored.split_window == window).all()
    contexts = explain_atlas.table("contexts", ["doc", "pos", "context_trigger", "context_tokens"])
    span = {(int(d) << 32 | int(p)): (int(d), int(p) - int(t), int(p) - int(t) + len(k))
            for d, p, t, k in contexts.itertuples(index=False)}
    for row in scored.itertuples():
        explained = set(row.explain_codes)
        held = set(row.detection_codes) | set(row.fuzzing_codes) | set(row.simulation_codes)
        assert held and explained and not held & explained
        assert not _windows(held, window) & _windows(explained, window)  # no read window on both sides
        seen = {}
        for code in explained:  # no token position inside a held-out context was shown to the explainer
            doc, start, stop = span[code]
            seen.setdefault(doc, []).append((start, stop))
        for code in held:
            doc, start, stop = span[code]
            assert all(stop <= a or b <= start for a, b in seen.get(doc, []))
    assert len(rows) == 32


def test_each_side_has_its_own_negatives_and_too_few_are_not_scored(explain_atlas):
    kvmem.explain(explain_atlas, neurons=[(0, n) for n in range(0, 256, 16)])
    scored = kvmem.score(explain_atlas, scorers="detection", n_boot=50)
    evidence = layer_evidence(explain_atlas, 0, range(0, 256, 16), seed=0, held_out=0.5)
    counts = []
    for row in scored.itertuples():
        [side] = evidence[row.neuron]
        quiet = quiet_examples(side.part(held_out=True))
        assert row.detection_n_quiet == len(quiet) and {e.band for e in quiet} <= {"random", "below"}
        assert set(e.code for e in quiet) <= set(row.detection_codes)
        counts.append(frozenset(e.code for e in quiet))
    assert len(set(counts)) > len(counts) // 2  # not one shared set: below-threshold bin samples are the side's own
    assert any(any(e.band == "below" for e in quiet_examples(evidence[n][0].part(held_out=True))) for n in evidence)
    strict = kvmem.score(explain_atlas, scorers="detection", n_boot=50, min_quiet=10_000)
    assert (strict.detection_status == "few-quiet").all() and strict.detection.isna().all()
    assert strict.detection_p.isna().all() and (strict.detection_n_quiet == scored.detection_n_quiet).all()
    assert score_table(strict).status.eq("few-quiet").all()


def test_output_side_split_and_scored(explain_atlas):
    from kvmem.autointerp.token_rules import Rule

    rows = kvmem.explain(explain_atlas, neurons=[(0, n) for n in range(0, 256, 8)])
    evidence = layer_evidence(explain_atlas, 0, range(0, 256, 8), seed=0, held_out=0.5)
    for row in rows.itertuples():
        [side] = evidence[row.neuron]
        rule = Rule.from_json(row.rule)
        values = explain_atlas.values(0, row.neuron, convention=explain_atlas.default_convention)
        promoted = values[values.kind == "promote"].sort_values("rank")
        held_ids = {t.id for t in side.held_writes}
        # the explainer saw the explain half only: its text and rule name none of the held-out written tokens
        assert not held_ids & set(promoted.token_id[promoted.token.isin(side.writes)])
        assert len(held_ids) + len(side.writes) == len(promoted) and 0 < len(held_ids) < len(promoted)
        assert all(repr(t) not in row.text for t in {t.token for t in side.held_writes} - set(side.writes))
        assert set(rule.writes) <= {w.strip().lower() or w for w in side.writes}
    scored = kvmem.score(explain_atlas, scorers="output", n_boot=100)
    assert (scored.output_n == [len(e[0].held_writes) + len(e[0].held_opposes) for e in
                                (evidence[n] for n in scored.neuron)]).all()
    assert scored.output.between(0, 1).all() and scored.output_p.between(0, 1).all()
    assert (scored.output_codes.map(len) == scored.output_n).all()


def test_protocols_through_score(explain_atlas):
    kvmem.explain(explain_atlas, neurons=[(0, n) for n in range(0, 256, 16)])
    delphi = kvmem.score(explain_atlas, scorers="detection,fuzzing", protocol="delphi", n_boot=50)
    assert (delphi.detection_protocol == "delphi").all() and (delphi.fuzzing_protocol == "delphi").all()
    metrics = [json.loads(m) for m in delphi.detection_metrics]
    assert all({"f1", "precision", "recall", "auc"} <= set(m) for m in metrics)
    ne = kvmem.score(explain_atlas, scorers="simulation", protocol="neuron-explainer", n_boot=50)
    assert (ne.simulation_protocol == "neuron-explainer").all()
    assert (ne.simulation_n % 2 == 0).all()  # top and random records 1:1
    assert "rsquared" in json.loads(ne.simulation_metrics[0])
    with pytest.raises(kvmem.errors.KvmemError, match="unknown protocol 'openai'; choose one of kvmem, delphi"):
        kvmem.score(explain_atlas, protocol="openai")


def test_intervention_scorer_steers_the_real_model_and_leaves_it_as_it_was(explain_atlas):
    import torch

    model = kvmem.load_model(explain_atlas.manifest.model["name"], device="cpu")
    ids = torch.tensor([model.encode("The cat sat on the mat because")])
    from kvmem.intervention import greedy_continuation

    greedy_continuation(model, "The", max_new_tokens=1)  # generation runs the TransformerLens bridge: its own hooks

    def hooked():
        return sorted(n for n, m in model.hf_model.named_modules() if m._forward_hooks or m._forward_pre_hooks)

    bridge_hooks = hooked()
    with torch.no_grad():
        before = model.hf_model(ids).logits.clone()
    kvmem.explain(explain_atlas, neurons=[(0, 3), (0, 5), (0, 7)])
    scored = kvmem.score(explain_atlas, scorers=["detection", "intervention"], neurons=[(0, 3), (0, 5), (0, 7)],
                         model=model, n_boot=50)
    assert (scored.intervention_n > 0).all() and scored.intervention.between(0, 1).all()
    # the store holds each row once, with both the array path's detection and the per-side intervention
    key = ["layer", "neuron", "side", "explainer"]
    stored = store.read(explain_atlas.path).merge(scored[key], on=key)
    assert len(stored) == len(scored) and not stored.duplicated(key).any()
    mine = scored.sort_values(key).reset_index(drop=True)
    stored = stored.sort_values(key).reset_index(drop=True)
    for column in ("detection", "detection_n", "intervention", "intervention_n", "intervention_metrics"):
        pd.testing.assert_series_equal(stored[column], mine[column], check_dtype=False)
    metrics = [json.loads(m) for m in scored.intervention_metrics]
    assert all(m["decided"] <= m["changed"] <= n for m, n in zip(metrics, scored.intervention_n))
    with torch.no_grad():
        assert torch.equal(model.hf_model(ids).logits, before)  # no edit outlives the scorer
    assert hooked() == bridge_hooks


def test_embedding_scorer_with_the_offline_minilm(explain_atlas, tmp_path):
    from kvmem.autointerp.embedder import default_embedder_dir, load_embedder

    embedder = load_embedder()
    assert embedder.name == str(default_embedder_dir())
    similar = embedder.similarity("a cat sat on the mat", ["the cat is on the mat", "import numpy as np"])
    assert similar[0] > similar[1]
    user = tmp_path / "mine.csv"
    pd.DataFrame({"layer": [0, 0], "neuron": [1, 2], "side": ["positive"] * 2,
                  "text": ["Python keywords", "punctuation"]}).to_csv(user, index=False)
    scored = kvmem.score(explain_atlas, explanations=user, scorers="embedding", n_boot=100)
    assert scored.embedding.between(0, 1).all() and scored.embedding_judge.str.startswith("embedder ").all()
    assert (scored.embedding_low <= scored.embedding).all() and scored.embedding_p.between(0, 1).all()


def test_tidy_view_and_neuron_population(explain_atlas, capsys):
    kvmem.explain(explain_atlas, neurons=[(0, n) for n in range(0, 256, 16)])
    wide = kvmem.score(explain_atlas, scorers="detection,simulation,output", n_boot=50, baseline="random-init")
    tidy = explain_atlas.explanation_scores()
    assert len(tidy) == 3 * len(wide) and set(tidy.scorer) == {"detection", "simulation", "output"}
    row = tidy[(tidy.neuron == 16) & (tidy.scorer == "detection")].iloc[0]
    source = wide[wide.neuron == 16].iloc[0]
    assert (row.score, row.p, row.n, row.baseline) == (source.detection, source.detection_p, source.detection_n,
                                                       source.detection_baseline)
    assert set(tidy[tidy.scorer == "output"].aspect) == {"output"}
    assert main(["neuron", "--atlas", str(explain_atlas.path), "0:16"]) == 0
    out = capsys.readouterr().out
    assert f"random-init layer population ({len(wide)} sides)" in out and "this score beats" in out
    assert f"random-init {source.detection_random_init:.2f}" not in out  # never the row's own random-init number
    assert store.read(explain_atlas.path).detection_random_init.notna().all()


def test_scan_random_samples_flag(gpt2_dir, tmp_path, capsys):
    from kvmem.scanning.config import ScanConfig

    corpus = tmp_path / "c.txt"
    corpus.write_text("The cat sat on the mat. " * 40)
    out = tmp_path / "atlas"
    assert main(["scan", "--model", str(gpt2_dir), "--corpus", str(corpus), "--out", str(out), "--max-tokens", "200",
                 "--layers", "0", "--random-samples", "7", "--quiet"]) == 0
    atlas = kvmem.open(out)
    assert atlas.manifest.scan["random_samples"] == 7
    assert atlas.table("samples", ["kind", "doc", "pos"]).query("kind == 'random'")[["doc", "pos"]] \
        .drop_duplicates().shape[0] == 7
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main(["scan", "--help"])
    assert f"(default {ScanConfig.random_samples};" in " ".join(capsys.readouterr().out.split())
