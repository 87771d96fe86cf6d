"""ember.core.host_memory: with glibc told to reuse freed host memory, a large block freed and
asked for again (as XLA:CPU does with each step's temporaries) is served from pages already
faulted in. Run in a subprocess: the setting is the whole process's, for good."""

import platform
import subprocess
import sys

import pytest

# One "step": a 64 MB block asked for, written, freed. Prints whether the setting took, then the
# most minor page faults any of three steps after the first took.
STEPS = """
import ctypes, resource, sys
from ember.core.host_memory import reuse_freed_host_memory

libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
SIZE = 64 << 20

def faults_of_one_step():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = libc.malloc(SIZE)
    ctypes.memset(block, 1, SIZE)
    libc.free(block)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

took = reuse_freed_host_memory() and reuse_freed_host_memory()  # the second call changes nothing
faults_of_one_step()
print(took, max(faults_of_one_step() for _ in range(3)))
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")
def test_a_freed_block_is_served_again_from_pages_already_faulted_in():
    done = subprocess.run([sys.executable, "-c", STEPS], capture_output=True, text=True, timeout=60, check=True)
    took, faults = done.stdout.split()
    assert took == "True"
    # 16384 pages of 4 KiB: every one faulted in again per step without the setting (glibc maps
    # a block that large afresh and unmaps it when freed).
    assert int(faults) < 16384 // 100, faults
