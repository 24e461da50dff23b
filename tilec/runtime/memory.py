"""The process's allocator: glibc's mmap threshold pinned, freed heap given back.

glibc raises its mmap threshold whenever a block above it is freed (up to 32 MiB), after which
freed tile-sized blocks stay resident in its heap and fragment it: measured, resident memory
then reaches 1.4-2.2x what a tiled step allocates. Pinned at its initial 128 KiB, a freed block
of 128 KiB or more goes back to the operating system at once, and resident memory follows the
plan's prediction; fresh blocks are faulted in again, which costs time. Other C libraries and
platforms are left alone.
"""

import ctypes
import functools
import sys

#: glibc's mallopt parameter M_MMAP_THRESHOLD, and the value the threshold is pinned to: its initial one.
M_MMAP_THRESHOLD, MMAP_THRESHOLD = -3, 128 * 1024
#: Linux's madvise advice for transparent huge pages, and their size.
MADV_HUGEPAGE, HUGE_PAGE = 14, 2 << 20


def pin_allocator(trim=False):
    """Pin glibc's mmap threshold at ``MMAP_THRESHOLD``, and with ``trim`` give freed heap pages
    back; whether the threshold is pinned (Linux with glibc only)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)
        pinned = libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
        if trim:
            libc.malloc_trim(0)
    except (OSError, AttributeError):
        return False
    return pinned


@functools.cache
def return_freed_memory():
    """``pin_allocator()`` once per process; whether the threshold is pinned."""
    return pin_allocator()


def advise_huge_pages(address, length):
    """Ask Linux to back ``[address, address + length)`` with transparent huge pages (one fault
    per 2 MiB instead of one per 4 KiB); elsewhere, or if refused, nothing changes."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None).madvise(ctypes.c_void_p(address), ctypes.c_size_t(length), MADV_HUGEPAGE)
        except (OSError, AttributeError):
            pass
