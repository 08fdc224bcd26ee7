"""Checkpoints and mergeable states as data, never code: tensors in safetensors, the rest in JSON.

A state directory holds ``state.safetensors`` (every tensor of every layer) and ``state.json``
(counters, the stream position, the text store and a header naming the settings it belongs to).
Both carry the same random ``generation`` tag, so a pair torn by a crash is refused, not mixed.
Nothing is unpickled: a file that is not safetensors/JSON gets a one-line error.
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path

from kvmem.errors import KvmemError
from kvmem.plan import StreamPosition
from kvmem.scanning.state import LayerState, ScanState
from kvmem.scanning.texts import TextStore

__all__ = ["save_state", "load_state", "state_to_bytes", "state_from_bytes"]

_VERSION = 2  # 2: the taxonomy's sums (position sums, gate/up quadrants, unigram counts)


def _split(state: ScanState, header: dict) -> tuple[dict, dict]:
    tensors, layers = {}, {}
    for layer, layer_state in state.layer_states.items():
        part, meta = layer_state.to_tensors(f"layer{layer}")
        tensors.update({name: t.cpu() for name, t in part.items()})
        layers[str(layer)] = meta
    if state.unigrams is not None:
        tensors["unigrams"] = state.unigrams.cpu()
    meta = {"kvmem_state": _VERSION, "header": header, "layers": layers, "layer_order": list(state.layers),
            "position": vars(state.position), "tokens": state.tokens, "windows": state.windows,
            "batches": state.batches, "seconds": state.seconds, "texts": state.texts.to_json()}
    return tensors, meta


def _join(tensors: dict, meta: dict, header: dict | None, where: str, device) -> ScanState:
    if meta.get("kvmem_state") != _VERSION:
        raise KvmemError(f"{where} is not a kvmem scan state (or one of another version); delete it and scan again")
    if header is not None:
        saved = meta["header"]
        differ = sorted(k for k in set(saved) | set(header) if saved.get(k) != header.get(k))
        if "config" in differ:
            differ.remove("config")
            differ += sorted(k for k in set(saved["config"]) | set(header["config"])
                             if saved["config"].get(k) != header["config"].get(k))
        if differ:
            raise KvmemError(f"cannot resume from {where}: these settings differ from the checkpoint's: "
                             f"{', '.join(differ)}; rerun with the original settings or start over without --resume")
    tensors = {name: t.to(device) for name, t in tensors.items()}
    layers = [int(layer) for layer in meta["layer_order"]]
    return ScanState(layers, {layer: LayerState.from_tensors(f"layer{layer}", tensors, meta["layers"][str(layer)])
                              for layer in layers},
                     TextStore.from_json(meta["texts"]), _position(meta["position"]), int(meta["tokens"]),
                     int(meta["windows"]), int(meta["batches"]), float(meta["seconds"]), tensors.get("unigrams"))


def _position(data: dict) -> StreamPosition:
    """The stream position of a saved state (fields a newer or older kvmem adds or drops are ignored)."""
    known = set(StreamPosition.__dataclass_fields__)
    return StreamPosition(**{k: v for k, v in data.items() if k in known})


def save_state(directory: Path, state, header: dict) -> None:
    """Write the state into ``directory`` (created), replacing an older one atomically per file."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors, meta = _split(state, header)
    generation = secrets.token_hex(8)
    meta["generation"] = generation
    save_file(tensors, directory / "state.safetensors.tmp", metadata={"generation": generation})
    (directory / "state.json.tmp").write_text(json.dumps(meta))
    os.replace(directory / "state.safetensors.tmp", directory / "state.safetensors")
    os.replace(directory / "state.json.tmp", directory / "state.json")


def load_state(directory: Path, header: dict | None, *, device="cpu"):
    """Read a state written by :func:`save_state`; ``header`` (if given) must match the saved one."""
    from safetensors import SafetensorError, safe_open

    directory = Path(directory)
    tensors_path, meta_path = directory / "state.safetensors", directory / "state.json"
    if not meta_path.exists() or not tensors_path.exists():
        legacy = " (an old pickle checkpoint state.pt is never loaded)" if (directory / "state.pt").exists() else ""
        raise KvmemError(f"nothing to resume: no checkpoint at {directory}{legacy}; scan without --resume")
    try:
        meta = json.loads(meta_path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise KvmemError(f"checkpoint {meta_path} is not JSON; delete {directory} and scan again") from None
    try:
        with safe_open(tensors_path, framework="pt") as handle:
            generation = (handle.metadata() or {}).get("generation")
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    except (SafetensorError, OSError, ValueError) as error:
        raise KvmemError(f"checkpoint {tensors_path} is not a safetensors file ({str(error).splitlines()[0]}); "
                         f"delete {directory} and scan again") from None
    if generation != meta.get("generation"):
        raise KvmemError(f"checkpoint {directory} is torn (its two files come from different saves); "
                         f"delete it and scan again")
    return _join(tensors, meta, header, str(directory), device)


def state_to_bytes(state, header: dict) -> bytes:
    """The same content as a saved state, as one byte string (for gathering between ranks)."""
    from safetensors.torch import save

    tensors, meta = _split(state, header)
    blob = save(tensors)
    head = json.dumps(meta).encode()
    return len(head).to_bytes(8, "little") + head + blob


def state_from_bytes(data: bytes, *, device="cpu"):
    from safetensors.torch import load

    size = int.from_bytes(data[:8], "little")
    meta = json.loads(data[8:8 + size])
    return _join(load(data[8 + size:]), meta, None, "a rank's state", device)
