"""The hf: backend on a tiny local chat model: its answers are plain transformers greedy generation with the chat
template, journaled, and usable as explainer and judge."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import kvmem
from kvmem.autointerp.api import JOURNAL
from kvmem.autointerp.evidence import load_evidence
from kvmem.autointerp.explainers.llm import explain_messages
from kvmem.autointerp.prompts import PROMPTS, parse_explanation


def test_hf_explainer_matches_plain_generation(explain_atlas, tiny_chat_dir):
    rows = kvmem.explain(explain_atlas, neurons=[(0, 7), (0, 9)], explainer=f"hf:{tiny_chat_dir}")
    assert rows.prompt_hash.tolist() == [PROMPTS["explain"].hash] * 2
    assert all(f.startswith("sha256:") for f in rows.explainer_fingerprint)
    tokenizer = AutoTokenizer.from_pretrained(tiny_chat_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_chat_dir).eval()
    for row in rows.itertuples():
        [side] = load_evidence(explain_atlas, row.layer, row.neuron)
        messages, codes = explain_messages(side)
        assert list(row.explain_codes) == list(codes)
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        with torch.no_grad():
            out = model.generate(**ids, max_new_tokens=64, do_sample=False)
        text = tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True).strip()
        assert row.text == (parse_explanation(text) or "(the model gave no explanation)")
    assert len((explain_atlas.path / JOURNAL).read_text().splitlines()) == 2


def test_hf_judge_scores_detection(explain_atlas, tiny_chat_dir):
    kvmem.explain(explain_atlas, neurons=[(0, 7)])
    scored = kvmem.score(explain_atlas, scorers="detection", judge=f"hf:{tiny_chat_dir}", neurons=[(0, 7)],
                         per_band=2, n_boot=50)
    assert 0 <= scored.detection[0] <= 1 and scored.detection_judge[0].startswith(f"hf:{tiny_chat_dir} detection:1:")
