"""Trace a prediction through the FFN layers: which memories build it, layer by layer.

For one position of one prompt, :func:`trace` reads every layer's coefficients m (``hook_post``)
and ranks the sub-updates m_i w_i by their weight |m_i|·‖w_i‖ (Geva et al. 2022), with w_i the
value as the neuron writes it into the residual (``Model.written_values``: v_i times a post-FFN
norm's gain and Granite's residual multiplier; the post-FFN norm's positive per-token 1/rms is left
out). Each written value is projected through the unembedding under a named convention
(:mod:`kvmem.conventions`) to show the tokens it promotes. The residual stream before and after each
FFN is read with the logit lens (``Model.logits``): the full final norm, W_U and b_U with every map
to the logits folded in, and Gemma-2's soft-cap, exactly as the model computes its real logits.

"Before the FFN" is the residual the FFN reads: ``hook_resid_mid`` in a serial block, and
``hook_resid_pre`` in a parallel block (GPT-J, Phi, GPT-NeoX with ``use_parallel_residual``), where
attention and FFN both read the block's input. "After" is that residual plus what the FFN writes
(``hook_resid_post`` in a serial block; in a parallel block, the block input plus the FFN's own
output, without attention's). Each trace records which in ``attrs["residual_before"]``.

Shapes use one vocabulary: ``layer``, ``d_model``, ``d_ff``, ``vocab``, ``pos``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvmem.capture import capture
from kvmem.conventions import DEFAULT_CONVENTION, convention_vectors, get_convention
from kvmem.errors import KvmemError

if TYPE_CHECKING:
    import pandas as pd
    from torch import Tensor

    from kvmem.models import Model

__all__ = [
    "LAYER_COLUMNS",
    "SUB_UPDATE_COLUMNS",
    "Trace",
    "plot_prediction_formation",
    "project",
    "trace",
]

SUB_UPDATE_COLUMNS: dict[str, str] = {
    "layer": "layer index",
    "rank": "1 = the heaviest sub-update of this layer at this position",
    "neuron": "neuron i of the layer (0..d_ff-1)",
    "coefficient": "m_i at hook_post (signed; gated FFNs have large negative ones)",
    "value_norm": "||w_i||, the written value (Model.written_values)",
    "weight": "|m_i| * ||w_i||",
    "weight_share": "weight / sum of all d_ff weights of the layer",
    "final_token_logit": "m_i * score of the final prediction under the convention: its direct push on that logit",
    "update_tokens": "top tokens of sign(m_i) * projection(w_i): what this sub-update actually promotes",
    "value_tokens": "top tokens of projection(w_i): what the value promotes when m_i > 0",
}

LAYER_COLUMNS: dict[str, str] = {
    "layer": "layer index",
    "top_before": "logit-lens top token of the residual the FFN reads (hook_resid_mid; hook_resid_pre in a "
                  "parallel block)",
    "top_before_id": "its token id",
    "top_before_prob": "its probability",
    "top_after": "logit-lens top token of that residual plus what the FFN writes (hook_resid_post in a serial "
                 "block)",
    "top_after_id": "its token id",
    "top_after_prob": "its probability",
    "changed": "the FFN changed the top prediction",
    "final_rank_before": "rank (1 = top) of the model's final prediction before the FFN",
    "final_prob_before": "its probability before the FFN",
    "final_rank_after": "rank of the final prediction after the FFN",
    "final_prob_after": "its probability after the FFN",
    "ffn_norm": "||what the FFN writes into the residual|| at the position",
}


@dataclass(frozen=True, repr=False)
class Trace:
    """Result of :func:`trace`.

    ``sub_updates``: one row per (layer, rank) sub-update, columns :data:`SUB_UPDATE_COLUMNS`.
    ``layers``: one row per layer, columns :data:`LAYER_COLUMNS`.
    ``attrs``: provenance (model, fingerprint, prompt, ``tokens`` and ``token_ids`` as the model read them,
    BOS included where ``bos``; ``position`` indexes them; convention, kvmem version); both frames carry a
    copy in ``frame.attrs``.
    """

    sub_updates: pd.DataFrame
    layers: pd.DataFrame
    attrs: dict[str, Any] = field(default_factory=dict)

    def plot(self, *, ax=None):
        """:func:`plot_prediction_formation` of this trace."""
        return plot_prediction_formation(self, ax=ax)

    def summary(self, *, per_layer: int = 3) -> pd.DataFrame:
        """The layer table with the ``per_layer`` heaviest sub-updates of each layer as one text column."""
        heavy = self.sub_updates[self.sub_updates["rank"] <= per_layer]
        if "update_tokens" in heavy:
            text = heavy.apply(lambda r: f"{r.neuron}({r.coefficient:+.2g}):{'|'.join(r.update_tokens[:2])}", axis=1)
        else:
            text = heavy.apply(lambda r: f"{r.neuron}({r.coefficient:+.2g})", axis=1)
        joined = text.groupby(heavy["layer"]).agg(" ".join) if len(heavy) else None
        table = self.layers[["layer", "top_before", "top_after", "changed", "final_prob_before", "final_prob_after"]]
        table = table.copy()
        table["memories"] = table["layer"].map(joined) if joined is not None else ""
        return table

    def _header(self) -> str:
        a = self.attrs
        return (f"Trace of {a.get('model')!r} at position {a.get('position')} ({a.get('position_token')!r}) -> "
                f"final prediction {a.get('final_token')!r}; convention={a.get('convention')}, "
                f"{len(self.layers)} layers, {len(self.sub_updates)} sub-updates")

    def __repr__(self) -> str:
        return self._header() + "\n" + self.summary().to_string(index=False)

    def _repr_html_(self) -> str:
        import html

        return f"<p>{html.escape(self._header())}</p>" + self.summary().to_html(index=False)


# ---- helpers ----
def _resolve_position(position: int, n_tokens: int) -> int:
    """Index into the prompt's own ``n_tokens`` tokens (negative: from the end) -> 0..n_tokens-1."""
    if isinstance(position, bool) or not isinstance(position, int):
        raise KvmemError(f"position must be an int, got {position!r}")
    if not -n_tokens <= position < n_tokens:
        raise KvmemError(f"position {position} is out of range for a {n_tokens}-token prompt; "
                         f"use -{n_tokens}..{n_tokens - 1}")
    return position % n_tokens


def _lens(model: Model, resid: Tensor) -> Tensor:
    """Logit lens: resid [layer, d_model] -> logits [layer, vocab] (``Model.logits``)."""
    return model.logits(resid)


def project(model: Model, vectors: Tensor, *, convention: str = DEFAULT_CONVENTION) -> Tensor:
    """Vocabulary scores of vectors [n, d_model] -> [n, vocab] under ``convention`` (no b_U)."""
    return convention_vectors(model, vectors, convention) @ model.unembedding().float()


def _capture(model: Model, ids: list[int], position: int) -> tuple[dict[str, Tensor], Tensor]:
    """One forward of the HF model; returns {hook name: activation at ``position`` [d]} and its own logits [vocab]."""
    import torch

    sites = ("post", "out", "resid_pre") if model.parallel_block else ("post", "resid_mid", "resid_post")
    names = [model.hook_name(layer, site) for layer in range(model.n_layers) for site in sites]
    tokens = torch.tensor([ids], device=model.device)  # [batch=1, pos]
    at = (torch.tensor([0]), torch.tensor([position]))
    captured = capture(model, tokens, names, positions=at, stop_early=False, logits_at=at)
    logits = captured.pop("logits")[0]  # [vocab]
    return {name: value[0] for name, value in captured.items()}, logits


def trace(model: Model, prompt: str | list[int], *, position: int = -1, top: int | None = 10,
          convention: str = DEFAULT_CONVENTION, n_tokens: int = 3, prepend_bos: bool | None = None) -> Trace:
    """Which memories build the prediction at ``position``, layer by layer.

    ``prompt``: text (encoded without special tokens) or token ids, read after the model's BOS token as
    a scan reads every window (:meth:`kvmem.models.Model.prompt_ids`; ``prepend_bos=False`` reads the
    prompt alone). ``position``: index into the prompt's own tokens (BOS not counted), negative from
    the end. ``top``: sub-updates kept per layer, by |m_i|·‖w_i‖
    (``None`` keeps all d_ff). ``convention``: how values
    are projected (:data:`kvmem.conventions.CONVENTIONS`). ``n_tokens``: tokens listed per value (0 skips the
    vocabulary projection, which is the slow part when ``top=None``).

    Sub-updates are m_i w_i with w_i the written value (``Model.written_values``); the residual
    before the FFN is the one it reads (see the module docstring; ``attrs["residual_before"]``).

    >>> t = trace(model, "The capital of France is", top=5)  # doctest: +SKIP
    >>> t.layers[["layer", "top_before", "top_after", "changed"]]  # doctest: +SKIP
    """
    import pandas as pd
    import torch

    import kvmem

    formula = get_convention(convention).formula
    if top is not None and (isinstance(top, bool) or not isinstance(top, int) or top < 1):
        raise KvmemError(f"top must be a positive int or None (all {model.d_ff} neurons), got {top!r}")
    if isinstance(n_tokens, bool) or not isinstance(n_tokens, int) or n_tokens < 0:
        raise KvmemError(f"n_tokens must be an int >= 0, got {n_tokens!r}")
    ids = model.prompt_ids(prompt, prepend_bos=prepend_bos)
    offset = int(prepend_bos is not False and model.bos_token_id is not None)  # BOS read first
    pos = offset + _resolve_position(position, len(ids) - offset)
    captured, final_logits = _capture(model, ids, pos)
    final_token = int(final_logits.argmax())
    k = model.d_ff if top is None else min(top, model.d_ff)
    strings: dict[int, str] = {}

    def token(i: int) -> str:
        if i not in strings:
            strings[i] = model.token_str(i)
        return strings[i]

    unembedding = model.unembedding().float().cpu()  # [d_model, vocab]; captured tensors are on the CPU
    rows, before, after, ffn_norms = [], [], [], []
    with torch.no_grad():
        for layer in range(model.n_layers):
            m = captured[model.hook_name(layer, "post")]  # [d_ff]
            if model.parallel_block:  # attention and FFN read the block input; no post-FFN norm or multiplier
                mid = captured[model.hook_name(layer, "resid_pre")]  # [d_model]
                post = mid + captured[model.hook_name(layer, "out")]  # [d_model]
            else:
                mid = captured[model.hook_name(layer, "resid_mid")]  # [d_model]
                post = captured[model.hook_name(layer, "resid_post")]  # [d_model]
            before.append(mid)
            after.append(post)
            ffn_norms.append(float((post - mid).norm()))
            values = model.written_values(layer).float().cpu()  # [d_ff, d_model]
            norms = values.norm(dim=1)  # [d_ff]
            weight = m.abs() * norms  # [d_ff]
            order = torch.topk(weight, k).indices  # [k], heaviest first
            converted = convention_vectors(model, values, convention)  # [d_ff, d_model]
            final_scores = converted @ unembedding[:, final_token]  # [d_ff]
            total = float(weight.sum()) or 1.0
            tokens_of: dict[str, list[list[str]]] = {"update_tokens": [], "value_tokens": []}
            if n_tokens:
                for chunk in order.split(256):
                    scores = converted[chunk] @ unembedding  # [chunk, vocab]
                    signed = scores * torch.where(m[chunk] < 0, -1.0, 1.0)[:, None]
                    for key, s in (("update_tokens", signed), ("value_tokens", scores)):
                        top_ids = s.topk(n_tokens, dim=1).indices.tolist()
                        tokens_of[key] += [[token(i) for i in row] for row in top_ids]
            for rank, neuron in enumerate(order.tolist()):
                row = {"layer": layer, "rank": rank + 1, "neuron": neuron, "coefficient": float(m[neuron]),
                       "value_norm": float(norms[neuron]), "weight": float(weight[neuron]),
                       "weight_share": float(weight[neuron]) / total,
                       "final_token_logit": float(m[neuron] * final_scores[neuron])}
                if n_tokens:
                    row["update_tokens"] = tokens_of["update_tokens"][rank]
                    row["value_tokens"] = tokens_of["value_tokens"][rank]
                rows.append(row)
        layers = _layer_frame(model, torch.stack(before), torch.stack(after), final_token, ffn_norms, token)

    attrs = {
        "model": model.name, "fingerprint": model.fingerprint, "prompt": prompt, "tokens": [token(i) for i in ids],
        "token_ids": ids, "position": pos, "position_token": token(ids[pos]), "final_token": token(final_token),
        "final_token_id": final_token, "convention": convention, "convention_formula": formula,
        "logit_lens": "full final norm, then W_U and b_U (maps to the logits folded in), then any soft-cap",
        "residual_before": ("hook_resid_pre (parallel block: attention and FFN read the same residual)"
                            if model.parallel_block else "hook_resid_mid"),
        "values": "written values (Model.written_values)", "top": top, "bos": offset == 1,
        "dtype": str(model.dtype).removeprefix("torch."), "kvmem_version": kvmem.__version__,
    }
    sub_updates = pd.DataFrame(rows)
    sub_updates.attrs = dict(attrs)
    layers.attrs = dict(attrs)
    return Trace(sub_updates=sub_updates, layers=layers, attrs=attrs)


def _layer_frame(model: Model, before: Tensor, after: Tensor, final_token: int, ffn_norms: list[float],
                 token) -> pd.DataFrame:
    """Per-layer logit-lens table from residuals before/after each FFN [layer, d_model]."""
    import pandas as pd

    columns: dict[str, Any] = {"layer": list(range(model.n_layers))}
    for side, resid in (("before", before), ("after", after)):
        logits = _lens(model, resid)  # [layer, vocab]
        probs = logits.softmax(dim=-1)  # [layer, vocab]
        top_prob, top_id = probs.max(dim=-1)  # [layer]
        final_logit = logits[:, final_token : final_token + 1]  # [layer, 1]
        columns[f"top_{side}"] = [token(i) for i in top_id.tolist()]
        columns[f"top_{side}_id"] = top_id.tolist()
        columns[f"top_{side}_prob"] = top_prob.tolist()
        columns[f"final_rank_{side}"] = ((logits > final_logit).sum(dim=-1) + 1).tolist()
        columns[f"final_prob_{side}"] = probs[:, final_token].tolist()
    frame = pd.DataFrame(columns)
    frame["changed"] = frame["top_before_id"] != frame["top_after_id"]
    frame["ffn_norm"] = ffn_norms
    return frame[list(LAYER_COLUMNS)]


def plot_prediction_formation(trace_result: Trace | pd.DataFrame, *, ax=None):
    """Probability (left axis) and rank (right axis, log) of the final prediction before and after each FFN.

    ``trace_result``: a :class:`Trace` or its ``layers`` frame. Layers whose FFN changed the
    logit-lens top token are shaded. Returns the Axes; never calls ``plt.show()``.
    """
    import matplotlib.pyplot as plt

    layers = trace_result.layers if isinstance(trace_result, Trace) else trace_result
    needed = {"layer", "final_prob_before", "final_prob_after", "final_rank_before", "final_rank_after", "changed"}
    if not hasattr(layers, "columns") or not needed <= set(layers.columns):
        raise KvmemError("plot_prediction_formation expects a Trace or its .layers frame with columns "
                         f"{sorted(needed)}; got {type(trace_result).__name__}")
    if ax is None:
        _, ax = plt.subplots(figsize=(8, 3.5))
    xs, probs, ranks = [], [], []
    for row in layers.itertuples(index=False):
        xs += [row.layer - 0.2, row.layer + 0.2]
        probs += [row.final_prob_before, row.final_prob_after]
        ranks += [row.final_rank_before, row.final_rank_after]
        if row.changed:
            ax.axvspan(row.layer - 0.45, row.layer + 0.45, color="tab:orange", alpha=0.15, lw=0)
    ax.plot(xs, probs, color="tab:blue", marker="o", ms=3, label="probability")
    ax.set_xlabel("layer (left point: before FFN, right point: after FFN)")
    ax.set_ylabel("probability", color="tab:blue")
    ax.set_ylim(0, 1)
    twin = ax.twinx()
    twin.plot(xs, ranks, color="tab:gray", ls="--", lw=1, label="rank")
    twin.set_yscale("log")
    twin.set_ylim(max(max(ranks), 10) * 2, 0.8)  # rank 1 at the top
    twin.set_ylabel("rank (1 = top)", color="tab:gray")
    token = layers.attrs.get("final_token")
    ax.set_title(f"formation of the final prediction {token!r}" if token is not None else "prediction formation")
    return ax
