"""Checkpoints and mergeable states as data, never code: tensors in safetensors, the rest in JSON.

A state directory holds ``state.<generation>.safetensors`` (every tensor of every layer) and
``state.json`` (counters, the stream position, the text store, a header naming the settings it
belongs to, and the name of its tensor file). A save writes the new tensor file beside the old one,
flushes it to disk, and then replaces ``state.json`` by rename: that rename is the one commit point.
A process killed anywhere in a save leaves the previous checkpoint whole, and the next save removes
what the killed one left. Both files carry the same random ``generation`` tag, so a pair torn any
other way is refused, not mixed. Nothing is unpickled: a file that is not safetensors/JSON gets a
one-line error. A save that cannot write (a full disk) raises :class:`KvmemError` in one line and
leaves the previous checkpoint as it was.
"""

from __future__ import annotations

import json
import os
import secrets
from array import array
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from kvmem.errors import KvmemError
from kvmem.plan import StreamPosition, TokenPlan
from kvmem.scanning.statistics import Composition, LayerState, ScanState
from kvmem.scanning.texts import TextStore

__all__ = ["save_state", "load_state", "saved_plan", "state_to_bytes", "state_from_bytes"]

_VERSION = 4  # 2: the taxonomy's sums (position, gate/up quadrants, unigrams); 3: the tensor file is
# named per generation in state.json, and the documents read have digests; 4: one section per statistic
META = "state.json"
DIGESTS = "stream.read_digests"  # int64 [documents read]: kvmem.plan.short_digest of each


def _split(state: ScanState, header: dict) -> tuple[dict, dict]:
    """Every statistic's tensors (names prefixed ``layer<L>.`` for a layer's) and JSON, a section each."""
    tensors, layers, scan = {}, {}, {}
    for layer, layer_state in state.layer_states.items():
        layers[str(layer)] = {}
        for statistic in state.statistics.layer:
            part, meta = statistic.to_tensors(layer_state[statistic.name], f"layer{layer}")
            tensors.update({name: t.cpu() for name, t in part.items()})
            layers[str(layer)][statistic.name] = meta
    for statistic in state.statistics.scan:
        part, scan[statistic.name] = statistic.to_tensors(state.scan_states[statistic.name], "")
        tensors.update({name: t.cpu() for name, t in part.items()})
    tensors[DIGESTS] = torch.from_numpy(np.frombuffer(state.position.read_digests, dtype=np.int64).copy())
    meta = {"kvmem_state": _VERSION, "header": header, "statistics": state.statistics.names, "layers": layers,
            "scan": scan, "layer_order": list(state.layers),
            "position": state.position.to_json(), "tokens": state.tokens, "windows": state.windows,
            "batches": state.batches, "seconds": state.seconds, "texts": state.texts.to_json()}
    return tensors, meta


def _join(tensors: dict, meta: dict, header: dict | None, where: str, statistics: Composition, device) -> ScanState:
    if meta.get("kvmem_state") != _VERSION:
        raise KvmemError(f"{where} is not a kvmem scan state (or one of another version); delete it and scan again")
    if header is not None:
        saved = meta["header"]
        differ = sorted(k for k in set(saved) | set(header) if saved.get(k) != header.get(k))
        if "plan" in differ:  # compared as plans: the rule's wording (an earlier kvmem's) reads no token otherwise
            before, now = TokenPlan.from_dict(saved["plan"]), TokenPlan.from_dict(header["plan"])
            if before == now:
                differ.remove("plan")
            elif "longest_windows_first" not in saved["plan"] and before == replace(now, longest_windows_first=False):
                raise KvmemError(f"cannot resume from {where}: an earlier kvmem wrote it, which read each block's "
                                 f"documents shortest first, and this one reads windows longest first; finish the "
                                 f"scan with the kvmem that wrote it, or start over without --resume")
        if "config" in differ:
            differ.remove("config")
            differ += sorted(k for k in set(saved["config"]) | set(header["config"])
                             if saved["config"].get(k) != header["config"].get(k))
        if differ:
            raise KvmemError(f"cannot resume from {where}: these settings differ from the checkpoint's: "
                             f"{', '.join(differ)}; rerun with the original settings or start over without --resume")
    if meta.get("statistics") != statistics.names:
        raise KvmemError(f"{where} keeps the statistics {meta.get('statistics')}, this scan keeps "
                         f"{statistics.names}; rerun with the original settings or start over without --resume")
    digests = tensors.pop(DIGESTS, None)
    tensors = {name: t.to(device) for name, t in tensors.items()}
    layers = [int(layer) for layer in meta["layer_order"]]
    position = _position(meta["position"])
    if digests is not None:
        position.read_digests = array("q", digests.cpu().numpy().tobytes())
    layer_states = {layer: LayerState(statistics, {s.name: s.from_tensors(f"layer{layer}", tensors,
                                                                          meta["layers"][str(layer)][s.name])
                                                   for s in statistics.layer})
                    for layer in layers}
    scan_states = {s.name: s.from_tensors("", tensors, meta["scan"][s.name]) for s in statistics.scan}
    return ScanState(statistics, layers, layer_states, scan_states, TextStore.from_json(meta["texts"]), position,
                     int(meta["tokens"]), int(meta["windows"]), int(meta["batches"]), float(meta["seconds"]))


def _position(data: dict) -> StreamPosition:
    """The stream position of a saved state (fields a newer or older kvmem adds or drops are ignored)."""
    known = set(StreamPosition.__dataclass_fields__) - {"read_digests"}
    return StreamPosition(**{k: v for k, v in data.items() if k in known})


def save_state(directory: Path, state, header: dict, *, tensor_file: str | None = None) -> None:
    """Write the state into ``directory`` (created); the previous state stays valid until the commit.

    ``tensor_file``: a fixed name for the tensor file (for a directory written once, such as a shard
    atlas's state); by default it is named after the save's generation.
    """
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors, meta = _split(state, header)
    generation = secrets.token_hex(8)
    tensor_name = tensor_file or f"state.{generation}.safetensors"
    meta.update(generation=generation, tensor_file=tensor_name)
    meta_tmp = directory / f".{META}.{generation}.tmp"
    try:
        save_file(tensors, directory / tensor_name, metadata={"generation": generation})
        _flush(directory / tensor_name)
        with open(meta_tmp, "w") as out:
            out.write(json.dumps(meta))
            out.flush()
            os.fsync(out.fileno())
        os.replace(meta_tmp, directory / META)  # the commit
    except (OSError, SafetensorError) as error:
        for leftover in (directory / tensor_name, meta_tmp):
            leftover.unlink(missing_ok=True)
        raise KvmemError(f"cannot write the checkpoint in {directory} ({_first_line(error)}); the previous "
                         f"checkpoint is kept: free space (or fix the error) and scan again with --resume") from None
    for stale in directory.iterdir():  # the previous generation, and what a killed save left
        if stale.name not in (META, tensor_name) and (stale.name.startswith("state.") or stale.name.startswith(f".{META}")):
            stale.unlink(missing_ok=True)


def _first_line(error: BaseException) -> str:
    text = str(error).strip() or type(error).__name__
    return text.splitlines()[0]


def _flush(path: Path) -> None:
    with open(path, "rb+") as handle:
        os.fsync(handle.fileno())


def saved_plan(directory: Path) -> dict | None:
    """The tokenization plan a checkpoint was saved under (its batch size, ...), or None where there is no
    readable checkpoint (:func:`load_state` then says why)."""
    try:
        meta = json.loads((Path(directory) / META).read_text())
        return dict(meta["header"]["plan"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def load_state(directory: Path, header: dict | None, statistics: Composition, *, device="cpu"):
    """Read the last state committed by :func:`save_state`; ``header`` (if given) must match the saved one;
    ``statistics``: the scan's (:func:`kvmem.scanning.statistics.compose`), which must be the saved ones."""
    from safetensors import SafetensorError, safe_open

    directory = Path(directory)
    meta_path = directory / META
    if not meta_path.exists():
        raise KvmemError(f"nothing to resume: no checkpoint at {directory}; scan without --resume")
    try:
        meta = json.loads(meta_path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise KvmemError(f"checkpoint {meta_path} is not JSON; delete {directory} and scan again") from None
    if not isinstance(meta, dict) or meta.get("kvmem_state") != _VERSION:
        raise KvmemError(f"{directory} is not a kvmem scan state (or one of another version); delete it and scan again")
    tensors_path = directory / str(meta.get("tensor_file"))
    if not tensors_path.exists() or tensors_path.parent != directory:
        raise KvmemError(f"checkpoint {directory} lacks its tensor file {tensors_path.name}; delete it and scan again")
    try:
        with safe_open(tensors_path, framework="pt") as handle:
            generation = (handle.metadata() or {}).get("generation")
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    except (SafetensorError, OSError, ValueError) as error:
        raise KvmemError(f"checkpoint {tensors_path} is not a safetensors file ({_first_line(error)}); "
                         f"delete {directory} and scan again") from None
    if generation != meta.get("generation"):
        raise KvmemError(f"checkpoint {directory} is torn (its two files come from different saves); "
                         f"delete it and scan again")
    return _join(tensors, meta, header, str(directory), statistics, device)


def state_to_bytes(state, header: dict) -> bytes:
    """The same content as a saved state, as one byte string (for gathering between ranks)."""
    from safetensors.torch import save

    tensors, meta = _split(state, header)
    blob = save(tensors)
    head = json.dumps(meta).encode()
    return len(head).to_bytes(8, "little") + head + blob


def state_from_bytes(data: bytes, statistics: Composition, *, device="cpu"):
    from safetensors.torch import load

    size = int.from_bytes(data[:8], "little")
    meta = json.loads(data[8:8 + size])
    return _join(load(data[8 + size:]), meta, None, "a rank's state", statistics, device)
