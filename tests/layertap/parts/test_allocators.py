"""The allocators of a process that encodes parts: Arrow's jemalloc pool unless the user chose one, and glibc's
mmap threshold kept fixed, each checked in a fresh interpreter (both are settings of the whole process)."""

from __future__ import annotations

import platform
import sys

import pyarrow as pa
import pytest

linux_jemalloc = pytest.mark.skipif(
    not sys.platform.startswith("linux") or "jemalloc" not in pa.supported_memory_backends(),
    reason="Arrow's jemalloc pool is asked for on Linux, where pyarrow carries it",
)


@linux_jemalloc
@pytest.mark.parametrize("entry", ["layertap", "flows.cli", "flows.embed"])
def test_the_package_or_an_entry_point_imported_first_gives_arrow_its_jemalloc_pool(fresh_python, entry):
    script = f"import {entry}, pyarrow; print(pyarrow.default_memory_pool().backend_name)"
    assert fresh_python(script, env={"ARROW_DEFAULT_MEMORY_POOL": ""}).split() == ["jemalloc"]


@linux_jemalloc
def test_a_pool_the_user_chose_is_kept(fresh_python):
    script = "import layertap, pyarrow; print(pyarrow.default_memory_pool().backend_name)"
    assert fresh_python(script, env={"ARROW_DEFAULT_MEMORY_POOL": "system"}).split() == ["system"]


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the mmap threshold is glibc's")
@pytest.mark.parametrize("fixed", [False, True])
def test_with_the_threshold_fixed_a_block_is_unmapped_when_freed_after_a_larger_one_was(fresh_python, fixed):
    """glibc raises its threshold to the size of a mapped block once it is freed, so an 8 MiB block made after
    a 16 MiB one was freed lands in the heap; with the threshold fixed it is mapped as the first one was."""
    script = f"""
import ctypes
import numpy as np
from layertap.parts import allocators

class Info(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                      "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Info
if {fixed}:
    assert allocators.fix_mmap_threshold() and allocators.fix_mmap_threshold()
first = np.ones(16 << 20, np.uint8)
del first
mapped = libc.mallinfo2().hblkhd
second = np.ones(8 << 20, np.uint8)
print(libc.mallinfo2().hblkhd - mapped >= 8 << 20)
"""
    assert fresh_python(script).split() == [str(fixed)]
