"""How kvmem reads a model's activations: :func:`capture_ffn` for the FFN's own sites (the scan),
:func:`capture` for any block site by its TransformerLens name, with a position gather and an early stop.

Both read with plain torch hooks on the HF modules the architecture table names
(:meth:`kvmem.models.Model.site_location`: the down projection's input is the coefficients m by
definition), removed in ``finally``, also after an exception. Nothing is wrapped or replaced:
the user's model keeps its modules, state_dict, attention implementation and logits.

:func:`capture_ffn` runs :attr:`kvmem.models.Model.unbridged`, a view of the HF model with hook
registries of its own (its hooks never fire in, or stay on, the user's modules): the scan and the
records it rebuilds read m this way (``tests/test_capture_ffn.py``: equal, to the bit, to a
separate plain HF model's hooks on every row of the architecture table).

:func:`capture` runs ``model.hf_model`` itself, as the user would: tracing and the experiments
read the residual stream and the FFN there, and an active :func:`kvmem.intervention.intervene`
edit shows in what they read. With ``stop_early`` the forward ends as soon as every requested hook
has fired: nothing after the last one (later blocks, the final norm, the unembedding) is computed.

The names are TransformerLens's (``blocks.L.mlp.hook_post``, ``blocks.L.hook_resid_mid``, ...), kvmem's
vocabulary for sites; ``tests/test_capture.py`` checks each site against HF's own outputs on every row
of the architecture table.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from kvmem.errors import KvmemError

if TYPE_CHECKING:
    from torch import Tensor

    from kvmem.models import Model

__all__ = ["capture", "capture_ffn"]


def capture_ffn(model: Model, input_ids: Tensor, sites: Sequence[tuple[int, str]],
                on_capture: Callable[[int, str, Tensor], None]) -> None:
    """Run the HF model on ``input_ids`` [batch, pos] and call ``on_capture(layer, site, tensor)``
    [batch, pos, d_ff] as each FFN site of ``sites`` is computed (sites of :meth:`Model.ffn_site`:
    ``post`` m, ``pre`` the gate, ``pre_linear`` the up pre-activation). The forward stops right
    after the last one; nothing is kept. Hooks are removed in ``finally``, also after an exception.
    """
    import torch

    wanted = set(sites)
    fired: set[tuple[int, str]] = set()
    handles = []
    batch, pos = input_ids.shape

    def deliver(key: tuple[int, str], tensor: Tensor, half: int | None) -> None:
        if half is not None:
            tensor = tensor.chunk(2, dim=-1)[half]
        on_capture(key[0], key[1], tensor.detach().view(batch, pos, tensor.shape[-1]))  # OPT: [batch * pos, d_ff]
        fired.add(key)
        if fired == wanted:
            raise _StopForward

    try:
        for key in dict.fromkeys(sites):
            module, where, half = model.ffn_site(*key)
            if where == "input":
                hook = lambda module, args, key=key, half=half: deliver(key, args[0], half)  # noqa: E731
                handles.append(module.register_forward_pre_hook(hook))
            else:
                hook = lambda module, args, out, key=key, half=half: deliver(key, out, half)  # noqa: E731
                handles.append(module.register_forward_hook(hook))
        with torch.inference_mode():
            try:
                model.unbridged(input_ids.to(model.device), use_cache=False)
            except _StopForward:
                pass
    finally:
        for handle in handles:
            handle.remove()
    if fired != wanted:
        raise KvmemError(f"FFN site(s) {sorted(wanted - fired)} never ran in the forward pass")


class _StopForward(Exception):
    """Raised once every requested hook has fired: the rest of the forward is skipped."""


def capture(model: Model, input_ids: Tensor, hook_names: Sequence[str], *,
            on_capture: Callable[[str, Tensor], None] | None = None,
            positions: tuple[Tensor, Tensor] | None = None, stop_early: bool = True,
            logits_at: tuple[Tensor, Tensor] | None = None) -> dict[str, Tensor]:
    """Run the HF model on ``input_ids`` [batch, pos] and read ``hook_names`` (``blocks.L.<site>``, the
    TransformerLens names of :data:`kvmem.architectures.HOOK_SITES`).

    Each site is read with a plain torch hook on the HF module that computes it
    (:meth:`kvmem.models.Model.site_location`), in ``model.hf_model`` itself, as the model runs (its own
    attention implementation, and any edit of an active :func:`kvmem.intervention.intervene`). The hooks
    are removed in ``finally``, also after an exception: the model is left as it was found.

    ``positions``: None reads whole tensors [batch, pos, d]; (rows [n], cols [n]) gathers [n, d].
    ``on_capture(name, tensor)``: called as each hook fires (tensors are then not kept); without
    it, the tensors are returned by name (detached, float32; gathered ones moved to the CPU).
    ``stop_early``: end the forward after the last hook (then no logits); otherwise the forward
    runs to the end and, with ``logits_at`` (rows, cols), the model's own logits there come back as
    ``"logits"`` [n, vocab].
    """
    import torch

    locations = {name: _located(model, name) for name in dict.fromkeys(hook_names)}
    wanted = set(locations)
    fired: set[str] = set()
    captured: dict[str, Tensor] = {}
    batch, pos = input_ids.shape
    where = None if positions is None else tuple(p.to(model.device) for p in positions)

    def deliver(name: str, tensor, half: int | None) -> None:
        if isinstance(tensor, tuple):  # a block's output: (hidden_states, ...) in some families
            tensor = tensor[0]
        if half is not None:
            tensor = tensor.chunk(2, dim=-1)[half]
        value = tensor.detach().reshape(batch, pos, tensor.shape[-1])  # OPT's FFN: [batch * pos, d_ff]
        if where is not None:
            value = value[where[0], where[1]]  # [n, d]
        if on_capture is not None:
            on_capture(name, value)
        else:
            captured[name] = value.float() if where is None else value.float().cpu()
        fired.add(name)
        if stop_early and fired == wanted:
            raise _StopForward

    handles = []
    logits = None
    try:
        for name, (module, kind, half) in locations.items():
            if kind == "input":
                def pre_hook(module, args, kwargs, name=name, half=half):
                    deliver(name, args[0] if args else kwargs["hidden_states"], half)
                handles.append(module.register_forward_pre_hook(pre_hook, with_kwargs=True))
            else:
                def hook(module, args, output, name=name, half=half):
                    deliver(name, output, half)
                handles.append(module.register_forward_hook(hook))
        with torch.inference_mode():
            try:
                out = model.hf_model(input_ids.to(model.device), use_cache=False)
                logits = out.logits
            except _StopForward:
                pass
    finally:
        for handle in handles:
            handle.remove()
    if fired != wanted:
        raise KvmemError(f"hook(s) {sorted(wanted - fired)} never fired in the forward pass")
    if logits_at is not None and logits is not None:
        captured["logits"] = logits[logits_at[0].to(logits.device), logits_at[1].to(logits.device)].detach().float().cpu()
    return captured


def _located(model: Model, name: str):
    """(module of ``model.hf_model``, ``"input"``/``"output"``, half) computing hook ``name``."""
    from kvmem.architectures import parse_hook_name

    layer, site = parse_hook_name(name)
    path, kind, half = model.site_location(layer, site)
    return model.hf_model.get_submodule(path), kind, half
