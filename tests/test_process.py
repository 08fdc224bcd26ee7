"""kvmem leaves the process as it found it: the garbage collector, torch's thread counts, the public
names type checkers see, and the ``kvmem`` command's exit (a profiler run around it gets its output)."""

from __future__ import annotations

import ast
import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

import kvmem

ROOT = Path(__file__).resolve().parent.parent


def _process_state() -> dict:
    return {"gc_enabled": gc.isenabled(), "gc_threshold": gc.get_threshold(), "gc_frozen": gc.get_freeze_count(),
            "gc_callbacks": list(gc.callbacks), "torch_threads": torch.get_num_threads()}


def test_load_scan_open_and_query_leave_the_collector_and_threads_as_found(gpt2_dir, tmp_path):
    threads = torch.get_num_threads()
    threshold = gc.get_threshold()
    torch.set_num_threads(threads + 1)  # a caller's own choices, not the defaults
    gc.set_threshold(1234, 7, 9)
    try:
        before = _process_state()
        model = kvmem.load_model(gpt2_dir, device="cpu")
        assert _process_state() == before
        atlas = kvmem.scan(model, ["The cat sat on the mat. " * 30, "Assert statements insert checks. " * 30],
                           out=tmp_path / "atlas", max_tokens=300, progress=False, projections="eager")
        assert _process_state() == before
        atlas = kvmem.open(tmp_path / "atlas")
        atlas.neuron(1, 3)
        atlas.top_neurons(token=" cat", by="value")
        assert _process_state() == before
        gc.disable()  # a caller's disabled collector stays disabled
        kvmem.load_model(gpt2_dir, device="cpu")
        assert not gc.isenabled()
    finally:
        gc.enable()
        gc.set_threshold(*threshold)
        torch.set_num_threads(threads)


def test_type_checkers_see_every_public_name_from_the_module_that_defines_it():
    """The names imported under TYPE_CHECKING in kvmem/__init__.py are exactly ``__all__`` (less
    ``__version__``), and each is the object the lazy import gives at run time."""
    tree = ast.parse((ROOT / "kvmem" / "__init__.py").read_text())
    guarded = next(node for node in tree.body if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING")
    seen = {}
    for node in guarded.body:
        assert isinstance(node, ast.ImportFrom)
        for alias in node.names:
            seen[alias.asname or alias.name] = (node.module, alias.name)
    assert sorted(seen) == sorted(name for name in kvmem.__all__ if name != "__version__")
    for name, (module, attribute) in seen.items():
        exported = __import__(module, fromlist=[attribute])
        assert getattr(kvmem, name) is getattr(exported, attribute), name


def test_the_command_ends_as_python_does_so_a_profiler_and_atexit_see_its_end(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    profile = tmp_path / "anatomy.prof"
    done = subprocess.run([sys.executable, "-m", "cProfile", "-o", str(profile), "-m", "kvmem", "anatomy", "gpt2-random"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert profile.stat().st_size > 0
    probe = ("import atexit, json, sys\n"
             "atexit.register(lambda: print(json.dumps({'atexit': True})))\n"
             "sys.argv = ['kvmem', 'info', '--atlas', sys.argv[1]]\n"
             "from kvmem.cli import run\n"
             "run()\n")
    done = subprocess.run([sys.executable, "-c", probe, str(tmp_path / "no-atlas")], capture_output=True, text=True,
                          env=env, timeout=300)
    assert done.returncode == 2 and done.stderr.startswith("kvmem: error: ")
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"atexit": True}


HOLD = """
import sys, time
{prelude}
from kvmem.atomic import held_lock
with held_lock(sys.argv[1], "the output"):
    print("held", flush=True)
    time.sleep(60)
"""

TRY = """
import sys
{prelude}
from kvmem.atomic import held_lock
from kvmem.errors import KvmemError
try:
    with held_lock(sys.argv[1], "the output"):
        print("acquired")
except KvmemError as error:
    print(error)
"""

NO_FCNTL = "sys.modules['fcntl'] = None  # a platform without fcntl: importing it fails"


def _locking(tmp_path, prelude: str) -> tuple[int, str, str]:
    """(the holder's pid, what a second process got while it held the lock, what a third got after it died)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    lock = str(tmp_path / ".atlas.lock")
    holder = subprocess.Popen([sys.executable, "-W", "ignore", "-c", HOLD.format(prelude=prelude), lock],
                              stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert holder.stdout.readline().strip() == "held"
        second = subprocess.run([sys.executable, "-W", "ignore", "-c", TRY.format(prelude=prelude), lock],
                                capture_output=True, text=True, env=env, timeout=120)
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()
    third = subprocess.run([sys.executable, "-W", "ignore", "-c", TRY.format(prelude=prelude), lock],
                           capture_output=True, text=True, env=env, timeout=120)
    return holder.pid, second.stdout.strip(), third.stdout.strip()


def test_an_output_lock_refuses_a_second_process_naming_the_holder_and_frees_when_it_dies(tmp_path):
    pid, second, third = _locking(tmp_path, "")
    assert second == f"the output is in use by a running kvmem (pid {pid}); wait for it to finish, or write somewhere else"
    assert third == "acquired"  # a SIGKILLed holder holds nothing
    assert list(tmp_path.iterdir()) == []  # the last holder removed the lock file: the directory is as found


def test_locks_work_where_fcntl_does_not_exist(tmp_path):
    """``import kvmem`` and its locks need no fcntl (Windows has none): filelock picks another lock."""
    pid, second, _ = _locking(tmp_path, NO_FCNTL)
    assert second == f"the output is in use by a running kvmem (pid {pid}); wait for it to finish, or write somewhere else"
