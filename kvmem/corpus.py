"""Corpora: real text as a re-iterable stream of documents, each with its place in the stream and a stable id.

Sources (:func:`open_corpus`):
- built-in, nothing to install: ``pydoc`` (the running Python's ``pydoc_data.topics``) and
  ``stdlib-docs`` (docstrings of the standard library, read with ``ast``);
- ``docs:PACKAGE[,PACKAGE...]``: docstrings of installed packages (``stdlib`` names the standard
  library), read with ``ast`` without importing them, one record per module (its docstrings joined
  by blank lines, so ``--unit paragraph`` gives one docstring each); a docstring already read is
  skipped; each package's licence (from its metadata) is recorded with the corpus;
- a path: ``.txt``/``.txt.gz``, ``.jsonl``/``.jsonl.gz`` (a chosen text field), ``.parquet``
  (a text column), or a directory of these (sorted, recursive);
- a Python list of strings, a ``datasets.Dataset``, or a :class:`Corpus` (split again by ``unit``);
- ``hf:NAME[:CONFIG][:SPLIT]`` through the ``datasets`` library (streaming; needs a hub).

``unit`` splits each source record further: ``document`` (as is; a .txt file is one
document), ``paragraph`` (blank-line separated), ``line`` or ``sentence``. A record's id names its
source and place, e.g. ``pydoc:TOPIC``, ``FILE`` (relative to a directory), ``FILE:LINE`` (JSONL),
``FILE:ROW`` (parquet), ``list:I``, ``hf:NAME:I``; a unit adds ``#pI``, ``#lI`` or ``#sI``. Parts
holding only whitespace are dropped, and lone UTF-16 surrogates become U+FFFD.
:meth:`Corpus.describe` is what a manifest records.

How documents become model inputs (tokens, windows, BOS, batches, shards) is :mod:`kvmem.plan`'s rule.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import re
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvmem.errors import KvmemError

__all__ = ["Document", "Corpus", "open_corpus", "BUILTIN_CORPORA", "UNITS"]

UNITS = ("document", "paragraph", "line", "sentence")
BUILTIN_CORPORA = {
    "pydoc": "the running Python's pydoc_data.topics (about 465k characters, PSF licence)",
    "stdlib-docs": "docstrings of the running Python's standard library (about 1.6M characters, PSF licence)",
    "docs:PACKAGE[,PACKAGE...]": "docstrings of installed packages, e.g. docs:stdlib,pandas,numpy (about 6.3M "
                                 "characters: PSF, BSD-3-Clause, BSD-3-Clause licences)",
}
SUFFIXES = (".txt", ".txt.gz", ".jsonl", ".jsonl.gz", ".parquet")

# lone UTF-16 surrogates (possible in Python strings, never valid text) become U+FFFD
_SURROGATE = re.compile("[\ud800-\udfff]")

# a sentence ends at . ! or ? followed by whitespace and an upper-case letter, digit or quote
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[\"'(\[A-Z0-9])")


@dataclass(frozen=True)
class Document:
    """One document: ``index`` is its place in the stream, ``id`` a stable readable name."""

    index: int
    id: str
    text: str


@dataclass
class Corpus:
    """A re-iterable stream of :class:`Document`. Build it with :func:`open_corpus`."""

    spec: str
    unit: str
    _records: Callable[[], Iterable[tuple[str, str]]] = field(repr=False)
    details: dict = field(default_factory=dict)

    def __iter__(self) -> Iterator[Document]:
        index = 0
        for record_id, text in self._records():
            text = _SURROGATE.sub("\ufffd", text)
            for part_id, part in _split(record_id, text, self.unit):
                if part.strip():
                    yield Document(index, part_id, part)
                    index += 1

    def describe(self) -> dict:
        return {"spec": self.spec, "unit": self.unit, **self.details}

    def fingerprint(self) -> str:
        """sha256 over every (id, text) of the stream; reads the whole corpus."""
        digest = hashlib.sha256()
        for document in self:
            digest.update(document.id.encode())
            digest.update(b"\0")
            digest.update(document.text.encode())
            digest.update(b"\0")
        return digest.hexdigest()


def _split(record_id: str, text: str, unit: str) -> Iterator[tuple[str, str]]:
    if unit == "document":
        yield record_id, text
    elif unit == "paragraph":
        for i, part in enumerate(p for p in re.split(r"\n\s*\n", text) if p.strip()):
            yield f"{record_id}#p{i}", part.strip()
    elif unit == "line":
        for i, part in enumerate(line for line in text.splitlines() if line.strip()):
            yield f"{record_id}#l{i}", part.strip()
    else:  # sentence
        j = 0
        for paragraph in (p for p in re.split(r"\n\s*\n", text) if p.strip()):
            for sentence in _SENTENCE_END.split(" ".join(paragraph.split())):
                if sentence.strip():
                    yield f"{record_id}#s{j}", sentence.strip()
                    j += 1


def open_corpus(source: Any, *, unit: str = "document", text_field: str = "text") -> Corpus:
    """Open a corpus (see the module docstring for what ``source`` may be).

    >>> docs = list(open_corpus(["One. Two.", "Three."], unit="sentence"))
    >>> [(d.index, d.id, d.text) for d in docs]
    [(0, 'list:0#s0', 'One.'), (1, 'list:0#s1', 'Two.'), (2, 'list:1#s0', 'Three.')]
    """
    if unit not in UNITS:
        raise KvmemError(f"unknown corpus unit {unit!r}; choose one of {', '.join(UNITS)}")
    if isinstance(source, Corpus):
        return Corpus(source.spec, unit, source._records, source.details)
    if isinstance(source, (list, tuple)):
        items = list(source)
        bad = next((i for i, t in enumerate(items) if not isinstance(t, str)), None)
        if bad is not None:
            raise KvmemError(f"corpus list item {bad} is a {type(items[bad]).__name__}, not a string")
        return Corpus(f"list[{len(items)}]", unit, lambda: ((f"list:{i}", t) for i, t in enumerate(items)))
    if _is_dataset(source):
        return _dataset_corpus(source, unit, text_field, spec=f"dataset[{len(source)}]")
    if not isinstance(source, (str, Path)):
        raise KvmemError(f"cannot read a corpus from a {type(source).__name__}; pass a path, a built-in name, "
                         f"'hf:NAME', a list of strings or a datasets.Dataset")
    name = str(source)
    if name == "pydoc":
        return Corpus("pydoc", unit, _pydoc_records, {"python": sys.version.split()[0]})
    if name == "stdlib-docs":
        return Corpus("stdlib-docs", unit, _stdlib_records, {"python": sys.version.split()[0]})
    if name.startswith("docs:"):
        return _package_docs_corpus(name, unit)
    if name.startswith("hf:"):
        return _hub_corpus(name, unit, text_field)
    path = Path(name).expanduser()
    if not path.exists():
        raise KvmemError(f"corpus {name!r} not found: not a file, a directory, a built-in corpus "
                         f"({', '.join(BUILTIN_CORPORA)}) or 'hf:NAME'")
    files = _corpus_files(path)
    return Corpus(name, unit, lambda: _file_records(files, path, text_field), {"text_field": text_field})


def _corpus_files(path: Path) -> list[Path]:
    if path.is_file():
        if not path.name.endswith(SUFFIXES):
            raise KvmemError(f"{path}: unsupported corpus file type; use one of {', '.join(SUFFIXES)}")
        return [path]
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.name.endswith(SUFFIXES))
    if not files:
        raise KvmemError(f"corpus directory {path} holds no {', '.join(SUFFIXES)} files")
    return files


def _file_records(files: list[Path], root: Path, text_field: str) -> Iterator[tuple[str, str]]:
    for file in files:
        name = file.name if file == root else file.relative_to(root).as_posix()
        if file.name.endswith((".txt", ".txt.gz")):
            yield name, _decode(file, _read_bytes(file))
        elif file.name.endswith((".jsonl", ".jsonl.gz")):
            yield from _jsonl_records(file, name, text_field)
        else:
            yield from _parquet_records(file, name, text_field)


def _read_bytes(file: Path) -> bytes:
    try:
        if file.name.endswith(".gz"):
            with gzip.open(file, "rb") as handle:
                return handle.read()
        return file.read_bytes()
    except (OSError, EOFError) as error:
        raise KvmemError(f"{file}: cannot read it ({error})") from None


def _decode(file: Path, data: bytes, where: str | None = None) -> str:
    """UTF-8 text, or a one-line error naming the file, the record (``where``) and the first bad byte."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        at = f"{where}, byte {error.start} of it" if where else f"byte offset {error.start}"
        raise KvmemError(f"{file}: bytes at {at} are not valid UTF-8 ({data[error.start:error.end]!r}); "
                         f"re-encode the file as UTF-8") from None


def _jsonl_records(file: Path, name: str, text_field: str) -> Iterator[tuple[str, str]]:
    for number, raw in enumerate(_read_bytes(file).split(b"\n"), start=1):
        if not raw.strip():
            continue
        line = _decode(file, raw, f"line {number}")
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise KvmemError(f"{file}: line {number} is not valid JSON ({error.msg})") from None
        if not isinstance(record, dict) or text_field not in record:
            raise KvmemError(f"{file}: line {number} has no {text_field!r} field; "
                             f"choose the text field with text_field= (--text-field)")
        text = record[text_field]
        if not isinstance(text, str):
            raise KvmemError(f"{file}: line {number}: field {text_field!r} is a {type(text).__name__}, not a string")
        yield f"{name}:{number}", text


def _parquet_records(file: Path, name: str, text_field: str) -> Iterator[tuple[str, str]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(file)
    except Exception as error:  # pyarrow raises several types for a bad file
        raise KvmemError(f"{file}: not a readable parquet file ({error})") from None
    if text_field not in parquet.schema_arrow.names:
        raise KvmemError(f"{file}: no column {text_field!r}; columns are {parquet.schema_arrow.names}; "
                         f"choose one with text_field= (--text-field)")
    column_type = parquet.schema_arrow.field(text_field).type
    as_bytes = {pa.string(): pa.binary(), pa.large_string(): pa.large_binary(), pa.binary(): pa.binary(),
                pa.large_binary(): pa.large_binary()}.get(column_type)
    if as_bytes is None:
        raise KvmemError(f"{file}: column {text_field!r} holds {column_type}, not text; "
                         f"choose a text column with text_field= (--text-field)")
    row = 0
    for batch in parquet.iter_batches(columns=[text_field]):
        # read as bytes (a cast that copies nothing) so that invalid UTF-8 is reported with its row
        for data in batch.column(0).cast(as_bytes).to_pylist():
            if data is not None:
                yield f"{name}:{row}", _decode(file, data, f"row {row}")
            row += 1


def _is_dataset(source: Any) -> bool:
    return hasattr(source, "column_names") and hasattr(source, "features") and hasattr(source, "__getitem__")


def _dataset_corpus(dataset: Any, unit: str, text_field: str, *, spec: str) -> Corpus:
    names = dataset.column_names
    if names is not None and text_field not in names:
        raise KvmemError(f"dataset {spec} has no column {text_field!r}; columns are {names}")

    def records():
        for i, row in enumerate(dataset):
            yield f"{spec}:{i}", row[text_field] or ""

    return Corpus(spec, unit, records, {"text_field": text_field})


def _hub_corpus(name: str, unit: str, text_field: str) -> Corpus:
    parts = name[3:].split(":")
    if not parts[0] or len(parts) > 3:
        raise KvmemError(f"bad hub corpus {name!r}; write hf:NAME[:CONFIG][:SPLIT], e.g. hf:wikitext:wikitext-103-raw-v1:train")
    dataset, config, split = parts[0], (parts[1] if len(parts) > 1 else None) or None, (parts[2] if len(parts) > 2 else "train")
    try:
        import datasets
    except ImportError:
        raise KvmemError("hub corpora need the 'datasets' package; install it with: pip install datasets") from None

    def records():
        try:
            stream = datasets.load_dataset(dataset, config, split=split, streaming=True)
            for i, row in enumerate(stream):
                if text_field not in row:
                    raise KvmemError(f"{name}: rows have no {text_field!r} field; fields are {list(row)}")
                yield f"{name}:{i}", row[text_field] or ""
        except (OSError, ConnectionError, ValueError) as error:
            raise KvmemError(f"could not stream {name} from the hub ({str(error).splitlines()[0]}); "
                             f"use a local file or a built-in corpus ({', '.join(BUILTIN_CORPORA)})") from None

    return Corpus(name, unit, records, {"dataset": dataset, "config": config, "split": split, "text_field": text_field})


def _pydoc_records() -> Iterator[tuple[str, str]]:
    from pydoc_data.topics import topics

    for key in sorted(topics):
        yield f"pydoc:{key}", topics[key]


def _stdlib_root() -> Path:
    import sysconfig

    return Path(sysconfig.get_paths()["stdlib"])


_STDLIB_SKIP = {"test", "tests", "idlelib", "site-packages", "dist-packages", "lib2to3", "turtledemo", "__pycache__"}


def _docstrings(root: Path, skip: set[str]) -> Iterator[tuple[str, str, str]]:
    """(module, qualname, docstring) of every module, class and function under ``root``, in sorted file
    order (the files are parsed, never imported)."""
    import ast

    for file in sorted(root.rglob("*.py")):
        relative = file.relative_to(root)
        if skip.intersection(relative.parts):
            continue
        try:
            tree = ast.parse(file.read_bytes())
        except (SyntaxError, ValueError):
            continue
        module = ".".join(relative.with_suffix("").parts)
        for qualname, node in _docstring_nodes(tree, ""):
            text = ast.get_docstring(node, clean=True)
            if text:
                yield module, qualname, text


def _stdlib_records() -> Iterator[tuple[str, str]]:
    for module, qualname, text in _docstrings(_stdlib_root(), _STDLIB_SKIP):
        yield f"stdlib-docs:{module}{qualname}", text


def _package_docs_corpus(name: str, unit: str) -> Corpus:
    """``docs:a,b,c``: the docstrings of installed packages (``stdlib``: the standard library), deduplicated."""
    import importlib.metadata
    import importlib.util

    packages = [p.strip() for p in name[5:].split(",") if p.strip()]
    if not packages:
        raise KvmemError(f"bad corpus {name!r}; write docs:PACKAGE[,PACKAGE...], e.g. docs:stdlib,pandas,numpy")
    roots, licences = [], {}
    for package in packages:
        if package == "stdlib":
            roots.append((package, _stdlib_root(), _STDLIB_SKIP))
            licences[package] = f"PSF-2.0 (Python {sys.version.split()[0]})"
            continue
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise KvmemError(f"corpus {name!r}: {package!r} is not an installed package; install it or drop it "
                             f"from the list")
        roots.append((package, Path(list(spec.submodule_search_locations)[0]), {"tests", "test", "__pycache__"}))
        try:
            meta = importlib.metadata.metadata(package)
            licence = meta.get("License-Expression") or meta.get("License") or "unknown"
            licences[package] = f"{licence.splitlines()[0][:80]} ({package} {meta.get('Version')})"
        except importlib.metadata.PackageNotFoundError:
            licences[package] = "unknown"

    def records() -> Iterator[tuple[str, str]]:
        seen: set[bytes] = set()
        for package, root, skip in roots:
            current, parts = None, []
            for module, _, text in _docstrings(root, skip):
                if module != current:
                    if parts:
                        yield f"docs:{package}:{current}", "\n\n".join(parts)
                    current, parts = module, []
                digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()
                if digest not in seen:  # shared docstring templates are read once
                    seen.add(digest)
                    parts.append(text)
            if parts:
                yield f"docs:{package}:{current}", "\n\n".join(parts)

    return Corpus(name, unit, records, {"packages": packages, "licences": licences, "deduplicated": True})


def _docstring_nodes(node, prefix: str):
    import ast

    yield prefix, node
    for child in getattr(node, "body", []):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield from _docstring_nodes(child, f"{prefix}.{child.name}")
