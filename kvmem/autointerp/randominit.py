"""The random-init baseline: the same pipeline on a random-init copy of the scanned model.

The copy has the scanned model's config with fresh weights (``AutoModelForCausalLM.from_config``,
the architecture's own initialiser, under a torch seed hashed from ``seed``) and its tokenizer; it is
saved beside the atlas (``ATLAS.random-init.model``) and scanned with the manifest's settings and
corpus into the sibling atlas ``ATLAS.random-init``. The same neurons are explained there by the
same explainer and scored by the same scorers and judge; each trained row then carries the score
of its neuron side in the copy (``S_random_init``, with its interval). Neuron i of a random model
has nothing to do with neuron i of the trained one: compare distributions, not rows.
Both directories are reused when they exist and their records match (seed, source fingerprint).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from kvmem.errors import KvmemError

__all__ = ["random_init_atlas"]


def _model_dir(atlas, seed: int) -> Path:
    import torch
    from transformers import AutoModelForCausalLM

    from kvmem.atlas_origin import load_scanned_model

    target = atlas.path.with_name(atlas.path.name + ".random-init.model")
    stamp = {"source": atlas.manifest.model["name"], "fingerprint": atlas.manifest.model["fingerprint"], "seed": seed}
    record = target / "kvmem-random-init.json"
    if record.exists() and json.loads(record.read_text()) == stamp:
        return target
    model = load_scanned_model(atlas)
    # a seed of its own (not ``seed`` itself), so the copy never repeats a model made at random init with that seed
    torch.manual_seed(int(hashlib.sha256(f"kvmem random-init {seed}".encode()).hexdigest()[:15], 16))
    fresh = AutoModelForCausalLM.from_config(model.hf_model.config)
    fresh.save_pretrained(target)
    model.tokenizer.save_pretrained(target)
    record.write_text(json.dumps(stamp, indent=2) + "\n")
    return target


def random_init_atlas(atlas, *, seed: int = 0, corpus=None, progress: bool = False):
    """The sibling atlas of a random-init copy, scanned with ``atlas``'s settings (made once, then reused)."""
    import kvmem
    from kvmem.atlas import open_atlas
    from kvmem.atlas_origin import scanned_corpus

    sibling = atlas.path.with_name(atlas.path.name + ".random-init")
    directory = _model_dir(atlas, seed)
    if (sibling / "manifest.json").exists():
        opened = open_atlas(sibling)
        if opened.manifest.model["name"] == str(directory) and opened.manifest.scan == atlas.manifest.scan:
            return opened
    model = kvmem.load_model(directory, device="cpu", dtype=atlas.manifest.model.get("dtype"))
    settings = atlas.manifest.config.to_dict()
    try:
        documents = scanned_corpus(atlas, corpus)
    except KvmemError as error:
        raise KvmemError(f"the random-init baseline rescans the corpus: {error}") from None
    return kvmem.scan(model, documents, out=sibling, overwrite=True, progress=progress,
                      unit=atlas.manifest.corpus.get("unit", "document"), **settings)
