"""The allocator setting the kvmem command uses: freed memory is reused, not faulted in again.

The oracle is the kernel's count of page faults (getrusage) in a fresh process that allocates
and frees 240 MB of tensors 20 times, with glibc's default settings and with kvmem's."""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest

LOOP = """
import json, resource, sys
import torch
if sys.argv[1] == "keep":
    from kvmem.allocator import keep_freed_memory
    assert keep_freed_memory()
faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt
torch.ones(10).sum()
before = faults()
for _ in range(20):
    held = [torch.ones(3_000_000 + 1_000 * i) for i in range(20)]  # 20 tensors of about 12 MB, then freed
    del held
print(json.dumps({"faults": faults() - before}))
"""


def faults(setting: str) -> int:
    done = subprocess.run([sys.executable, "-c", LOOP, setting], capture_output=True, text=True, timeout=120, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])["faults"]


def test_kept_memory_is_reused_instead_of_faulted_in_again():
    if platform.libc_ver()[0] != "glibc":
        pytest.skip("the C library is not glibc: kvmem sets nothing there")
    default, kept = faults("default"), faults("keep")
    pages = 20 * 12_000_000 // 4096  # one round's pages
    assert default > 5 * pages  # glibc's default hands the blocks back and faults them in round after round
    assert kept < 2 * pages  # kept: the first round faults them in, later rounds reuse them
