"""Merge shard atlases (``kvmem scan --shard i/N``) into the atlas one scan of the whole corpus gives.

Each shard atlas keeps its scan state (``state/``: tensors and JSON); the merge reads those
states, combines them with :meth:`kvmem.scanning.statistics.ScanState.merge` (the same merge
torchrun's ranks use) and writes the tables with the scan's own writer.
"""

from __future__ import annotations

from pathlib import Path

from kvmem.atlas_origin import check_model, load_scanned_model
from kvmem.errors import KvmemError
from kvmem.manifest import Manifest

__all__ = ["merge"]

# manifest sections every shard of one scan shares (shard index and timing differ)
_SAME = ("format_version", "model", "corpus", "layers", "tokenization", "scan", "projection")


def _shard_of(path: Path) -> tuple[Manifest, tuple[int, int]]:
    manifest_path = path / "manifest.json"
    if not manifest_path.exists():
        raise KvmemError(f"{path} is not an atlas (no manifest.json); pass the shard atlas directories")
    manifest = Manifest.read(manifest_path)
    shard = manifest.shard
    if shard[1] < 2 or not (path / "state").exists():
        raise KvmemError(f"{path} is not a shard atlas (scanned without --shard i/N, or by an older kvmem); "
                         f"merge the atlases of one 'kvmem scan --shard i/N' run")
    return manifest, shard


def merge(atlases: list, *, out, overwrite: bool = False, model=None, progress: bool = False):
    """Merge the N shard atlases of one scan into ``out``; returns the merged Atlas.

    ``model``: the scanned model (loaded from the manifest's name when None); it is needed for
    the vocabulary strings and value projections, which come from the per-model cache.
    """
    from kvmem.atlas import open_atlas
    from kvmem.atomic import held_lock
    from kvmem.scanning.checkpoint import load_state
    from kvmem.scanning.progress import Phases
    from kvmem.scanning.statistics import compose
    from kvmem.scanning.writer import STATE_DIR, write_atlas

    paths = [Path(getattr(a, "path", a)) for a in atlases]
    if not paths:
        raise KvmemError("merge needs the shard atlases of one scan")
    target = Path(out)
    if target.exists() and not overwrite:
        raise KvmemError(f"output directory {target} already exists; pass --overwrite or another --out")
    found = [_shard_of(p) for p in paths]
    first, (_, count) = found[0]
    for path, (manifest, shard) in zip(paths, found):
        for what, mine, theirs in (("dtype", manifest.engine.get("dtype"), first.engine.get("dtype")),):
            if mine != theirs:
                raise KvmemError(f"cannot merge {path} with {paths[0]}: {path} was scanned with {what} {mine}, "
                                 f"{paths[0]} with {theirs} (their sums differ); rescan {path} with {what} {theirs}")
        if shard[1] != count:
            raise KvmemError(f"{path} is shard {shard[0]}/{shard[1]}, {paths[0]} is one of {count}: these come "
                             f"from different scans")
        differ = [key for key in _SAME if getattr(manifest, key) != getattr(first, key)]
        if differ:
            raise KvmemError(f"cannot merge {path} with {paths[0]}: their {', '.join(differ)} differ "
                             f"(shards of one scan share everything but the shard index)")
    indices = [shard[0] for _, shard in found]
    twice = sorted({i for i in indices if indices.count(i) > 1})
    if twice:
        raise KvmemError(f"shard(s) {', '.join(f'{i}/{count}' for i in twice)} given twice; pass each shard once")
    missing = sorted(set(range(count)) - set(indices))
    if missing:
        raise KvmemError(f"incomplete set of shards: missing {', '.join(f'{i}/{count}' for i in missing)}; "
                         f"scan them with --shard i/{count} and merge all {count}")

    if model is None:
        model = load_scanned_model(first)  # the manifest's name, revision and dtype; fingerprint checked
    else:
        check_model(first, model)  # the one fingerprint policy: a merge recomputes the atlas's numbers
    phases = Phases(progress)
    state = None
    config, plan = first.config, first.plan  # both record shard 0/1: a shard's part is in its timing
    statistics = compose(config, gated=model.gated)
    with phases.phase("read", total=len(paths)) as bar:
        for path in paths:
            part = load_state(path / STATE_DIR, None, statistics, device="cpu")
            state = part if state is None else state.merge(part)
            bar.update()
    corpus = {k: v for k, v in first.corpus.items() if k not in ("documents", "sha256_chain")}
    run = {"merged_from": [str(p) for p in paths], "shard_seconds": [m.timing.get("total_seconds") for m, _ in found]}
    with held_lock(target.with_name(f".{target.name}.lock"), f"the output {target}"):
        write_atlas(target, model, corpus, config, plan, state, overwrite=overwrite, phases=phases, run=run)
    return open_atlas(target)
