"""The bundled real-text fixture reads as a corpus and matches its documented provenance."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import kvmem
from kvmem.corpus import open_corpus

FIXTURE = Path(__file__).resolve().parent.parent / "data" / "pydoc-sample.jsonl"


def regenerate() -> list[dict]:
    """How the fixture was made (on CPython 3.11.7; other versions may differ slightly)."""
    from pydoc_data.topics import topics

    keys = ["assert", "assignment", "augassign", "break", "class", "continue", "dict", "for", "function", "if",
            "import", "lambda", "return", "while", "with", "yield", "raise", "try", "pass", "global"]
    records = []
    for key in keys:
        text = topics[key][:1500]
        records.append({"id": f"pydoc:{key}", "text": text[:text.rfind("\n")] if "\n" in text else text})
    return records


def test_fixture_reads_as_corpus():
    docs = list(open_corpus(FIXTURE))
    assert len(docs) == 20 and docs[0].id == "pydoc-sample.jsonl:1"
    records = [json.loads(line) for line in FIXTURE.read_text().splitlines()]
    assert [d.text for d in docs] == [r["text"] for r in records]
    assert records[0]["id"] == "pydoc:assert" and "assert" in records[0]["text"]
    sentences = list(open_corpus(FIXTURE, unit="sentence"))
    assert len(sentences) > 60


def test_fixture_scans(gpt2_model, tmp_path):
    atlas = kvmem.scan(gpt2_model, FIXTURE, out=tmp_path / "a", max_tokens=400, top_k=3, window=32, top_n=3,
                       context_activations=False, progress=False, skip_first=0)  # every token read is scored
    assert atlas.manifest.tokens == 400 and atlas.manifest.corpus["spec"].endswith("pydoc-sample.jsonl")


@pytest.mark.skipif(sys.version_info[:3] != (3, 11, 7), reason="the fixture was cut from CPython 3.11.7's pydoc topics")
def test_fixture_matches_its_provenance():
    records = [json.loads(line) for line in FIXTURE.read_text().splitlines()]
    assert records == regenerate()
