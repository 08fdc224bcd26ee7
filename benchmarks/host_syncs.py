"""Host synchronisations and operators per batch of the streaming step: what stalls a GPU between layers.

Two parts of a batch are counted apart:

- **the step**: every hooked layer's fold (``BatchStep.layer``, called from inside the forward) and the
  batch's end (``BatchStep.finish``). A wait here stalls the GPU: the host stops issuing the forward's
  next kernels until the device has run everything queued before.
- **the setup**, before the forward: laying the batch out (``BatchRows.build``) and reading what every
  layer shares (``BatchStep.__init__``, :class:`kvmem.scanning.step.BatchLayout`). The device then
  holds only the end of the previous batch. The setup builds host tensors and copies them to the
  device; only operators on tensors that a GPU run holds on the device (copied there with
  ``.to(device)``, or computed from such) are counted here, so a CPU run does not count host work.

In each, an operator dispatched under a :class:`TorchDispatchMode` counts as a synchronisation when a
GPU makes the host wait for its result: ``item`` / ``_local_scalar_dense`` / ``is_nonzero``
(``.item()``, ``int()``, ``float()``, ``bool()`` of a tensor; under inference mode ``bool()`` dispatches
``is_nonzero`` and ``int()`` ``item``), ``nonzero``, ``masked_select``, the ``unique`` family,
``repeat_interleave`` without an output size, ``bincount`` (CUDA reads the largest value to size its
output), ``equal`` / ``allclose``, and indexing with a boolean mask. Reads that leave the dispatcher
on a CPU tensor (``.tolist()``, ``.cpu()``, ``.numpy()``) are counted by name. Host-to-device copies
(``.to(device)``) are counted in the setup: from pageable memory torch waits for the stream after
each; from pinned memory with ``non_blocking=True`` it does not. The count does not depend on the
device, so a CPU run states what a GPU run waits for; on CUDA the script also counts the warnings of
``torch.cuda.set_sync_debug_mode("warn")`` in each part, as a cross-check. Every operator dispatched
in the step is counted too (``operators``): each is at least one kernel launch on a GPU.

    python benchmarks/host_syncs.py [--model gpt2-random] [--tokens 4096] [--per-document] [--statistics NAME,...]
"""

from __future__ import annotations

import argparse
import json
import warnings
import weakref
from collections import Counter

import torch
from common import machine
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import kvmem
from kvmem.scanning import runner, step

SYNCING = {"_local_scalar_dense", "item", "is_nonzero", "nonzero", "masked_select", "_unique", "_unique2",
           "unique_consecutive", "unique_dim", "repeat_interleave", "bincount", "equal", "allclose"}
READS = ("tolist", "cpu", "numpy")  # Tensor methods that copy to the host outside the dispatcher on a CPU tensor


def waits(func, args, kwargs) -> str | None:
    """The name under which ``func(*args, **kwargs)`` makes a GPU's host wait, or None."""
    name = func.overloadpacket.__name__
    if name == "repeat_interleave" and (func._overloadname == "self_int" or kwargs.get("output_size") is not None):
        return None  # repeats given as an int, or the output size: no wait
    if name in SYNCING:
        return name
    if name in ("index", "index_put", "index_put_") and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or []) if i is not None):
        return f"{name}[bool mask]"
    return None


class Counting(TorchDispatchMode):
    """Per part: operators that make the host wait (by name), and all operators."""

    def __init__(self):
        super().__init__()
        self.part = None
        self.syncs: dict[str, Counter] = {"step": Counter(), "setup": Counter()}
        self.operators: Counter = Counter()
        self._on_device: dict[int, weakref.ref] = {}  # setup: tensors a GPU run holds on the device

    def mark_on_device(self, tensor) -> None:
        key = id(tensor)
        self._on_device[key] = weakref.ref(tensor, lambda _, key=key: self._on_device.pop(key, None))

    def on_device(self, tensor) -> bool:
        ref = self._on_device.get(id(tensor))
        return ref is not None and ref() is tensor

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.part is None:
            return out
        self.operators[self.part] += 1
        counts = True
        if self.part == "setup":
            counts = any(self.on_device(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor))
            if counts:
                for t in tree_leaves(out):
                    if isinstance(t, torch.Tensor):
                        self.mark_on_device(t)
        name = waits(func, args, kwargs) if counts else None
        if name is not None:
            self.syncs[self.part][name] += 1
        return out


def count(model, corpus: str, *, tokens: int, per_document: bool, batch_size="8", statistics=()) -> dict:
    """Stream ``tokens`` of ``corpus`` through ``model``, counting per part (see the module docstring)."""
    cuda = model.device.startswith("cuda")
    mode = Counting()
    cuda_syncs: Counter = Counter()

    def within(part: str, method):
        def run(*a, **k):
            outer, mode.part = mode.part, part
            with warnings.catch_warnings(record=True) as caught:
                if cuda:
                    warnings.simplefilter("always")
                    torch.cuda.set_sync_debug_mode("warn")
                try:
                    return method(*a, **k)
                finally:
                    if cuda:
                        torch.cuda.set_sync_debug_mode("default")
                        cuda_syncs[part] += sum("synchroniz" in str(w.message) for w in caught)
                    mode.part = outer
        return run

    real_reads = {name: getattr(torch.Tensor, name) for name in READS}
    real_to = torch.Tensor.to

    def counted_read(name):
        def read(self, *a, **k):
            if mode.part == "step" and (self.device.type != "cpu" or not cuda) or (
                    mode.part == "setup" and (self.device.type != "cpu" if cuda else mode.on_device(self))):
                mode.syncs[mode.part][f"Tensor.{name}"] += 1
            out = real_reads[name](self, *a, **k)
            if out is self:  # on a CPU run: a host copy of its own, as a GPU run makes
                outer, mode.part = mode.part, None
                out, mode.part = out.clone(), outer
            return out
        return read

    def counted_to(self, *a, **k):
        target = next((x for x in (*a, k.get("device")) if isinstance(x, (str, torch.device))), None)
        copy = (mode.part == "setup" and target is not None and self.device.type == "cpu" and not mode.on_device(self)
                and torch.device(target).type == torch.device(model.device).type)
        if copy:
            mode.syncs["setup"]["host-to-device copy, pinned, non-blocking" if k.get("non_blocking") and
                                (self.is_pinned() or not cuda) else "host-to-device copy (waits)"] += 1
        out = real_to(self, *a, **k)
        if copy:
            out = out.clone() if out is self else out  # on a CPU run, a tensor of its own as a GPU run makes
            mode.mark_on_device(out)
        return out

    saved = {(step.BatchStep, "layer"): step.BatchStep.layer, (step.BatchStep, "finish"): step.BatchStep.finish,
             (step.BatchStep, "__init__"): step.BatchStep.__init__, (step.BatchRows, "build"): step.BatchRows.build}
    step.BatchStep.layer = within("step", saved[step.BatchStep, "layer"])
    step.BatchStep.finish = within("step", saved[step.BatchStep, "finish"])
    step.BatchStep.__init__ = within("setup", saved[step.BatchStep, "__init__"])
    step.BatchRows.build = classmethod(within("setup", saved[step.BatchRows, "build"].__func__))
    for name in READS:
        setattr(torch.Tensor, name, counted_read(name))
    torch.Tensor.to = counted_to
    try:
        with mode:
            state = runner.stream(model, corpus, max_tokens=tokens, per_document=per_document, batch_size=batch_size,
                                  statistics=tuple(statistics))
    finally:
        for (owner, name), method in saved.items():
            setattr(owner, name, method)
        for name, read in real_reads.items():
            setattr(torch.Tensor, name, read)
        torch.Tensor.to = real_to
    batches, layers = state.batches, len(state.layers)

    def per_batch(counter: Counter) -> dict:
        return {k: round(v / batches, 2) for k, v in sorted(counter.items())}

    steps, setup = sum(mode.syncs["step"].values()), sum(mode.syncs["setup"].values())
    result = {"machine": machine(), "device": model.device, "statistics": state.statistics.names,
              "per_document": per_document,
              "tokens": state.tokens, "batches": batches, "layers": layers,
              "step_syncs_per_batch": round(steps / batches, 2),
              "step_syncs_per_layer_per_batch": round(steps / batches / layers, 2),
              "step_syncs_by_operator_per_batch": per_batch(mode.syncs["step"]),
              "step_operators_per_layer_per_batch": round(mode.operators["step"] / batches / layers, 1),
              "setup_syncs_per_batch": round(setup / batches, 2),
              "setup_by_operator_per_batch": per_batch(mode.syncs["setup"]),
              "setup_operators_per_batch": round(mode.operators["setup"] / batches, 1)}
    if cuda:
        result["cuda_sync_debug_per_batch"] = {part: round(n / batches, 2) for part, n in cuda_syncs.items()}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2-random")
    parser.add_argument("--corpus", default="pydoc")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--statistics", default="", help="optional statistics to keep too (comma-separated)")
    parser.add_argument("--per-document", action="store_true")
    parser.add_argument("--batch-size", default="8")
    parser.add_argument("--device", default=None)
    args = parser.parse_args()
    model = kvmem.load_model(args.model, device=args.device)
    result = count(model, args.corpus, tokens=args.tokens, per_document=args.per_document, batch_size=args.batch_size,
                   statistics=[name for name in args.statistics.split(",") if name])
    print(json.dumps({"model": args.model, **result}, indent=1))


if __name__ == "__main__":
    main()
