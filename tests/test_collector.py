"""The garbage-collector policies of kvmem.collector, checked against gc's own view of the heap: an
object the collector walks is in ``gc.get_objects()``, a frozen one is not."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import weakref

import pytest
from conftest import SHORT_DOCS

import kvmem
from kvmem.collector import collections_paused, frozen_heap
from kvmem.corpus import Corpus


class _Marker:
    """A tracked object whose identity we look for among the collector's objects."""


def walked(obj) -> bool:
    """Whether ``obj`` is among the objects the collector walks (frozen ones are not)."""
    return any(o is obj for o in gc.get_objects())


@pytest.fixture(autouse=True)
def _nothing_frozen():
    assert gc.get_freeze_count() == 0, "a test left objects frozen"
    yield
    assert gc.get_freeze_count() == 0, "a test left objects frozen"


def test_frozen_heap_leaves_out_what_existed_and_gives_it_back():
    before = _Marker()
    with frozen_heap():
        assert gc.get_freeze_count() > 0
        assert not walked(before)
        made_inside = _Marker()
        assert walked(made_inside)
    assert gc.get_freeze_count() == 0
    assert walked(before) and walked(made_inside)


def test_frozen_heap_unfreezes_after_an_error():
    with pytest.raises(RuntimeError), frozen_heap():
        raise RuntimeError("inside")
    assert gc.get_freeze_count() == 0


def test_frozen_heap_leaves_a_callers_freeze_alone():
    gc.freeze()
    try:
        count = gc.get_freeze_count()
        with frozen_heap():
            made_inside = _Marker()
        assert gc.get_freeze_count() == count  # not unfrozen by the block
        assert walked(made_inside)
    finally:
        gc.unfreeze()


def test_a_scan_freezes_the_heap_while_it_reads_and_not_after(gpt2_model, tmp_path):
    before = _Marker()
    seen: list[tuple[int, bool]] = []

    def records():
        seen.append((gc.get_freeze_count(), walked(before)))
        yield from ((f"doc{i}", text) for i, text in enumerate(SHORT_DOCS))

    atlas = kvmem.scan(gpt2_model, Corpus("probe", "document", records), out=tmp_path / "a", top_k=2, window=8,
                       progress=False)
    assert atlas.manifest.tokens > 0
    assert seen and all(count > 0 and not was_walked for count, was_walked in seen)
    assert gc.get_freeze_count() == 0 and walked(before)


def test_collections_paused_pauses_the_collector_and_restores_it():
    assert gc.isenabled()
    with collections_paused():
        assert not gc.isenabled()
        made_inside = _Marker()
    assert gc.isenabled()
    assert gc.get_freeze_count() == 0 and walked(made_inside)  # the library freezes nothing
    gc.disable()
    try:
        with collections_paused():
            pass
        assert not gc.isenabled()  # a caller's disabled collector stays disabled
    finally:
        gc.enable()


def test_a_first_use_import_runs_with_the_collector_paused(monkeypatch):
    """``kvmem.scan`` and the other lazy names import their module with the collector paused."""
    import importlib

    seen = []

    def import_module(name):  # the real import, observed from inside
        seen.append((name, gc.isenabled()))
        return importlib.import_module(name)

    monkeypatch.setattr(kvmem, "import_module", import_module)
    monkeypatch.delitem(vars(kvmem), "open", raising=False)  # as in a fresh process: not yet imported
    assert kvmem.open is importlib.import_module("kvmem.atlas").open_atlas
    assert seen == [("kvmem.atlas", False)]
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_load_model_runs_with_the_collector_paused(gpt2_dir, monkeypatch):
    import transformers

    seen = []
    original = transformers.AutoModelForCausalLM.from_pretrained

    def from_pretrained(*args, **kwargs):  # HF's own loader, as kvmem calls it
        seen.append(gc.isenabled())
        return original(*args, **kwargs)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", from_pretrained)
    model = kvmem.load_model(gpt2_dir)
    assert model.d_ff > 0
    assert seen == [False]
    assert gc.isenabled() and gc.get_freeze_count() == 0


SURVIVORS = """
import gc, json, weakref
from kvmem.collector import freeze_survivors, collections_paused

class Node:
    pass

freeze_survivors()
freeze_survivors()  # once per process, however often it is called
kept = Node()
gc.collect()  # a full collection: kept survives it, so it is frozen
frozen_after_full = gc.get_freeze_count() > 0 and not any(o is kept for o in gc.get_objects())
cycle = Node(); cycle.me = cycle  # garbage made after the freeze is still collected
dead = weakref.ref(cycle)
del cycle
gc.collect()
with collections_paused():
    loaded = Node()
frozen_after_load = not any(o is loaded for o in gc.get_objects()) and gc.isenabled()
print(json.dumps({"frozen_after_full": frozen_after_full, "cycle_collected": dead() is None,
                  "frozen_after_load": frozen_after_load,
                  "callbacks": sum(cb.__name__ == "_freeze_after_full_collection" for cb in gc.callbacks)}))
"""


def test_freeze_survivors_freezes_what_a_full_collection_keeps_and_a_load_made_and_still_collects_garbage():
    done = subprocess.run([sys.executable, "-c", SURVIVORS], capture_output=True, text=True, timeout=120, check=True)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == {"frozen_after_full": True, "cycle_collected": True, "frozen_after_load": True, "callbacks": 1}


def test_the_kvmem_command_process_freezes_survivors():
    # run() is the console script: it sets the process policy, runs main and exits without teardown
    probe = ("import gc, kvmem.cli as cli\n"
             "cli.main = lambda: print(sum(cb.__name__ == '_freeze_after_full_collection' for cb in gc.callbacks)) or 0\n"
             "cli.run()\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "1"


def test_frozen_objects_are_freed_once_unfrozen():
    class Node:
        pass

    cycle = Node()
    cycle.me = cycle
    dead = weakref.ref(cycle)
    with frozen_heap():
        del cycle
        gc.collect()
        assert dead() is not None  # frozen: the collector does not look at it
    gc.collect()
    assert dead() is None  # given back: collected as before


def test_main_leaves_the_callers_collector_alone(capsys):
    # the policy is the command process's (kvmem.cli.run); main() is what tests and callers run in-process
    from kvmem.cli import main

    assert main([]) == 2  # no command: the help
    assert "usage" in capsys.readouterr().out
    assert not any(getattr(cb, "__name__", "") == "_freeze_after_full_collection" for cb in gc.callbacks)
