"""Write a finished scan's atlas atomically: the statistics' tables (:mod:`kvmem.scanning.statistics`) and
those of :mod:`kvmem.scanning.shared_tables` in writer threads as they are built, the projection tables when the
scan computes them eagerly (from the per-model cache), the manifest last."""

from __future__ import annotations

import os
import queue
import shutil
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

from kvmem import environment
from kvmem.atomic import staged_directory
from kvmem.conventions import CONVENTIONS, DEFAULT_CONVENTION
from kvmem.manifest import Manifest
from kvmem.models import Model
from kvmem.plan import TokenPlan
from kvmem.scanning.bins import HIST_BINS, bin_edges
from kvmem.scanning.checkpoint import save_state
from kvmem.scanning.config import ScanConfig
from kvmem.scanning.parquet import LayerParts, write_parquet
from kvmem.scanning.projection import cached_projection_files
from kvmem.scanning.shared_tables import contexts_table, neurons_table
from kvmem.scanning.statistics import STATISTICS, ScanState
from kvmem.schema import FORMAT_VERSION, conform

__all__ = ["write_atlas", "TableWriter", "TableStream", "build_manifest", "torch_threads", "link_or_copy", "STATE_DIR"]

STATE_DIR = "state"  # inside a shard atlas: its mergeable scan state (see kvmem.scanning.checkpoint)
PARTS_AHEAD = 2  # layer parts of a table built but not yet written, at most, while an atlas is written


@contextmanager
def torch_threads(count: int):
    """torch's intra-op threads set to ``count`` inside the block (restored after). While the writer
    threads encode, torch's own workers would wait on each other for a core: a gather that takes
    0.3 ms alone took 5 ms so."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def write_atlas(target: Path, model: Model, corpus: dict, config: ScanConfig, plan: TokenPlan, state: ScanState, *,
                overwrite: bool, phases, world: int = 1, keep_state: bool = False, run: dict | None = None) -> None:
    """Tables from a finished (merged) scan state, the projection tables (``config.projections == "eager"``:
    from the per-model cache), manifest last.

    The statistics' layer tables (triggers, samples, histograms, ...) are built here, a layer of every table at a
    time, and each is encoded by a writer thread of its own as its parts come, so the encoding of the largest one
    (the samples) never waits for its own parts to be built (phase "texts": every table built and written;
    "write": the projections linked and the manifest)."""
    layers = state.layers
    statistics = state.statistics
    with TableWriter(target, overwrite=overwrite, columns=statistics.table_columns()) as out:
        projections = {"files": {}, "cached": None, "method": None}
        if config.projections == "eager":  # computed (a model's first scan, both cores) or found in the cache
            with phases.phase("projections", total=len(layers)) as bar:  # while no writer thread runs
                projections = cached_projection_files(model, layers, config, bar=bar)
        tables = list(statistics.layer_tables())
        with phases.phase("texts", total=len(tables) + 3) as bar:
            # The neurons table first, before any writer thread runs: its torch reductions over the weights
            # keep torch's threads.
            out.add("neurons", neurons_table(model, state))
            bar.update()
            with torch_threads(1):  # gathers and copies only; torch's workers would wait on the writers' cores
                # a layer of every table at a time: the writers encode while this thread builds, each at most
                # PARTS_AHEAD parts behind (memory: a few layers' parts, whatever the atlas's size)
                streams = [(out.stream(table, ahead=PARTS_AHEAD), table, statistic) for table, statistic in tables]
                for layer in layers:
                    for stream, table, statistic in streams:
                        stream.put(state.layer_states[layer].part(table, layer, statistic))
                for stream, _, _ in streams:
                    stream.close()
                    bar.update()
                out.add("contexts", contexts_table(model, config, plan, state, state.kept_positions()))
                bar.update()
                whole = {name: table for s in statistics.scan for name, table in s.scan_tables(state.scan_states[s.name]).items()}
                for name, cls in STATISTICS.items():  # tables an atlas holds empty without their statistic
                    if name not in statistics:
                        whole.update(cls.absent_tables())
                for name, table in whole.items():
                    out.add(name, table)
                bar.update()
                out.wait()

        def manifest() -> Manifest:
            timing = {"phases": phases.so_far(), "total_seconds": phases.elapsed(),
                      "stream_tokens_per_second": round(state.tokens / state.seconds, 1) if state.seconds else None,
                      "world_size": world, "batches": state.batches, "shard": list(config.shard),
                      "projections_cached": projections["cached"], **(run or {})}
            return build_manifest(model, corpus, config, plan, state, timing, projection_method=projections["method"])

        with phases.phase("write", total=1) as bar:
            for name, source in projections["files"].items():
                out.link(name, source)
            out.finish(manifest, state=state if keep_state else None)
            bar.update()


class TableWriter:
    """Writes an atlas into a hidden sibling directory, renamed into place when the block ends
    without error: a crash leaves no half atlas (:func:`kvmem.atomic.staged_directory`).

    ``add(name, table)`` starts writing a table at once, in one of two threads (parquet encoding and
    compression release the GIL), so callers build the next table meanwhile; ``stream(name)`` does the
    same for a table handed over in parts (whole layers, in table order, or functions that build them),
    each written as it comes by a thread of the stream's own (so streams fed in turns never wait on each
    other); ``wait`` waits for every table so far; ``finish`` waits too, keeps the scan
    state of a shard atlas, and writes the manifest last. An existing ``target`` is refused
    (FileExistsError) unless ``overwrite``.

        with TableWriter(path, overwrite=False) as out:
            out.add("neurons", table)
            triggers = out.stream("triggers")
            for part in parts:
                triggers.put(part)
            triggers.close()
            out.finish(manifest)
    """

    def __init__(self, target: str | os.PathLike, *, overwrite: bool, columns: dict | None = None):
        self.target = Path(target)
        self.columns = columns or {}  # columns of tables kvmem.schema does not define (a statistic's own)
        if self.target.exists() and not overwrite:
            raise FileExistsError(self.target)
        self._futures: list = []
        self._streams: list[TableStream] = []
        self._stream_pools: list[ThreadPoolExecutor] = []

    def __enter__(self) -> TableWriter:
        self._stage = staged_directory(self.target)
        self.directory = self._stage.__enter__()
        self._pool = ThreadPoolExecutor(max_workers=2)
        return self

    def add(self, name: str, table: pa.Table) -> None:
        """Write ``table`` as ``name.parquet`` (checked against :data:`kvmem.schema.COLUMNS`), in a thread."""
        self._futures.append(self._pool.submit(write_parquet, self.directory / f"{name}.parquet",
                                               conform(table, name, self.columns.get(name))))

    def stream(self, name: str, *, ahead: int = 0) -> TableStream:
        """A table written part by part in a thread of its own as :meth:`TableStream.put` hands the parts over;
        the same file as ``add`` of the parts joined. ``ahead``: parts handed over but not yet written before
        ``put`` waits (0: no limit). Close it (:meth:`TableStream.close`) before ``finish``."""
        stream = TableStream(name, self.columns.get(name), ahead=ahead)
        self._streams.append(stream)
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"kvmem-{name}")
        self._stream_pools.append(pool)
        self._futures.append(pool.submit(stream.drain, self.directory / f"{name}.parquet"))
        return stream

    def link(self, name: str, source: str | os.PathLike) -> None:
        """Link (or copy) an already written parquet file in as ``name.parquet``."""
        link_or_copy(Path(source), self.directory / f"{name}.parquet")

    def wait(self) -> None:
        """Wait for every table handed over so far (the first that failed raises here)."""
        for future in self._futures:
            future.result()

    def finish(self, manifest, *, state: ScanState | None = None) -> None:
        """Wait for every table, keep ``state`` (shard atlases, for ``kvmem merge``), write the manifest.
        ``manifest``: a :class:`~kvmem.manifest.Manifest`, or a function returning one (called last, so
        it can time the writing)."""
        self.wait()
        if state is not None:
            save_state(self.directory / STATE_DIR, state, {"shard": True}, tensor_file="state.safetensors")
        (manifest() if callable(manifest) else manifest).write(self.directory / "manifest.json")

    def __exit__(self, kind, error, traceback) -> bool | None:
        for stream in self._streams:  # a failed build leaves a stream open: let its thread end
            stream.close()
        for future in self._futures:
            future.cancel()
        for pool in (self._pool, *self._stream_pools):
            pool.shutdown(wait=True)  # no thread writes into the directory once it is renamed or removed
        return self._stage.__exit__(kind, error, traceback)


class TableStream:
    """The parts of one table on their way to its writer thread (see :meth:`TableWriter.stream`)."""

    def __init__(self, name: str, columns: dict | None = None, *, ahead: int = 0):
        self.name, self.columns = name, columns
        self._parts: queue.Queue = queue.Queue(maxsize=ahead)
        self._closed = False
        self._ended = threading.Event()  # the writer thread is done (finished or failed): nobody takes parts

    def put(self, part: pa.Table | Callable[[], pa.Table | None] | None) -> None:
        """Hand over the next part (rows of whole layers, in table order), or a function that builds it in the
        writer thread; None (or a function returning None): nothing for this layer. Waits while the stream
        holds ``ahead`` parts not yet written; once its writer has failed, parts are dropped (the failure is
        raised by :meth:`TableWriter.wait`)."""
        if self._closed:
            raise ValueError(f"table stream {self.name!r} is closed")
        if part is not None:
            self._hand(part)

    def close(self) -> None:
        """No more parts (idempotent): the thread finishes the file."""
        if not self._closed:
            self._closed = True
            self._hand(None)

    def _hand(self, item) -> None:
        while not self._ended.is_set():
            try:
                self._parts.put(item, timeout=0.05)
                return
            except queue.Full:
                continue

    def drain(self, path: Path) -> None:
        """Run in a writer thread: write each part as it comes (a callable: built here first), until :meth:`close`."""
        try:
            with LayerParts(path) as out:
                while (part := self._parts.get()) is not None:
                    part = part() if callable(part) else part
                    if part is not None:
                        out.write(conform(part, self.name, self.columns))
        finally:
            self._ended.set()


def link_or_copy(source: Path, target: Path) -> None:
    """A hard link to a cached file (no bytes rewritten), else a copy (another file system, no links).

    The atlas stays self-contained: deleting it, or the cache, leaves the other's file intact, and
    neither is ever written in place (the cache and atlases are replaced by renaming directories)."""
    try:
        os.link(source, target)
    except OSError:
        try:
            shutil.copyfile(source, target)
        except OSError as error:  # the atlas's file system failed (full, a size limit), not the source:
            raise OSError(error.errno, error.strerror) from None  # the command names its --out


def _installed_version(distribution: str) -> str:
    """A package's installed version without importing it (TransformerLens takes seconds to import)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(distribution)
    except PackageNotFoundError:
        return "unknown"


def build_manifest(model: Model, corpus: dict, config: ScanConfig, plan: TokenPlan, state: ScanState, timing: dict,
                   *, projection_method: str | None = None) -> Manifest:
    """The manifest of an atlas. Everything but ``timing`` is the same whether one process or many scanned.
    ``projection_method``: the method that computed the projection tables (None: the atlas holds none,
    ``scan.projections`` is lazy)."""
    import torch
    import transformers

    from kvmem import __version__
    from kvmem.anatomy import ffn_params

    position = state.position
    plan_data = {**plan.to_dict(), "shard": [0, 1]}
    scan = {**config.to_dict(), "shard": [0, 1]}
    return Manifest(
        format_version=FORMAT_VERSION,
        kvmem_version=__version__,
        model=model.describe(),
        anatomy={"ffn_params_per_layer": ffn_params(model.d_model, model.d_ff, gated=model.gated, bias=model.has_bias)},
        corpus={**corpus, "documents": position.documents, "sha256_chain": position.corpus_digest},
        tokens=state.tokens,
        windows=state.windows,
        layers=list(state.layers),
        tokenization=plan_data,
        scan=scan,
        histogram={"bins": HIST_BINS, "edges": [e if np.isfinite(e) else ("inf" if e > 0 else "-inf")
                                                for e in bin_edges()]},
        projection={"conventions": {c: CONVENTIONS[c].formula for c in config.conventions},
                       "default_convention": DEFAULT_CONVENTION if DEFAULT_CONVENTION in config.conventions
                       else config.conventions[0], "top_n": config.top_n,
                    "keys": "score = W_E[token] . k (input embedding, no norm)",
                    "method": projection_method,
                    "tables": "written" if projection_method else "on demand (kvmem project writes them)",
                    "order": "top: score descending, bottom: score ascending; ties by token id ascending"},
        timing=timing,
        engine={"statistics": state.statistics.names, "device": str(model.device),
                "dtype": str(model.dtype).removeprefix("torch.")},
        environment={"torch": torch.__version__, "transformers": transformers.__version__,
                     "transformer_lens": _installed_version("transformer-lens"),
                     "device": str(model.device), "dtype": str(model.dtype).removeprefix("torch."),
                     "variables": environment.recorded()},
    )
