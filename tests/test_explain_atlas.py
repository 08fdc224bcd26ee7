"""Explanations on a real (tiny) atlas: storage and merge, the token rules of a context-free layer, the CLI,
a user's file and its bad inputs, reports, and the resume of a killed run (a real SIGKILL)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest

import kvmem
from kvmem.autointerp import store
from kvmem.autointerp.token_rules import Rule
from kvmem.cli import main
from kvmem.errors import KvmemError

ROOT = Path(__file__).resolve().parents[1]


def test_explain_writes_typed_rows_and_merges_without_rewriting(explain_atlas):
    first = kvmem.explain(explain_atlas, neurons=[(0, n) for n in range(6)])
    assert len(first) == 6 and set(first.side) == {"positive"}  # GELU: one side
    table = pq.read_table(explain_atlas.path / store.FILE)
    assert table.schema.equals(store.arrow_schema())
    entry = json.loads((explain_atlas.path / "manifest.json").read_text())["explanations"]
    assert entry["rows"] == 6 and entry["explainers"] == ["tokens"] and entry["file"] == store.FILE
    kvmem.open(explain_atlas.path)  # the manifest still opens
    before = store.read(explain_atlas.path)
    kvmem.score(explain_atlas, n_boot=50)
    scored = store.read(explain_atlas.path)
    kvmem.explain(explain_atlas, neurons=[(0, n) for n in range(4, 10)])
    after = store.read(explain_atlas.path)
    assert sorted(after.neuron) == list(range(10))
    pd.testing.assert_frame_equal(after[after.neuron < 6].reset_index(drop=True), scored)  # nothing rewritten
    assert np.isnan(after[after.neuron >= 6].detection).all()
    for row in before.itertuples():  # the explainer never saw a held-out example
        held = set(scored.detection_codes[row.Index]) | set(scored.simulation_codes[row.Index])
        assert held and not held & set(row.explain_codes)
    assert len(explain_atlas.explanations(0, 3)) == 1
    pattern = Rule.from_json(after.rule[0]).tokens[0]
    hits = explain_atlas.search_explanations(re.escape(json.dumps(pattern)))
    assert len(hits) >= 1 and 0 in set(hits.neuron)


def test_context_free_layer_gets_current_token_rules_above_baseline(explain_atlas):
    rows = kvmem.explain(explain_atlas, neurons=[(0, n) for n in range(0, 256, 4)])
    kinds = rows.rule.map(lambda r: json.loads(r)["kind"])
    # layer 0 sees only the current token: a current-token rule fits best for most neurons
    assert (kinds == "current_token").mean() >= 0.7
    scored = kvmem.score(explain_atlas, n_boot=100)
    for name in ("detection", "simulation"):
        lift = scored[name] - scored[f"{name}_baseline"]
        assert lift.mean() > 0.1, (name, lift.describe())
        assert ((scored[f"{name}_low"] <= scored[name]) & (scored[name] <= scored[f"{name}_high"])).all()
    assert abs(scored.detection_baseline.mean() - 0.5) < 0.06
    borrowed = scored.detection_baseline_from
    assert (borrowed != scored.neuron).all() and sorted(borrowed) == sorted(scored.neuron)  # a derangement


def test_cli_explain_score_and_neuron_report(explain_atlas, capsys):
    path = str(explain_atlas.path)
    assert main(["explain", "--atlas", path, "--neurons", "0:1,0:2", "--no-progress"]) == 0
    assert main(["score", "--atlas", path, "--scorers", "detection,simulation", "--n-boot", "50",
                 "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "2 explanation(s) by tokens" in out and re.search(r"detection: mean [0-9.]+ over 2 side\(s\)", out)
    assert main(["neuron", "--atlas", path, "0:1"]) == 0
    out = capsys.readouterr().out
    row = explain_atlas.explanations(0, 1).iloc[0]
    assert row.text in out and f"detection {row.detection:.2f} [{row.detection_low:.2f}, {row.detection_high:.2f}]" in out


def _cli_error(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    return err


def test_user_file_scored_and_bad_inputs_one_line_each(explain_atlas, tmp_path, capsys):
    path = str(explain_atlas.path)
    good = tmp_path / "mine.csv"
    rule = Rule(kind="current_token", tokens=("the",)).to_json()
    pd.DataFrame({"layer": [0], "neuron": [5], "side": ["positive"], "text": ["the word the"],
                  "rule": [rule]}).to_csv(good, index=False)
    rows = kvmem.score(explain_atlas, explanations=good, scorers="detection", n_boot=50)
    assert rows.explainer.tolist() == ["user:mine.csv"] and 0 <= rows.detection[0] <= 1
    assert explain_atlas.explanations(explainer="user:mine.csv").text.tolist() == ["the word the"]

    unknown = tmp_path / "unknown.jsonl"
    unknown.write_text(json.dumps({"layer": 7, "neuron": 1, "side": "positive", "text": "x"}) + "\n")
    err = _cli_error(capsys, ["score", "--atlas", path, "--explanations", str(unknown)])
    assert "row 1 names neuron 7:1, which is not in the atlas" in err
    missing = tmp_path / "missing.csv"
    pd.DataFrame({"layer": [0], "neuron": [1], "text": ["x"]}).to_csv(missing, index=False)
    assert "lacks column(s) side" in _cli_error(capsys, ["score", "--atlas", path, "--explanations", str(missing)])
    empty = tmp_path / "empty.parquet"
    pd.DataFrame({"layer": [0, 0], "neuron": [1, 2], "side": ["positive"] * 2, "text": ["x", "  "]}).to_parquet(empty)
    assert "row 2 (0:2 positive) has an empty text" in _cli_error(
        capsys, ["score", "--atlas", path, "--explanations", str(empty)])
    free = tmp_path / "free.csv"
    pd.DataFrame({"layer": [0], "neuron": [1], "side": ["positive"], "text": ["fires on nouns"]}).to_csv(free, index=False)
    assert "has no rule" in _cli_error(capsys, ["score", "--atlas", path, "--explanations", str(free)])
    assert "say which neurons" in _cli_error(capsys, ["explain", "--atlas", path])
    assert "--all) means every neuron of the atlas; drop it" in _cli_error(
        capsys, ["explain", "--atlas", path, "--all", "--layers", "0"])
    assert "unknown explainer 'gpt'" in _cli_error(capsys, ["explain", "--atlas", path, "--all", "--explainer", "gpt"])
    with pytest.raises(KvmemError, match="unknown baseline"):
        kvmem.score(explain_atlas, explanations=good, baseline="shuffled")
    assert "max_quiet must be an integer >= 1, got 0" in _cli_error(
        capsys, ["score", "--atlas", path, "--explanations", str(good), "--max-quiet", "0"])
    with pytest.raises(KvmemError, match="per_band must be an integer >= 1"):
        kvmem.score(explain_atlas, explanations=good, per_band=0)


def test_killed_explain_resumes_and_matches_a_clean_run(explain_atlas, tmp_path):
    import shutil

    clean = tmp_path / "clean"
    shutil.copytree(explain_atlas.path, clean)
    kvmem.explain(clean, layers=[0])
    expected = store.read(clean)
    code = (f"import kvmem; kvmem.explain({str(explain_atlas.path)!r}, layers=[0], chunk=4, store_every=0)")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    child = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    target = explain_atlas.path / store.FILE
    deadline = time.time() + 120
    while time.time() < deadline and child.poll() is None:
        if target.exists() and 8 <= len(store.read(explain_atlas.path)) < 200:
            break
        time.sleep(0.05)
    assert child.poll() is None, child.stderr.read().decode()[-2000:]
    child.send_signal(signal.SIGKILL)
    child.wait()
    partial = store.read(explain_atlas.path)
    assert 0 < len(partial) < 256
    done = expected[expected.neuron.isin(partial.neuron)].reset_index(drop=True)
    pd.testing.assert_frame_equal(partial, done)  # what was written before the kill is complete and right
    kvmem.explain(explain_atlas, layers=[0])
    pd.testing.assert_frame_equal(store.read(explain_atlas.path), expected)


def test_rows_stored_at_the_end_equal_rows_stored_after_every_chunk(explain_atlas, tmp_path):
    """The default stores the rows when the command ends (or 20 s have passed): the same file as storing after
    every chunk of 4 neurons, merged by key."""
    import shutil

    every, end = tmp_path / "every", tmp_path / "end"
    shutil.copytree(explain_atlas.path, every)
    shutil.copytree(explain_atlas.path, end)
    kvmem.explain(every, layers=[0], chunk=4, store_every=0)
    kvmem.explain(end, layers=[0], chunk=4)
    assert len(store.read(end)) > 8
    pd.testing.assert_frame_equal(store.read(end), store.read(every))
    with pytest.raises(KvmemError, match="store_every must be a number of seconds >= 0, got -1"):
        kvmem.explain(end, layers=[0], store_every=-1)


def test_reads_while_another_process_rewrites_never_see_a_mixed_file(explain_atlas):
    """A writer process replaces explanations.parquet by rename in a loop; every read here sees one whole
    table (pyarrow's own path reader opens the file twice and fails on about a quarter of such reads)."""
    kvmem.explain(explain_atlas, neurons=[(0, n) for n in range(40)])
    rows = store.read(explain_atlas.path)
    code = ("import sys, kvmem\nfrom kvmem.autointerp import store\n"
            f"frame = store.read({str(explain_atlas.path)!r})\n"
            "print('ready', flush=True)\n"
            "for i in range(100000):\n"
            "    store.write(" f"{str(explain_atlas.path)!r}" ", frame.iloc[: 1 + i % len(frame)])\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    child = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert child.stdout.readline().strip() == b"ready", child.stderr.read().decode()[-2000:]
        seen, deadline = set(), time.time() + 4
        while time.time() < deadline:
            frame = store.read(explain_atlas.path)
            pd.testing.assert_frame_equal(frame, rows.iloc[: len(frame)].reset_index(drop=True))
            seen.add(len(frame))
        assert child.poll() is None, child.stderr.read().decode()[-2000:]
        assert len(seen) > 3  # the writer really was replacing the file under the reads
    finally:
        child.kill()
        child.wait()


def test_reports_and_neuron_explainer_export_carry_explanations(explain_atlas, tmp_path):
    import html as html_lib

    from kvmem.export import export_atlas
    from kvmem.report import export_neuron

    kvmem.explain(explain_atlas, neurons=[(0, 1), (0, 2)])
    kvmem.score(explain_atlas, scorers="detection,simulation", n_boot=50)
    row = explain_atlas.explanations(0, 1).iloc[0]
    data = json.loads(export_neuron(explain_atlas, 0, 1, format="json", out=tmp_path / "r").read_text())
    [entry] = data["explanations"]
    assert entry["text"] == row.text and entry["side"] == "positive" and json.loads(entry["rule"]) == json.loads(row.rule)
    detection = entry["scores"]["detection"]
    assert (detection["score"], detection["low"], detection["high"]) == pytest.approx(
        (row.detection, row.detection_low, row.detection_high))
    assert detection["baseline_from"] == 2 and set(entry["scores"]) == {"detection", "simulation"}
    interval = f"{row.detection:.2f} [{row.detection_low:.2f}, {row.detection_high:.2f}]"
    page = export_neuron(explain_atlas, 0, 1, format="html", out=tmp_path / "r").read_text()
    assert "<h2>Explanations</h2>" in page and interval in page
    assert html_lib.unescape(page).count(row.text) == 2  # one table row per scorer
    markdown = export_neuron(explain_atlas, 0, 1, format="md", out=tmp_path / "r").read_text()
    assert "## Explanations" in markdown and interval in markdown
    out = export_atlas(explain_atlas, out=tmp_path / "ne", neurons=[(0, 1), (0, 3)], quantiles=False)
    sidecar = json.loads((out / "kvmem" / "0" / "1.json").read_text())
    assert sidecar["explanations"][0]["scores"]["simulation"]["score"] == pytest.approx(row.simulation)
    assert json.loads((out / "kvmem" / "0" / "3.json").read_text())["explanations"] == []


def test_random_init_baseline_scans_a_sibling_and_scores_it(explain_atlas):
    import torch
    from transformers import AutoModelForCausalLM

    kvmem.explain(explain_atlas, neurons=[(0, n) for n in range(4)])
    rows = kvmem.score(explain_atlas, scorers="detection", baseline="random-init", n_boot=50)
    sibling = kvmem.open(explain_atlas.path.with_name(explain_atlas.path.name + ".random-init"))
    assert sibling.manifest.scan == explain_atlas.manifest.scan and sibling.manifest.tokens == explain_atlas.manifest.tokens
    trained = AutoModelForCausalLM.from_pretrained(explain_atlas.manifest.model["name"])
    fresh = AutoModelForCausalLM.from_pretrained(sibling.manifest.model["name"])
    assert trained.config.to_dict() == {**fresh.config.to_dict(), "_name_or_path": trained.config._name_or_path}
    assert not torch.equal(trained.transformer.h[0].mlp.c_fc.weight, fresh.transformer.h[0].mlp.c_fc.weight)
    theirs = sibling.explanations(explainer="tokens").set_index("neuron")
    assert len(theirs) == 4
    for row in rows.itertuples():
        assert row.detection_random_init == pytest.approx(theirs.detection[row.neuron])
        assert row.detection_random_init_low <= row.detection_random_init <= row.detection_random_init_high
    assert store.read(explain_atlas.path).detection_random_init.notna().all()


def test_layer_reads_equal_the_per_neuron_queries(explain_atlas):
    from kvmem.autointerp.bulk import layer_evidence
    from kvmem.autointerp.evidence import load_evidence

    neurons = [0, 5, 63, 64, 200, 255]  # across row groups
    bulk = layer_evidence(explain_atlas, 0, neurons, seed=3, held_out=0.4)
    for n in neurons:
        assert bulk[n] == load_evidence(explain_atlas, 0, n, seed=3, held_out=0.4)
        assert len(bulk[n][0].examples) > 20
