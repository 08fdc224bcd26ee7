"""The HF model as HF runs it, beside the TransformerLens bridge that wraps it.

TransformerLens builds its bridge by putting its own components in place of the HF modules (each
keeps the module it wraps as ``_original_component``) and forces eager attention, so that a hook
fires at every stage. Reading only the FFN's coefficients needs none of that: on a CPU the
bridge's forward costs about 15% more than HF's own (attention reimplemented step by step, a hook
point at every stage), and on a GPU it also gives up fused attention kernels.

:func:`unbridged` returns a second module tree over the same parameters and buffers (nothing is
copied) in which every bridge component is replaced by the module it wraps, and which runs the
attention implementation the model was loaded with (HF's own choice: ``sdpa`` where the
architecture supports it, ``eager`` where it does not, e.g. Gemma-2's soft-capping). The bridge
itself is left as it is: hooks on residual sites, tracing and interventions still go through it.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn

__all__ = ["unbridged", "separate_tree", "WRAPPED"]

WRAPPED = "_original_component"  # where a TransformerLens bridge component keeps the HF module it wraps

# a module's hook registries: the view's are its own, so hooks added to it never fire in the bridge
_HOOK_DICTS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks",
               "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks", "_state_dict_hooks",
               "_state_dict_pre_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks")


def separate_tree(hf_model: nn.Module) -> nn.Module:
    """A module tree of its own over ``hf_model``'s parameter and buffer tensors, for a TransformerLens
    bridge to boot on (``Model.bridge``).

    Booting a bridge replaces modules of the tree it is given with its own components, registers hooks
    and forces eager attention in that tree's configuration. On this tree none of that reaches
    ``hf_model``: every module is a shallow copy with its own child list, hook registries, parameter
    and buffer dicts and configuration (a copy). The tensors themselves are shared, nothing is copied,
    so a weight edited in place shows in both.
    """
    return unbridged(hf_model, None, own_tensor_dicts=True)


def unbridged(hf_model: nn.Module, attention: str | None, *, own_tensor_dicts: bool = False) -> nn.Module:
    """A view of ``hf_model`` without the bridge's components, sharing every parameter and buffer.

    Each module of the view is a shallow copy of an HF module (its parameters and buffers are the
    same tensors, so a device move or a weight edit of the model shows in the view) with its own
    child list and hook registries. Its configuration is a copy whose attention implementation is
    ``attention`` (None: left as the model's config has it). ``own_tensor_dicts``: give each module its
    own parameter and buffer dicts (holding the same tensors), so that a module registered or replaced
    in the view is not registered in the model.
    """
    from transformers import PretrainedConfig

    configs: dict[int, object] = {}
    own_config = copy.deepcopy(hf_model.config, configs)  # configs: id(original) -> copy, sub-configs too
    for original_id, copied in list(configs.items()):
        if isinstance(copied, PretrainedConfig) and attention is not None:
            copied._attn_implementation = attention
        elif not isinstance(copied, PretrainedConfig):
            del configs[original_id]
    configs[id(hf_model.config)] = own_config
    views: dict[int, nn.Module] = {}

    def view(module: nn.Module) -> nn.Module:
        if id(module) in views:
            return views[id(module)]
        wrapped = module._modules.get(WRAPPED)
        if wrapped is not None:
            views[id(module)] = view(wrapped)
            return views[id(module)]
        clone = copy.copy(module)  # shares _parameters and _buffers (the same dicts), nothing copied
        state = vars(clone)
        for name in _HOOK_DICTS:
            if name in state:
                state[name] = OrderedDict()
        if own_tensor_dicts:
            for name in ("_parameters", "_buffers", "_non_persistent_buffers_set"):
                if name in state:
                    state[name] = copy.copy(state[name])
        for name, value in list(state.items()):
            if id(value) in configs:
                state[name] = configs[id(value)]
        views[id(module)] = clone
        clone._modules = {name: None if child is None else view(child) for name, child in module._modules.items()}
        return clone

    return view(hf_model)
