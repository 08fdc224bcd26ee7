"""A results directory: each frame as ``NAME.parquet`` beside ``NAME.json`` (its ``frame.attrs``), and ``index.json``.

Written by :func:`save_results` (whole directory staged, so readers see the old or the complete new
one) and read back by :func:`load_results`, so figures and tables can be regenerated from saved
results without the model or the atlas.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pandas as pd

from kvmem.atomic import staged_directory
from kvmem.errors import KvmemError

__all__ = ["load_results", "save_results"]

_NAME = re.compile(r"^[a-z][a-z0-9_]*$")


def save_results(frames: dict[str, pd.DataFrame], out: str | os.PathLike, *, overwrite: bool = False,
                 extra: dict | None = None) -> Path:
    """Write ``frames`` (name -> DataFrame) into the directory ``out``; ``extra`` goes into ``index.json``."""

    out = Path(out)
    if out.exists() and not overwrite:
        raise KvmemError(f"results directory {out} exists; pass overwrite=True (--overwrite) or another directory")
    bad = [name for name in frames if not _NAME.match(name)]
    if bad:
        raise KvmemError(f"result names must be lower-case identifiers, got {bad}")
    index = {"results": {}, **(extra or {})}
    with staged_directory(out) as staged:
        for name, frame in frames.items():
            frame.to_parquet(staged / f"{name}.parquet", index=False)
            (staged / f"{name}.json").write_text(json.dumps(frame.attrs, indent=2, default=str) + "\n")
            index["results"][name] = {"rows": len(frame), "columns": list(map(str, frame.columns)),
                                      "experiment": frame.attrs.get("experiment")}
        (staged / "index.json").write_text(json.dumps(index, indent=2, default=str) + "\n")
    return out


def load_results(path: str | os.PathLike) -> dict[str, pd.DataFrame]:
    """Every frame of a results directory written by :func:`save_results`, with its ``attrs`` restored."""
    path = Path(path)
    index_path = path / "index.json"
    if not index_path.exists():
        raise KvmemError(f"{path} is not a results directory (no index.json); write one with "
                         f"kvmem experiment geva2021 --atlas ATLAS --out {path}")
    index = json.loads(index_path.read_text())
    out = {}
    for name in index["results"]:
        try:
            frame = pd.read_parquet(path / f"{name}.parquet")
            frame.attrs = json.loads((path / f"{name}.json").read_text())
        except (OSError, ValueError) as error:
            raise KvmemError(f"cannot read result {name!r} from {path} ({str(error).splitlines()[0]}); write it again") from None
        out[name] = frame
    return out
