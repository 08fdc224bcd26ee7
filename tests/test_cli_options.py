"""The options several subcommands share (kvmem.cli.options): --layers parses the same way in scan, export and
experiment, and every bad value is one line on stderr."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

import kvmem
from kvmem.atlas import open_atlas
from kvmem.cli import main
from kvmem.cli.options import LAYERS_FORM, MAX_LAYER, parse_layers
from kvmem.errors import KvmemError

LAYERS = [  # text -> the layers it names, sorted, each once
    ("0", [0]),
    ("0,5,10-12", [0, 5, 10, 11, 12]),
    (" 3 , 1-2,2", [1, 2, 3]),
    ("4-4", [4]),
    ("1,1,0-1,1-1", [0, 1]),
    ("7-9,0", [0, 7, 8, 9]),
    (f"{MAX_LAYER}", [MAX_LAYER]),
]

BAD = [  # text -> the start of its one-line error
    ("", "--layers names no layer"),
    ("  ", "--layers names no layer"),
    ("a", "--layers expects"),
    ("1,,2", "--layers expects"),
    ("1,", "--layers expects"),
    ("1-", "--layers expects"),
    ("-1", "--layers expects"),
    ("1-2-3", "--layers expects"),
    ("1.5", "--layers expects"),
    ("1 2", "--layers expects"),
    ("\u0663", "--layers expects"),  # an Arabic-Indic digit: int() would take it
    ("5-3", "--layers: the range 5-3 runs backwards"),
    ("0-99999999999", "--layers: layer 99999999999 is out of range"),
]


@pytest.mark.parametrize(("text", "expected"), LAYERS)
def test_layers_are_sorted_and_unique(text, expected):
    assert parse_layers(text) == expected


def test_no_layers_option_means_every_layer():
    assert parse_layers(None) is None


@pytest.mark.parametrize(("text", "message"), BAD)
def test_bad_layers_are_one_line(text, message):
    start = time.perf_counter()
    with pytest.raises(KvmemError) as error:
        parse_layers(text)
    assert str(error.value).startswith(message) and "\n" not in str(error.value)
    assert time.perf_counter() - start < 1  # a huge range is refused, never expanded
    if message == "--layers expects":
        assert LAYERS_FORM in str(error.value)


def _one_error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.startswith("kvmem: error: ") and err.count("\n") == 1, err
    return err


COMMANDS = {  # command -> its arguments but --layers (the atlas and model are filled in by the test)
    "scan": ["scan", "--model", "{model}", "--corpus", "{corpus}", "--out", "{out}", "--max-tokens", "40",
             "--window", "16", "--quiet"],
    "export": ["export", "--atlas", "{atlas}", "--format", "neuron-explainer", "--out", "{out}", "--no-quantiles",
               "--no-progress"],
    "experiment": ["experiment", "agreement", "--atlas", "{atlas}", "--out", "{out}.csv"],
}


@pytest.fixture(scope="module")
def small_atlas(gpt2_model, tmp_path_factory):
    """Seven short documents with their context coefficients stored (an export needs no model)."""
    from conftest import SHORT_DOCS

    return kvmem.scan(gpt2_model, SHORT_DOCS, out=tmp_path_factory.mktemp("cli") / "atlas", top_k=2, window=8,
                      top_n=3, progress=False)


def _argv(command, layers, *, gpt2_dir, corpus_file, atlas, out):
    fill = {"model": str(gpt2_dir), "corpus": str(corpus_file), "atlas": str(atlas.path), "out": str(out)}
    return [part.format(**fill) for part in COMMANDS[command]] + ["--layers", layers]


MISSING = {  # command -> how it says that layer 2 does not exist (checked against its model or atlas)
    "scan": "layer(s) [2] out of range; this model has layers 0..1",
    "export": "layer 2 is not in this atlas",
    "experiment": "layer(s) [2] not in atlas",
}


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_command_reads_layers_alike(command, gpt2_dir, corpus_file, small_atlas, tmp_path, capsys):
    import pandas as pd

    def run(layers, name):
        out = tmp_path / name
        return main(_argv(command, layers, gpt2_dir=gpt2_dir, corpus_file=corpus_file, atlas=small_atlas,
                          out=out)), out

    for text, message in BAD:
        code, out = run(text, "bad")
        assert code == 2 and message in _one_error(capsys), text
        assert not out.exists() and not out.with_name("bad.csv").exists()
    code, _ = run("2", "missing")  # the tiny GPT-2 and its atlas have layers 0 and 1
    assert code == 2 and MISSING[command] in _one_error(capsys)

    code, out = run("1,1-1", "one")
    assert code == 0, capsys.readouterr().err
    if command == "scan":
        assert open_atlas(out).layers == [1]
    elif command == "export":
        written = sorted(p.relative_to(out / "neurons").as_posix() for p in (out / "neurons").glob("*/*.json"))
        assert written == sorted(f"1/{n}.json" for n in range(small_atlas.manifest.model["d_ff"]))
    else:
        assert set(pd.read_csv(out.with_name("one.csv")).layer) == {1}


# ---- --batch-size: windows, a token budget, or auto ----
@pytest.mark.parametrize(("given", "parsed"), [(8, 8), ("8", 8), ("4096t", "4096 tokens"), ("4096 tokens", "4096 tokens"),
                                               ("4_096tok", "4096 tokens"), ("AUTO", "auto")])
def test_batch_size_forms(given, parsed):
    from kvmem.plan import parse_batch_size

    assert parse_batch_size(given) == parsed


@pytest.mark.parametrize("bad", [0, -1, "0", "1.5", "many", "0 tokens", "t", True, 2.0])
def test_bad_batch_size_is_one_line(bad):
    from kvmem.scanning.config import ScanConfig

    with pytest.raises(KvmemError, match=r"batch size must be an integer >= 1 .* or 'auto'; got") as error:
        ScanConfig(batch_size=bad)
    assert "\n" not in str(error.value)


def test_token_budget_and_cpu_auto_resolve_to_whole_windows(gpt2_model, tmp_path):
    """'N tokens' is the whole windows within N padded positions (at least one); 'auto' on a CPU is 2048
    tokens. The plan (and the manifest) record the number, and the tables equal those of that number given
    as an int."""
    from kvmem.scanning.config import ScanConfig
    from kvmem.scanning.runner import resolve_batch_size

    for spec, window, windows in (("1000 tokens", 256, 3), ("100 tokens", 256, 1), ("auto", 32, 64), ("auto", 256, 8)):
        assert resolve_batch_size(gpt2_model, ScanConfig(batch_size=spec), window) == windows
    settings = dict(max_tokens=600, window=32, top_k=3, top_n=2, progress=False)
    by_budget = kvmem.scan(gpt2_model, "pydoc", out=tmp_path / "budget", batch_size="100 tokens", **settings)
    by_count = kvmem.scan(gpt2_model, "pydoc", out=tmp_path / "count", batch_size=3, **settings)
    assert by_budget.manifest.plan.batch_size == 3
    for table in ("triggers", "histograms", "neurons"):
        assert (by_budget.path / f"{table}.parquet").read_bytes() == (by_count.path / f"{table}.parquet").read_bytes()


ONE_COMMAND = """
import json, sys
from kvmem.cli import build_parser
argv = ["--debug", "scan", "--model", "m", "--corpus", "c", "--out", "o"]
args = build_parser(argv).parse_args(argv)
print(json.dumps({"model": args.model, "debug": args.debug,
                  "imported": sorted(m for m in sys.modules if m.startswith(("kvmem.cli.", "kvmem.autointerp")))}))
"""


def test_a_command_line_imports_only_the_module_of_its_command():
    done = subprocess.run([sys.executable, "-c", ONE_COMMAND], capture_output=True, text=True, timeout=120, check=True)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["model"] == "m" and result["debug"] is True
    assert "kvmem.cli.scan_cmd" in result["imported"]
    assert not [m for m in result["imported"] if m.startswith(("kvmem.cli.explain_cmd", "kvmem.autointerp"))]


def test_every_command_is_listed_and_a_named_one_parses_in_full(capsys):
    from kvmem.cli import COMMANDS, build_parser

    with pytest.raises(SystemExit):
        main(["--help"])
    listing = capsys.readouterr().out
    assert all(name in listing for name in COMMANDS)
    with pytest.raises(SystemExit) as bad:
        build_parser(["bogus"]).parse_args(["bogus"])
    assert bad.value.code == 2 and "invalid choice: 'bogus'" in capsys.readouterr().err
    args = build_parser(["score", "--atlas", "a"]).parse_args(["score", "--atlas", "a"])
    assert args.scorers == "detection,fuzzing,simulation,output" and args.baseline is None  # its own defaults
