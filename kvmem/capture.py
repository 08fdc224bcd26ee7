"""How kvmem reads a model's activations: :func:`capture_ffn` for the FFN's own sites (the scan),
:func:`capture` for any site by TransformerLens name, with a position gather and an early stop.

:func:`capture_ffn` runs the HF model as HF runs it (:attr:`kvmem.models.Model.unbridged`, HF's
attention implementation) with plain torch hooks on the FFN's modules: the down projection's input
is the coefficients m by definition. The scan and the records it rebuilds read m this way; it is
cheaper than the bridge's forward (no hook point at every stage, fused attention) and gives the
same numbers to float32 rounding (``tests/test_capture_ffn.py``: equal, to the bit, to a separate
plain HF model's hooks on every row of the architecture table, and within rounding to the bridge's
``hook_post``).

The experiments and tracing call :func:`capture`. Its hooks live only
inside ``model.bridge.hooks``, which removes them in ``finally``, also after an exception. With
``stop_early`` the forward ends as soon as every requested hook has fired: nothing after the
last one (later blocks, the final norm, the unembedding) is computed.

Why TransformerLens hooks and not plain torch hooks on the HF modules: TransformerLens has mapped
``hook_post`` to d_model-wide tensors on some families before (TransformerLens#1645), so hook names
are not taken on trust. With TransformerLens 4.3 and transformers 5.23, on a tiny random-init model
of every row of :data:`kvmem.architectures.ARCHITECTURES` (gpt2 ... granite, GPT-NeoX serial and
parallel, OPT with ``project_in``/``project_out``), ``blocks.L.mlp.hook_post`` is d_ff wide and
equals the input of the HF down projection seen by a plain torch forward pre-hook in a plain HF
forward (``tests/test_architectures.py`` checks it per row, in float32, bfloat16 and float16). The
bridge also gives the residual sites (``hook_resid_pre/mid/post``) the tracer reads and the edit
point :mod:`kvmem.intervention` uses, so one primitive stays. A row whose bridge fails that check
would be read here with a forward pre-hook on its down projection instead.
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
    """Run the model on ``input_ids`` [batch, pos] and read ``hook_names``.

    ``positions``: None reads whole tensors [batch, pos, d]; (rows [n], cols [n]) gathers [n, d].
    ``on_capture(name, tensor)``: called as each hook fires (tensors are then not kept); without
    it, the tensors are returned by name (detached, float32; gathered ones moved to the CPU).
    ``stop_early``: end the forward after the last hook (then no logits); otherwise the forward
    runs to the end and, with ``logits_at`` (rows, cols), the logits there come back as
    ``"logits"`` [n, vocab].
    """
    import torch

    hook_dict = model.bridge.hook_dict
    missing = [name for name in hook_names if name not in hook_dict]
    if missing:
        raise KvmemError(f"this model's bridge has no hook {missing[0]}; see model.bridge.hook_dict for the sites")
    wanted = set(hook_names)
    fired: set[str] = set()
    captured: dict[str, Tensor] = {}
    where = None if positions is None else tuple(p.to(model.device) for p in positions)

    def make_hook(name: str):
        def hook(tensor: Tensor, hook) -> Tensor:  # noqa: ARG001 - TransformerLens passes the hook point too
            value = tensor.detach() if where is None else tensor.detach()[where[0], where[1]]  # [..., d]
            if on_capture is not None:
                on_capture(name, value)
            else:
                captured[name] = value.float() if where is None else value.float().cpu()
            fired.add(name)
            if stop_early and fired == wanted:
                raise _StopForward
            return tensor

        return hook

    with torch.inference_mode(), model.bridge.hooks(fwd_hooks=[(name, make_hook(name)) for name in hook_names]):
        try:
            logits = model.bridge(input_ids.to(model.device), return_type=None if stop_early else "logits")
        except _StopForward:
            logits = None
    if fired != wanted:
        raise KvmemError(f"hook(s) {sorted(wanted - fired)} never fired in the forward pass; this bridge does not run them")
    if logits_at is not None and logits is not None:
        captured["logits"] = logits[logits_at[0].to(logits.device), logits_at[1].to(logits.device)].detach().float().cpu()
    return captured
