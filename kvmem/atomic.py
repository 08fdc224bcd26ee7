"""Write a directory so that readers see the old one or the complete new one, never half of it; read a
parquet file that a writer may be replacing by rename; hold a lock on an output for one process,
or wait for one on a shared cache entry (locks from ``filelock``, as the Hugging Face libraries use them)."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import filelock

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
    """Hold an exclusive lock on the file ``path`` for the block, or raise :class:`kvmem.errors.KvmemError`
    at once, naming the process that holds it.

    ``what``: the thing the lock guards, for the message. The lock file holds its holder's pid while the
    block runs and is removed before the lock is released, so the file system is left as it was found; a
    process that locked a file another holder had just removed sees it (the path names another file or
    none) and is refused like any other. A holder that died holds nothing (the operating system drops a
    dead process's lock) and leaves the file, which the next holder takes over.
    """
    path = Path(path)
    lock = _lock(path, timeout=0)
    try:
        lock.acquire()
        if filelock.has_fcntl and not _still_named(path, lock):
            lock.release()
            raise filelock.Timeout(str(path))
    except filelock.Timeout:
        raise KvmemError(f"{what} is in use by a running kvmem (pid {_holder(path)}); wait for it to finish, "
                         f"or write somewhere else") from None
    try:
        yield
    finally:
        if filelock.has_fcntl:  # (Windows cannot remove an open file; filelock's soft lock removes its own)
            path.unlink(missing_ok=True)  # while still held: a waiting process then finds its file gone
        lock.release()


def _still_named(path: Path, lock: filelock.BaseFileLock) -> bool:
    """Whether ``path`` still names the file ``lock`` holds (a releasing holder removes it first)."""
    try:
        return os.stat(path).st_ino == os.fstat(lock._context.lock_file_fd).st_ino
    except (OSError, TypeError):
        return False


@contextmanager
def waited_lock(path: str | os.PathLike) -> Iterator[None]:
    """Hold an exclusive lock on the file ``path`` for the block, waiting for any other holder. For shared
    caches: the first process builds an entry while the others wait, then find it built. Raises OSError
    where the lock file cannot be created (a read-only cache)."""
    with _lock(Path(path), timeout=-1):
        yield


_NATIVE = filelock.has_fcntl or sys.platform == "win32"  # else filelock's soft lock, which writes the pid itself


def _lock(path: Path, *, timeout: float) -> filelock.BaseFileLock:
    """A ``filelock`` lock on ``path`` (its directory made first); the holder's pid is the file's first line."""
    path.parent.mkdir(parents=True, exist_ok=True)
    return filelock.FileLock(path, timeout=timeout, **({"on_acquired": _write_pid} if _NATIVE else {}))


def _write_pid(descriptor: int) -> None:
    os.ftruncate(descriptor, 0)
    os.lseek(descriptor, 0, os.SEEK_SET)
    os.write(descriptor, str(os.getpid()).encode())


def _holder(path: Path) -> str:
    """The pid the lock file names (its first line), or "another process" where it cannot be read."""
    try:
        return path.read_text().strip().partition("\n")[0] or "another process"
    except OSError:
        return "another process"
