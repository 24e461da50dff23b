"""Inputs read by region: a model input given as an array-like on the host (a NumPy memory-mapped
``.npy``, a zarr array, an h5py dataset, a dask array: anything with ``shape``, ``dtype`` and
basic slicing, in the model's layout) or as a host tensor of a model on another device.

A ``Source`` hands each tile its slice of the input, read when the tile asks for it (or ahead,
while the tile before it computes) and nothing else of the input. A stored segment reading the
input reads it whole (``whole``). Reads copy into staging tensors of the input's own dtype,
pinned when the model is on CUDA, where a side stream copies them to the device. The pages of a
memory-mapped file that a read touched are handed back after every band of rows of about
``BAND_BYTES`` it copies (they stay in the page cache, where a neighbour's halo finds them again):
the process maps no more of the file than one band's rows. Conventions: slice bounds
are half-open ``[start, stop)``; ``spatial`` names the dims of the image rows and columns.
"""

import math
import mmap
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from tilec.runtime.bits import constants
from tilec.runtime.kernels import narrow

#: Bytes of a region copied from a memory map between two hand-backs of its pages.
BAND_BYTES = 1 << 20
#: torch's dtype of each input dtype name (``InputSpec.dtype``; NumPy names them alike).
DTYPES = {name: getattr(torch, name) for name in (
    "float32", "float64", "bfloat16", "float16", "uint8", "int8", "int16", "int32", "int64", "bool")}


def dtype_name(data):
    """The dtype of a tensor or an array-like as an input dtype name (``"uint8"``)."""
    return str(getattr(data.dtype, "name", data.dtype)).removeprefix("torch.")


def _mapping(data):
    """The ``mmap`` under a NumPy memory-mapped array or a view of one, else ``None``."""
    seen, base = 0, data
    while base is not None and seen < 32:
        if isinstance(base, mmap.mmap):
            return base
        found = getattr(base, "_mmap", None)
        if isinstance(found, mmap.mmap):
            return found
        base, seen = getattr(base, "base", None), seen + 1
    return None


class Reading:
    """What the step's reads of its inputs by region cost: ``waited`` seconds the tiles waited
    for them (all of a read done on asking, the rest of one read ahead), ``seconds`` spent reading
    and ``bytes`` read."""

    def __init__(self):
        self.waited = self.seconds = 0.0
        self.bytes = 0
        self._lock = threading.Lock()

    def add(self, seconds, count):
        with self._lock:
            self.seconds += seconds
            self.bytes += count

    def __repr__(self):
        return f"Reading(waited={self.waited:.3f} s, seconds={self.seconds:.3f} s, bytes={self.bytes})"


class Source:
    """Input ``name`` given as ``data`` (an array-like, or a tensor on another device than the
    model's), read by region onto ``device``. ``ahead``: read the next region asked for on a
    worker thread; ``reading``: where the reads are counted."""

    def __init__(self, name, data, device, reading, ahead=True):
        self.name, self.data, self.device, self.reading = name, data, torch.device(device), reading
        self.shape, self.dtype = tuple(int(n) for n in data.shape), DTYPES[dtype_name(data)]
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.mapping = _mapping(data)
        self.pending = {}  # region -> future of its read
        self.found = {}  # region -> its constants per sample and channel as last read (``constants``)
        self.worker = ThreadPoolExecutor(1, thread_name_prefix=f"tilec-read-{name}") if ahead else None
        self.lock = threading.Lock()

    def region(self, spatial, rows, cols):
        """The slice ``rows`` x ``cols`` on the model's device (read ahead, or now)."""
        key = (tuple(spatial), tuple(rows), tuple(cols))
        start = time.perf_counter()
        future = self.pending.pop(key, None)
        moved, event, self.found[key] = future.result() if future is not None else self._fetch(key)
        if event is not None:
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(event)
            moved.record_stream(stream)
        self.reading.waited += time.perf_counter() - start
        return moved

    def constants(self, spatial, rows, cols):
        """The bits of the constant per sample and channel of the slice ``rows`` x ``cols`` as last
        read (``tilec.runtime.bits.constants``, found on the host as it was read), or ``None``."""
        return self.found.get((tuple(spatial), tuple(rows), tuple(cols)))

    def ahead(self, spatial, rows, cols):
        """Start reading the slice ``rows`` x ``cols``, which a tile will ask for next."""
        key = (tuple(spatial), tuple(rows), tuple(cols))
        if self.worker is not None and key not in self.pending and rows[1] > rows[0] and cols[1] > cols[0]:
            self.pending[key] = self.worker.submit(self._fetch, key)

    def whole(self):
        """The whole input on the model's device (for a stored segment, or a broadcast input)."""
        if isinstance(self.data, torch.Tensor):
            return self.data.to(self.device)
        full = tuple((0, n) for n in self.shape)
        return self._fetch((None, full, None))[0] if self.shape else torch.as_tensor(self.data).to(self.device)

    def _index(self, key):
        spatial, rows, cols = key
        if spatial is None:  # the whole array: ``rows`` holds every dim's bounds
            return tuple(slice(a, b) for a, b in rows)
        index = [slice(None)] * len(self.shape)
        index[spatial[0]], index[spatial[1]] = slice(*rows), slice(*cols)
        return tuple(index)

    def _copy(self, target, part, spatial):
        """Copy array-like ``part`` into ``target``; from a memory map, band of rows by band of
        rows, handing the file's pages back after each band (``BAND_BYTES``): a row of the region
        maps whole pages, up to a whole row of the image, so a region read at once would map far
        more of the file than it copies."""
        if self.mapping is None:
            target[...] = part
            return
        for index in _bands(target.shape, None if spatial is None else spatial[0], target.itemsize):
            target[index] = part[index]
            self.mapping.madvise(mmap.MADV_DONTNEED)  # copied: the file keeps its pages, not this process

    def _fetch(self, key):
        """Read one region into staging and start its copy to the device: ``(tensor, event,
        constants)``, its constants found in staging (``None`` for the whole input)."""
        with self.lock:
            start = time.perf_counter()
            part = self.data[self._index(key)]
            staging = torch.empty(tuple(part.shape), dtype=self.dtype, pin_memory=self.cuda)
            if isinstance(part, torch.Tensor):
                staging.copy_(part)
            else:
                self._copy(staging.numpy(), part, key[0])
            del part
            self.reading.add(time.perf_counter() - start, staging.numel() * staging.element_size())
        found = None if key[0] is None else constants(staging, key[0])
        if not self.cuda:
            return staging, None, found
        with torch.cuda.stream(self.stream):
            moved = staging.to(self.device, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        return moved, event, found


def _bands(shape, axis, itemsize):
    """Slices of dim ``axis`` of an array of ``shape`` in bands of about ``BAND_BYTES``."""
    count = shape[axis] if axis is not None else 1
    row = math.prod(shape) * itemsize // max(count, 1)
    step = max(1, BAND_BYTES // max(row, 1))
    for start in range(0, count, step):
        index = [slice(None)] * len(shape)
        if axis is not None:
            index[axis] = slice(start, start + step)
        yield tuple(index)


def region(x, spatial, rows, cols):
    """A tile's slice ``rows`` x ``cols`` of input ``x``: a view of a tensor, or read from a ``Source``."""
    return x.region(spatial, rows, cols) if isinstance(x, Source) else narrow(x, spatial, rows, cols)


def whole(x):
    """Input ``x`` as a tensor: itself, or a ``Source`` read whole."""
    return x.whole() if isinstance(x, Source) else x
