"""Set, scale or shift memory coefficients m_i while the model runs.

The edit is applied at ``blocks.L.mlp.hook_post``, the input of W2 / ``down_proj``: the number
that multiplies value v_i. For a gated FFN this is act(x·g_i)·(x·u_i) as a whole (editing the gate
or up projection alone would set a different number). What the edited neuron then writes into
the residual stream follows the same semantics as every projection: m_i times the written value
``Model.written_values(L)[i]`` (v_i times a post-FFN norm's gain and Granite's residual
multiplier), divided, where a post-FFN norm sits (Gemma-2/3, OLMo-2), by that token's rms of the
whole FFN output, which the edit changes too. Inside :func:`intervene` every forward pass of
``model.hf_model`` is edited: ``model.hf_model(ids)``, ``model.hf_model.generate(...)``,
:func:`greedy_continuation`, :func:`kvmem.trace` and :func:`kvmem.capture.capture`. The edit is a
plain torch forward pre-hook on each edited layer's down projection, removed on exit, also when
the block raises; nothing else of the model is touched.

Positions during generation
---------------------------
``positions`` are absolute indices into the token sequence the model reads (the prompt is
0..n-1, with the BOS token at 0 where it is read first, as :func:`greedy_continuation` does; the
first generated token is n). With a KV cache each forward pass sees only the new tokens; kvmem reads
the offset of those tokens from the forward call (the length of ``attention_mask`` minus the new
tokens, else ``cache_position``, else ``position_ids``, else the cache length), so a non-negative
position is edited exactly once, whether or not the cache is used. A negative position counts
from the end of the sequence as it stands in each forward pass: ``-1`` is the newest token of
every step, so during cached generation it edits the last prompt token and every generated
token. With left-padded batches, indices count the padding.
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from kvmem.errors import KvmemError

if TYPE_CHECKING:
    from torch import Tensor

    from kvmem.models import Model

__all__ = ["MODES", "greedy_continuation", "intervene"]

# mode -> how the edit value combines with the model's own coefficient m_i
MODES: dict[str, str] = {
    "set": "m_i := value",
    "scale": "m_i := m_i * value",
    "add": "m_i := m_i + value",
}


def _as_index(value: Any, what: str) -> int:
    if isinstance(value, bool):
        raise KvmemError(f"{what} must be an int, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise KvmemError(f"{what} must be an int, got {value!r}") from None


def _plan(model: Model, edits: Mapping, mode: str) -> dict[int, tuple[list[int], list[float]]]:
    """Validated edits grouped by layer: {layer: ([neuron, ...], [value, ...])}."""
    if mode not in MODES:
        raise KvmemError(f"unknown intervention mode {mode!r}; choose one of {', '.join(MODES)}")
    if not isinstance(edits, Mapping):
        raise KvmemError(f"edits must be a dict {{(layer, neuron): value}}, got {type(edits).__name__}")
    plan: dict[int, tuple[list[int], list[float]]] = {}
    for key, value in edits.items():
        if not isinstance(key, tuple) or len(key) != 2:
            raise KvmemError(f"each edit key must be a (layer, neuron) pair, got {key!r}")
        layer, neuron = _as_index(key[0], "layer"), _as_index(key[1], "neuron")
        if not 0 <= layer < model.n_layers:
            raise KvmemError(f"layer {layer} is out of range; this model has layers 0..{model.n_layers - 1}")
        if not 0 <= neuron < model.d_ff:
            raise KvmemError(f"neuron {neuron} (layer {layer}) is out of range; this model has neurons "
                             f"0..{model.d_ff - 1} per layer (d_ff={model.d_ff})")
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise KvmemError(f"edit value for {key} must be a real number, got {value!r}")
        if not math.isfinite(float(value)):
            raise KvmemError(f"edit value for {key} must be finite, got {value!r}")
        neurons, values = plan.setdefault(layer, ([], []))
        neurons.append(neuron)
        values.append(float(value))
    return plan


def _check_positions(model: Model, positions: Any) -> list[int] | None:
    if positions is None:
        return None
    if isinstance(positions, (int, numbers.Integral)) and not isinstance(positions, bool):
        positions = [positions]
    if isinstance(positions, (str, bytes)) or not hasattr(positions, "__iter__"):
        raise KvmemError(f"positions must be None (all) or a list of ints, got {positions!r}")
    checked = [_as_index(p, "each position") for p in positions]
    limit = model.n_ctx
    for p in checked:
        if limit and not -limit <= p < limit:
            raise KvmemError(f"position {p} is outside the model's context; use -{limit}..{limit - 1}")
    return checked


def _new_tokens(args: tuple, kwargs: dict) -> tuple[int, int] | None:
    """(batch, new tokens) of a forward call, from its ``input_ids`` or ``inputs_embeds``; None if neither."""
    import torch

    new = kwargs.get("input_ids", args[0] if args else None)
    if isinstance(new, torch.Tensor):
        return (new.shape[0] if new.ndim > 1 else 1), new.shape[-1]
    embeds = kwargs.get("inputs_embeds")
    if isinstance(embeds, torch.Tensor):
        return (embeds.shape[0] if embeds.ndim > 2 else 1), embeds.shape[-2]
    return None


def _offset(args: tuple, kwargs: dict) -> int:
    """Absolute index of the first token of a forward call, from its arguments (0 without a cache)."""
    import torch

    shape = _new_tokens(args, kwargs)
    n_new = None if shape is None else shape[1]
    mask = kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.ndim == 2 and n_new is not None:
        return int(mask.shape[1] - n_new)
    for name in ("cache_position", "position_ids"):
        value = kwargs.get(name)
        if isinstance(value, torch.Tensor) and value.numel():
            return int(value.reshape(-1)[0])
    cache = kwargs.get("past_key_values", kwargs.get("cache"))
    if cache is not None and hasattr(cache, "get_seq_length"):
        return int(cache.get_seq_length())
    return 0


def _edit_hook(neurons: list[int], values: list[float], mode: str, positions: list[int] | None, state: dict):
    """A forward pre-hook for a down projection: its input, the coefficients m, edited."""

    def hook(module, args: tuple) -> tuple:
        m = args[0]  # [batch, pos, d_ff]; OPT's FFN runs on [batch * pos, d_ff]
        flat = m.ndim == 2 and state["shape"] is not None
        edited = _edited(m.view(*state["shape"], m.shape[-1]) if flat else m, neurons, values, mode, positions,
                         state["offset"])
        if edited is None:
            return None  # nothing to edit in this forward: the input as it was
        return (edited.view(m.shape), *args[1:])

    return hook


def _edited(tensor: Tensor, neurons: list[int], values: list[float], mode: str, positions: list[int] | None,
            offset: int) -> Tensor | None:
    """tensor [batch, pos, d_ff] with the edits applied at the forward's positions (a copy), or None."""
    import torch

    n = tensor.shape[-2]
    if positions is None:
        local = list(range(n))
    else:
        total = offset + n
        absolute = {p if p >= 0 else total + p for p in positions}
        local = sorted(a - offset for a in absolute if offset <= a < total)
    if not local:
        return None
    index_pos = torch.tensor(local, device=tensor.device)[:, None]  # [n_pos, 1]
    index_neuron = torch.tensor(neurons, device=tensor.device)[None, :]  # [1, n_neurons]
    value = torch.tensor(values, device=tensor.device, dtype=tensor.dtype)  # [n_neurons]
    edited = tensor.clone()
    current = edited[..., index_pos, index_neuron]  # [batch, n_pos, n_neurons]
    if mode == "set":
        new = value.expand_as(current)
    elif mode == "scale":
        new = current * value
    else:
        new = current + value
    edited[..., index_pos, index_neuron] = new
    return edited


@contextmanager
def intervene(model: Model, edits: Mapping[tuple[int, int], float], *, positions: list[int] | int | None = None,
              mode: str = "set") -> Iterator[Model]:
    """Edit memory coefficients m_i during every forward pass inside the block.

    ``edits``: {(layer, neuron): value}. ``mode``: ``set`` (m_i = value), ``scale`` (m_i *= value)
    or ``add`` (m_i += value). ``positions``: None edits every position; else a list of absolute
    token indices (negative: from the end of the sequence in each forward pass; see the module
    docstring for generation with a KV cache). An empty ``edits`` adds no hooks. Hooks are
    removed on exit, also when the block raises.

    >>> with intervene(model, {(12, 301): 3.0}):  # doctest: +SKIP
    ...     text = greedy_continuation(model, "The capital of France is", max_new_tokens=20)
    """
    plan = _plan(model, edits, mode)
    checked = _check_positions(model, positions)
    if not plan or checked == []:
        yield model
        return
    state: dict = {"offset": 0, "shape": None}

    def before_forward(module, args, kwargs):
        state["offset"] = _offset(args, kwargs)
        state["shape"] = _new_tokens(args, kwargs)

    def after_forward(module, args, output):
        state["offset"], state["shape"] = 0, None

    handles = []
    try:
        handles.append(model.hf_model.register_forward_pre_hook(before_forward, with_kwargs=True))
        handles.append(model.hf_model.register_forward_hook(after_forward, always_call=True))
        for layer, (neurons, values) in plan.items():
            path, _, _ = model.site_location(layer, "post")  # the down projection's input: m
            module = model.hf_model.get_submodule(path)
            handles.append(module.register_forward_pre_hook(_edit_hook(neurons, values, mode, checked, state)))
        yield model
    finally:
        for handle in handles:
            handle.remove()


def greedy_continuation(model: Model, prompt: str | list[int], *, max_new_tokens: int = 20,
                        prepend_bos: bool | None = None, use_cache: bool = True) -> str:
    """The greedy continuation of ``prompt`` by the HF model's own ``generate`` (text of the new tokens
    only); any active :func:`intervene` edits apply.

    The prompt is read after the model's BOS token, as a scan reads every window and :func:`kvmem.trace`
    reads a prompt (:meth:`kvmem.models.Model.prompt_ids`; ``prepend_bos=False`` reads it alone), so
    absolute ``positions`` of an edit count the BOS token as position 0. ``use_cache``: decode with the
    KV cache (fast; an edit at an absolute position is applied once either way).
    """
    import torch

    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise KvmemError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    ids = model.prompt_ids(prompt, prepend_bos=prepend_bos)
    tokens = torch.tensor([ids], device=model.device)  # [batch=1, pos]
    config = _greedy_config(model, max_new_tokens=max_new_tokens, use_cache=use_cache)
    with torch.no_grad():
        out = model.hf_model.generate(tokens, attention_mask=torch.ones_like(tokens),
                                      generation_config=config)  # [1, pos + new]
    return model.tokenizer.decode(out[0, len(ids):].tolist())


def _greedy_config(model: Model, **settings):
    """Plain greedy decoding for this model, not the model's own generation config (which may carry sampling
    settings, a repetition penalty or a length limit): what an edit changes is then the edit's alone."""
    from transformers import GenerationConfig

    own = model.hf_model.generation_config
    pad = own.pad_token_id if own.pad_token_id is not None else model.tokenizer.pad_token_id
    eos = own.eos_token_id if own.eos_token_id is not None else model.tokenizer.eos_token_id
    return GenerationConfig(bos_token_id=own.bos_token_id, eos_token_id=eos,
                            pad_token_id=pad if pad is not None else eos, do_sample=False, **settings)
