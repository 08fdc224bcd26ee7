"""Host synchronisations per batch of the streaming step, per backend: what stalls a GPU between layers.

The step's device work (``BatchStep.layer`` for each hooked layer, then ``BatchStep.finish``) is run
under a dispatch mode that counts the operators whose result the host must wait for on a GPU:
``.item()``/``int()``/``bool()`` of a tensor (``_local_scalar_dense``), ``nonzero``, ``masked_select``,
the ``unique`` family, ``repeat_interleave`` without an output size, and indexing with a boolean mask.
The count is the same on any device, so the CPU run states what a GPU run would wait for; on CUDA the
script also counts with ``torch.cuda.set_sync_debug_mode`` as a cross-check. Building a batch's rows
(host tensors, copied to the device) is not counted: it does not wait for the device.

    python benchmarks/host_syncs.py [--model gpt2-random] [--tokens 4096] [--backend torch] [--per-document]
"""

from __future__ import annotations

import argparse
import json
import warnings
from collections import Counter

import torch
from common import machine
from torch.utils._python_dispatch import TorchDispatchMode

import kvmem
from kvmem.scanning import runner, step
from kvmem.scanning.backends import BACKENDS

SYNCING = {"_local_scalar_dense", "nonzero", "masked_select", "_unique2", "unique_consecutive", "unique_dim",
           "repeat_interleave"}


class CountSyncs(TorchDispatchMode):
    """Counts operators that make the host wait for the device (by name; see the module docstring)."""

    def __init__(self):
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        scalar_repeats = name == "repeat_interleave" and (func._overloadname == "self_int"
                                                          or kwargs.get("output_size") is not None)
        if name in SYNCING and not scalar_repeats:  # repeats given as an int, or the output size: no wait
            self.counts[name] += 1
        elif name in ("index", "index_put", "index_put_") and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or []) if i is not None):
            self.counts[f"{name}[bool mask]"] += 1
        return func(*args, **kwargs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2-random")
    parser.add_argument("--corpus", default="pydoc")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--backend", choices=list(BACKENDS), default="torch")
    parser.add_argument("--per-document", action="store_true")
    parser.add_argument("--device", default=None)
    args = parser.parse_args()

    model = kvmem.load_model(args.model, device=args.device)
    counter = CountSyncs()
    cuda_syncs = [0]
    real_layer, real_finish = step.BatchStep.layer, step.BatchStep.finish

    def method_with_mode(method, self, *a, **k):
        with counter, warnings.catch_warnings(record=True) as caught:
            if model.device.startswith("cuda"):
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
            try:
                return method(self, *a, **k)
            finally:
                if model.device.startswith("cuda"):
                    torch.cuda.set_sync_debug_mode("default")
                    cuda_syncs[0] += sum("synchroniz" in str(w.message) for w in caught)

    # reads that bypass the dispatcher on a CPU tensor (on a GPU each copies to the host and waits)
    real_reads = {name: getattr(torch.Tensor, name) for name in ("tolist", "cpu", "numpy")}
    active = [False]

    def counted_read(name):
        def read(self, *a, **k):
            if active[0]:
                counter.counts[f"Tensor.{name}"] += 1
            return real_reads[name](self, *a, **k)
        return read

    def counted(method):
        def run(self, *a, **k):
            active[0] = True
            try:
                return method_with_mode(method, self, *a, **k)
            finally:
                active[0] = False
        return run

    for name in real_reads:
        setattr(torch.Tensor, name, counted_read(name))
    step.BatchStep.layer, step.BatchStep.finish = counted(real_layer), counted(real_finish)
    try:
        state = runner.stream(model, args.corpus, max_tokens=args.tokens, backend=args.backend,
                              per_document=args.per_document)
    finally:
        step.BatchStep.layer, step.BatchStep.finish = real_layer, real_finish
        for name, read in real_reads.items():
            setattr(torch.Tensor, name, read)
    batches, layers = state.batches, len(state.layers)
    total = sum(counter.counts.values())
    result = {"machine": machine(), "model": args.model, "device": model.device, "backend": args.backend,
              "per_document": args.per_document, "tokens": state.tokens, "batches": batches, "layers": layers,
              "host_syncs_per_batch": round(total / batches, 2),
              "host_syncs_per_batch_per_layer": round(total / batches / layers, 2),
              "by_operator_per_batch": {k: round(v / batches, 2) for k, v in sorted(counter.counts.items())}}
    if model.device.startswith("cuda"):
        result["cuda_sync_debug_per_batch"] = round(cuda_syncs[0] / batches, 2)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
