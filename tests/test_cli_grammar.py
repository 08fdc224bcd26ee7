"""One command-line grammar: ``--atlas`` on every command that reads an atlas, one parser for neuron and
layer lists, ids printed as they are typed back, ``--token`` text and ``--token-id`` ids, ``kvmem neuron``
printing what its help promises, checkpoints that say where they fall, and unknown model names that fail
fast with a suggestion. Each is checked through ``kvmem.cli.main`` or a real ``python -m kvmem`` process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from conftest import SHORT_DOCS

import kvmem
from kvmem.cli import COMMANDS, build_parser, main
from kvmem.cli.options import parse_neurons
from kvmem.cli.printing import format_table
from kvmem.errors import KvmemError

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def atlas(gpt2_model, tmp_path_factory):
    return kvmem.scan(gpt2_model, SHORT_DOCS, out=tmp_path_factory.mktemp("grammar") / "a", top_k=3, window=16,
                      top_n=4, progress=False)


def test_every_command_that_reads_an_atlas_takes_it_as_atlas():
    parser = build_parser()
    subparsers = next(a for a in parser._actions if a.dest == "command").choices
    positional_atlas, with_atlas = [], []
    for name in COMMANDS:
        actions = subparsers[name]._actions
        if any(a.dest == "atlas" and not a.option_strings for a in actions):
            positional_atlas.append(name)
        if any("--atlas" in a.option_strings for a in actions):
            with_atlas.append(name)
    assert positional_atlas == []
    assert {"info", "top", "neuron", "report", "export", "explain", "score", "experiment", "taxonomy"} <= set(with_atlas)


@pytest.mark.parametrize("text, expected", [
    ("3:17,5:2", [(3, 17), (5, 2)]), (["3:17", "5:2"], [(3, 17), (5, 2)]), ("3:17, 5:2", [(3, 17), (5, 2)]),
    ("3:10-12", [(3, 10), (3, 11), (3, 12)]), (["1:2,1:2", "1:2"], [(1, 2)]), ("0:1184", [(0, 1184)]),
])
def test_one_neuron_parser(text, expected):
    assert parse_neurons(text) == expected


@pytest.mark.parametrize("text, message", [
    ("3", "a neuron id is LAYER:NEURON"), ("3:", "expects neuron ids"), ("3:12-10", "runs backwards"),
    ("1,184", "a neuron id is LAYER:NEURON"), ("", "names no neuron"), ("a:b", "expects neuron ids"),
])
def test_bad_neuron_lists_are_one_line(text, message):
    with pytest.raises(KvmemError, match=message) as error:
        parse_neurons(text)
    assert "\n" not in str(error.value)


def test_neuron_lists_read_the_same_in_every_command(atlas, tmp_path, capsys):
    """explain, export, report and neuron take the same --neurons forms (commas and spaces)."""
    path = str(atlas.path)
    assert main(["neuron", "--atlas", path, "0:3,1:4"]) == 0
    shown = capsys.readouterr().out
    assert shown.count("Neuron 0:3") == 1 and shown.count("Neuron 1:4") == 1
    assert main(["report", "--atlas", path, "--neurons", "0:3", "1:4", "--format", "md", "--out", str(tmp_path / "r"),
                 "--no-progress"]) == 0
    assert sorted(p.name for p in (tmp_path / "r").glob("L*.md")) == ["L0_N3.md", "L1_N4.md"]
    assert main(["export", "--atlas", path, "--format", "neuron-explainer", "--out", str(tmp_path / "e"),
                 "--neurons", "0:3,1:4", "--no-quantiles", "--no-progress"]) == 0
    assert sorted(str(p.relative_to(tmp_path / "e")) for p in (tmp_path / "e").rglob("*.json")
                  if "kvmem" in p.parts) == ["kvmem/0/3.json", "kvmem/1/4.json"]
    capsys.readouterr()
    assert main(["explain", "--atlas", path, "--neurons", "0:3", "1:4", "--no-progress"]) == 0
    assert "explanation(s)" in capsys.readouterr().out
    assert set(map(tuple, atlas.explanations()[["layer", "neuron"]].to_numpy().tolist())) == {(0, 3), (1, 4)}


def test_ids_print_as_they_are_typed(atlas, capsys):
    table = format_table(pd.DataFrame({"layer": [20], "neuron": [1184], "count": [20000]}))
    assert "1184" in table and "1,184" not in table and "20000" in table
    assert main(["top", "--atlas", str(atlas.path), "--token-id", "13", "--by", "trigger"]) == 0
    out = capsys.readouterr().out
    ids = [line.split()[0] for line in out.splitlines()[1:]]
    assert ids and all(parse_neurons(i) for i in ids)  # every printed id pastes back into --neurons


def test_token_is_text_and_token_id_is_an_id(atlas, capsys):
    """--token 17 looks up the text '17', not token id 17; --token-id 17 is token 17 ('2')."""
    by_text = main(["top", "--atlas", str(atlas.path), "--token", "17"])
    err = capsys.readouterr().err
    assert by_text == 2 and "'17' is not a token seen in this atlas" in err
    assert main(["top", "--atlas", str(atlas.path), "--token-id", "17"]) == 0
    with pytest.raises(SystemExit) as stopped:  # one of the two is required: argparse's usage error
        main(["top", "--atlas", str(atlas.path)])
    assert stopped.value.code == 2
    assert "one of the arguments --token --token-id is required" in capsys.readouterr().err


def test_neuron_prints_its_key_projections(atlas, capsys):
    assert main(["neuron", "--atlas", str(atlas.path), "1:5"]) == 0
    out = capsys.readouterr().out
    keys = atlas.keys(1, 5)
    assert "key k (a row of W1 / W_up), tokens whose input embedding it matches most" in out
    assert "key key" not in out and "gate key g" not in out  # GPT-2 has no gate
    first = keys[keys.kind == keys.kind.iloc[0]].sort_values("rank").token.iloc[0]
    assert repr(first) in out


def test_checkpoints_say_where_they_fall(gpt2_dir, tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("\n".join(json.dumps({"text": d}) for d in SHORT_DOCS))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "kvmem", "scan", "--model", str(gpt2_dir), "--corpus", str(corpus),
                           "--out", str(tmp_path / "a"), "--checkpoint-every", "10", "--window", "16"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "checkpoints are saved at the end of a block of 64 documents once 10 tokens" in done.stderr


def test_an_unknown_model_fails_fast_with_a_suggestion(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "HF_HOME": str(tmp_path / "hf")}  # an empty HF cache: nothing to find offline
    done = subprocess.run([sys.executable, "-m", "kvmem", "anatomy", "smollm2-135"], capture_output=True, text=True,
                          env=env, timeout=120)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr  # no retry messages, no warnings: one line
    assert lines[0].startswith("kvmem: error: ") and "did you mean 'smollm2-135m'?" in lines[0]


def test_the_builtin_model_is_named_as_what_it_is():
    from kvmem.builtin import BUILTIN_ALIASES, BUILTIN_MODELS, SMOLLM2

    assert SMOLLM2 == "smollm2-135m-instruct-q4_1" and BUILTIN_ALIASES["smollm2-135m"] == SMOLLM2
    assert "Instruct" in BUILTIN_MODELS[SMOLLM2] and "Q4_1" in BUILTIN_MODELS[SMOLLM2]
    assert "dequantised" in BUILTIN_MODELS[SMOLLM2]
