"""``keep_heap_pages``: once a step's blocks have been allocated and freed a few times, the
next step reuses their pages instead of faulting in fresh ones (glibc). By default glibc maps
every block over 32 MiB on its own and unmaps it when freed, so each step faults all of them
in again. Run in a child process, whose malloc settings are its own."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc malloc only")

CHILD = """
import resource, sys, torch
from srt.utils.process import keep_heap_pages
if sys.argv[1] == "keep":
    assert keep_heap_pages()
faults = []
for _ in range(10):  # the heap's free blocks settle within a few steps (up to 5 seen)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    blocks = [torch.ones(n << 20) for n in (3, 12, 1, 10)]  # 12, 48, 4 and 40 MiB
    del blocks
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(min(faults[-3:]))
"""

STEP_PAGES = ((3 + 12 + 1 + 10) << 22) // 4096


def _faults(mode: str) -> int:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, mode], capture_output=True, text=True, check=True
    )
    return int(out.stdout.split()[-1])


def test_a_repeated_step_stops_faulting_in_pages():
    assert _faults("default") > STEP_PAGES // 2  # the two big blocks come and go with mmap
    assert _faults("keep") < STEP_PAGES // 100
