"""Write a directory so that readers see the old one or the complete new one, never half of it; read a
parquet file that a writer may be replacing by rename; hold a lock on an output for one process,
or wait for one on a shared cache entry."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from kvmem.errors import KvmemError

__all__ = ["held_lock", "read_replaced_parquet", "staged_directory", "waited_lock"]


@contextmanager
def staged_directory(target: str | os.PathLike, *, mode: int | None = None) -> Iterator[Path]:
    """Yield a hidden sibling directory to fill; when the block succeeds it takes ``target``'s place
    by rename (an existing ``target`` is moved aside first, then deleted). On error nothing changes.

    ``mode``: permissions for the new directory (mkdtemp makes it private to the user).
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.writing-", dir=target.parent))
    if mode is not None:
        tmp.chmod(mode)
    try:
        yield tmp
        if target.exists():
            trash = target.with_name(f".{target.name}.old-{os.getpid()}")
            os.replace(target, trash)
            os.replace(tmp, target)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.replace(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def read_replaced_parquet(path: str | os.PathLike):
    """The pyarrow table in ``path``, read in one pass over one open file.

    ``pq.read_table(path)`` opens the path more than once (footer, then pages); a writer's rename
    between those opens pairs one file's footer with another's pages and the read fails. Raises
    FileNotFoundError when there is no file.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    return pq.read_table(pa.BufferReader(Path(path).read_bytes()))


@contextmanager
def held_lock(path: str | os.PathLike, what: str) -> Iterator[None]:
    """Hold an exclusive advisory lock (``flock``) on the file ``path`` for the block, or raise
    :class:`kvmem.errors.KvmemError` at once, naming the process that holds it.

    ``what``: the thing the lock guards, for the message. The lock file holds the holder's pid and is
    removed on exit; a lock file whose holder died is taken over (the kernel drops a dead process's lock).
    """
    with _flocked(Path(path), wait=False, what=what):
        yield


@contextmanager
def waited_lock(path: str | os.PathLike) -> Iterator[None]:
    """Hold an exclusive advisory lock on the file ``path`` for the block, waiting for any other holder.
    For shared caches: the first process builds an entry while the others wait, then find it built.
    Raises OSError where the lock file cannot be created (a read-only cache)."""
    with _flocked(Path(path), wait=True, what=str(path)):
        yield


@contextmanager
def _flocked(path: Path, *, wait: bool, what: str) -> Iterator[None]:
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        handle = open(path, "a+")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "another process"
            handle.close()
            raise KvmemError(f"{what} is in use by a running kvmem (pid {holder}); wait for it to finish, or "
                             f"write somewhere else") from None
        try:
            same = os.path.samestat(os.fstat(handle.fileno()), os.stat(path))
        except FileNotFoundError:
            same = False
        if same:  # not a file that its last holder removed between our open and our lock
            break
        handle.close()
    try:
        handle.seek(0)
        handle.truncate()
        handle.write(str(os.getpid()))
        handle.flush()
        yield
    finally:
        path.unlink(missing_ok=True)
        handle.close()
