"""Is the model a working LM on the scanned text? Perplexity and next-token accuracy, per choice of BOS.

The text is cut by the scan's tokenization rule (:func:`~kvmem.experiments.forward.corpus_windows` under the scan's plan);
each window is read as ``[bos] + window`` (or the window alone with ``bos="none"``), and every
window token after its first is predicted from the tokens before it. The targets are therefore the
same for every BOS choice, so the rows of one call compare like with like. Logits are the model's
own (full final norm, W_U and b_U).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from kvmem.errors import KvmemError
from kvmem.experiments.argument_checks import check_positive
from kvmem.experiments.atlas_inputs import as_atlas, check_fingerprint, resolve_corpus
from kvmem.experiments.forward import corpus_windows, scan_plan
from kvmem.experiments.result_provenance import provenance
from kvmem.experiments.stats import bootstrap_ci

if TYPE_CHECKING:
    from kvmem.atlas import Atlas
    from kvmem.models import Model

__all__ = ["QUALITY_COLUMNS", "lm_quality", "resolve_bos"]

QUALITY_COLUMNS = {
    "bos": "the BOS choice as given (default: the model's scanning BOS; none: no BOS)",
    "bos_token_id": "its token id (-1: none)",
    "bos_token": "its text ('' for none)",
    "windows": "windows read",
    "predictions": "tokens predicted (every window token after the window's first)",
    "nll": "mean negative log-likelihood of the true next token (nats)",
    "perplexity": "exp(nll)",
    "accuracy": "fraction of predictions whose argmax is the true next token",
    "accuracy_ci_low": "bootstrap 95% interval of accuracy over windows (low end)",
    "accuracy_ci_high": "its high end",
}


def resolve_bos(model: Model, bos: Any) -> int | None:
    """A BOS choice as a token id: ``"default"`` (the model's scanning BOS), ``"none"``, a token string or an id."""
    if bos == "default":
        return model.bos_token_id
    if bos is None or bos == "none":
        return None
    if isinstance(bos, (int, np.integer)) and not isinstance(bos, bool):
        if not 0 <= int(bos) < model.vocab_size:
            raise KvmemError(f"bos token id {bos} is out of range; this model has ids 0..{model.vocab_size - 1}")
        return int(bos)
    if isinstance(bos, str):
        token_id = model.tokenizer.convert_tokens_to_ids(bos)
        if token_id is None or model.tokenizer.convert_ids_to_tokens(int(token_id)) != bos:
            raise KvmemError(f"{bos!r} is not a single token of {model.name}'s vocabulary; pass a special token such "
                             f"as {model.tokenizer.all_special_tokens[:3]}, a token id, 'default' or 'none'")
        return int(token_id)
    raise KvmemError(f"bos must be 'default', 'none', a token string or an id, got {bos!r}")


def _window_scores(model: Model, windows: list[list[int]], bos: int | None, batch_tokens: int) -> tuple[list, list]:
    """Per window: (sum of NLL, number of correct argmax predictions) over its tokens 1..n-1."""
    import torch

    extra = 0 if bos is None else 1
    order = sorted(range(len(windows)), key=lambda w: len(windows[w]))
    nll = [0.0] * len(windows)
    correct = [0] * len(windows)
    start = 0
    while start < len(order):
        width = len(windows[order[start]]) + extra
        stop = start + 1
        while stop < len(order) and (stop - start + 1) * (len(windows[order[stop]]) + extra) <= batch_tokens:
            stop += 1
        batch = order[start:stop]
        width = max(len(windows[w]) for w in batch) + extra
        ids = torch.zeros((len(batch), width), dtype=torch.int64)  # [batch, pos]
        mask = torch.zeros((len(batch), width), dtype=torch.int64)
        for row, w in enumerate(batch):
            sequence = ([bos] if bos is not None else []) + list(windows[w])
            ids[row, :len(sequence)] = torch.tensor(sequence)
            mask[row, :len(sequence)] = 1
        with torch.inference_mode():
            logits = model.hf_model(input_ids=ids.to(model.device), attention_mask=mask.to(model.device)).logits
            for row, w in enumerate(batch):
                n = len(windows[w])
                if n < 2:
                    continue
                here = logits[row, extra:extra + n - 1].float()  # [n-1, vocab]: predictions of tokens 1..n-1
                target = ids[row, extra + 1:extra + n].to(here.device)  # [n-1]
                nll[w] = float(torch.nn.functional.cross_entropy(here, target, reduction="sum"))
                correct[w] = int((here.argmax(dim=1) == target).sum())
        start = stop
    return nll, correct


def lm_quality(model: Model, corpus: Any = None, *, atlas: Atlas | str | None = None,
               bos: Sequence[Any] | str | int | None = ("default",), window: int | None = None,
               max_tokens: int | None = None, unit: str = "document", batch_tokens: int = 2048, n_boot: int = 1000,
               seed: int = 0) -> pd.DataFrame:
    """Perplexity and next-token accuracy of ``model`` on the scanned text, one row per BOS choice.

    ``corpus``/``atlas``: the text (with an atlas: its corpus, window and token count are the
    defaults). ``bos``: one choice or several ("default", "none", a token string such as
    ``"<|endoftext|>"``, or an id); each row reads the same windows and predicts the same tokens.
    Columns :data:`QUALITY_COLUMNS`; provenance in ``frame.attrs``.
    """

    check_positive("batch_tokens", batch_tokens)
    check_positive("max_tokens", max_tokens, allow_none=True)
    choices = [bos] if isinstance(bos, (str, int)) or bos is None else list(bos)
    if not choices:
        raise KvmemError("bos names no choice; pass e.g. bos=('default', '<|endoftext|>')")
    atlas = as_atlas(atlas) if atlas is not None else None
    match = check_fingerprint(atlas, model) if atlas is not None else None
    corpus = resolve_corpus(atlas, corpus, unit)
    # the scan's windows (BOS varies below, so the plan is asked for with one position kept for it)
    plan = scan_plan(model, atlas=atlas, window=window, prepend_bos=True if atlas is None else None,
                     max_tokens=max_tokens)
    window = plan.window
    windows = [list(w.tokens) for w in corpus_windows(model, corpus, plan)]
    predictions = np.array([max(len(w) - 1, 0) for w in windows], np.float64)
    if predictions.sum() == 0:
        raise KvmemError("no window has two tokens: nothing to predict; pass more text")
    rows = []
    for choice in choices:
        token_id = resolve_bos(model, choice)
        nll, correct = _window_scores(model, windows, token_id, batch_tokens)
        nll, correct = np.asarray(nll), np.asarray(correct, np.float64)
        # accuracy is a ratio of sums over windows: resample windows, weight by their predictions
        low, high = bootstrap_ci(correct / np.maximum(predictions, 1), weights=predictions, n_boot=n_boot, seed=seed)
        mean_nll = float(nll.sum() / predictions.sum())
        rows.append({"bos": str(choice), "bos_token_id": -1 if token_id is None else token_id,
                     "bos_token": "" if token_id is None else model.tokenizer.convert_ids_to_tokens(token_id), "windows": len(windows),
                     "predictions": int(predictions.sum()), "nll": mean_nll, "perplexity": float(np.exp(mean_nll)),
                     "accuracy": float(correct.sum() / predictions.sum()), "accuracy_ci_low": low,
                     "accuracy_ci_high": high})
    frame = pd.DataFrame(rows, columns=list(QUALITY_COLUMNS))
    frame.attrs = provenance("lm_quality", model=model, atlas=atlas, corpus=corpus, settings={
        "window": window, "max_tokens": max_tokens, "bos": [str(c) for c in choices], "n_boot": n_boot, "seed": seed,
        "targets": "window tokens 1..n-1, each predicted from the tokens before it (and the BOS, if any)",
        "logits": "the model's own (full final norm, W_U, b_U)"})
    if match is not None:
        frame.attrs["fingerprint_match"] = match
    return frame
