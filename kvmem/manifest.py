"""The atlas manifest (``manifest.json``): one versioned dataclass, written, read and validated here.

Every module reads it by attribute (``atlas.manifest.model["d_ff"]``, ``atlas.manifest.plan``).
Format 1 manifests (kvmem 0.1 before the single-pass engine) still open: :meth:`Manifest.from_dict`
fills in what they lack, and says in one line how to rescan what it cannot upgrade.
"""

from __future__ import annotations

import json
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvmem.errors import KvmemError
from kvmem.plan import TokenPlan
from kvmem.schema import FORMAT_VERSION, READABLE_VERSIONS

if TYPE_CHECKING:
    from kvmem.scanning.config import ScanConfig

__all__ = ["Manifest", "FORMAT_VERSION", "READABLE_VERSIONS"]


@dataclass(frozen=True, kw_only=True)
class Manifest:
    """What an atlas holds and how it was made. Everything but ``timing`` is the same whether one
    process scanned or many (ranks, shards).

    format_version: atlas format (see kvmem.schema)     kvmem_version: the writer's version
    model:          ``Model.describe()`` (name, fingerprint, sizes, activation, dtype, ...)
    anatomy:        FFN parameter counts
    corpus:         spec, unit, documents read and the chained sha256 of their (id, text)
    tokens:         positions scored            windows: windows read
    layers:         layers scanned
    tokenization:   ``TokenPlan.to_dict()`` (window, BOS, batching, max_tokens; shard 0/1)
    scan:           ``ScanConfig.to_dict()`` (shard 0/1)
    histogram:      bin count and edges          projection: conventions with formulas, default, top_n,
                    the method that computed the tables and their tie order
    timing:         seconds per phase, total, batches, world size, this atlas's shard, merge sources
    engine:         the ``statistics`` the scan kept (:mod:`kvmem.scanning.statistics`), and the ``device`` and
                    ``dtype`` the model ran in (atlases of an earlier kvmem name a streaming ``backend`` instead)
    environment:    torch / transformers / transformer-lens versions, device, dtype, and ``variables``: kvmem's
                    environment variables set during the scan (:data:`kvmem.environment.VARIABLES`)
    """

    format_version: int
    kvmem_version: str
    model: dict
    corpus: dict
    tokens: int
    layers: list[int]
    tokenization: dict
    scan: dict
    histogram: dict
    projection: dict
    anatomy: dict = field(default_factory=dict)
    windows: int | None = None
    timing: dict = field(default_factory=dict)
    engine: dict = field(default_factory=dict)
    environment: dict = field(default_factory=dict)

    # ---- typed views ----
    @property
    def plan(self) -> TokenPlan:
        return TokenPlan.from_dict(self.tokenization)

    @property
    def config(self) -> ScanConfig:
        from kvmem.scanning.config import ScanConfig

        return ScanConfig.from_dict(self.scan)

    @property
    def shard(self) -> tuple[int, int]:
        """The part of the blocks this atlas scanned (i, n); (0, 1) for a whole or merged scan."""
        return tuple(self.timing.get("shard", (0, 1)))

    # ---- dict / file ----
    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict, *, where: str = "manifest") -> Manifest:
        """Validate and build (the formats of :data:`READABLE_VERSIONS` only)."""
        if not isinstance(data, dict):
            raise KvmemError(f"{where} is not a JSON object; scan again")
        version = data.get("format_version")
        if version not in READABLE_VERSIONS:
            raise KvmemError(f"{where} has atlas format {version}, this kvmem reads format "
                             f"{', '.join(map(str, READABLE_VERSIONS))}; rescan it with this kvmem version "
                             f"(kvmem scan with the settings in its manifest.json)")
        known = {f.name for f in fields(cls)}
        values: dict[str, Any] = {k: v for k, v in data.items() if k in known}
        required = [f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING]
        missing = [name for name in required if name not in values]
        if missing:
            raise KvmemError(f"{where} lacks {', '.join(missing)}: it is damaged or not a kvmem atlas; scan again")
        return cls(**values)

    @classmethod
    def read(cls, path: str | Path) -> Manifest:
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise KvmemError(f"{path} is corrupt ({error}); scan again") from None
        return cls.from_dict(data, where=str(path))

    def write(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")
