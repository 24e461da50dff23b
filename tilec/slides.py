"""Whole-slide images as model inputs, read by region: ``slide(path)`` opens a slide file (or wraps
an array) and returns a ``Slide``, an array-like in the model's (1, C, H, W) layout whose reads
touch only the parts of the file they need, as ``tilec.runtime.sources`` reads a model's inputs.

Readers, each an optional dependency (``pip install 'tilec[slide]'``):

- TIFF-based files (.svs, .ndpi, OME-TIFF, .scn, .bif, generic tiled TIFF): tifffile through zarr
  (``tifffile.imread(path, aszarr=True)``), which decodes only the file tiles a region overlaps;
- what tifffile cannot open or decode (.mrxs, .vms, JPEG 2000 without imagecodecs): OpenSlide
  (``openslide-python`` and the OpenSlide library);
- a zarr store (a multiscale group's arrays are its levels) and an ``.npy`` (memory-mapped);
- any (H, W, C) or (H, W) array-like with NumPy basic slicing, or a list of them (the levels).

A slide's levels are its pyramid, finest first: ``Slide.levels`` gives each one's size and its
microns per pixel where the file records them. ``Slide.tissue()`` finds the tissue on a coarse
level (Otsu's threshold on the saturation) and ``Slide.masked()`` presents the slide with every
pixel outside it set to one constant colour (white), region by region as it is read.
``Slide.framed()`` presents a level as an image of a chosen size, over its tissue, cropped
where the level is larger and padded with that colour where it is smaller: slides of any size
then share one plan, and the padding, one constant, is computed once per step
(``tilec.runtime.reuse``).

Conventions: pixel bounds are half-open ``[start, stop)`` in the coordinates of the image read (a
framed slide's frame, else its level); a level's array is read as (rows, cols, channels);
microns per pixel are ``(y, x)``.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tilec.cost.background import Background
from tilec.errors import SlideError

#: The pip package that provides each optional reader module.
PACKAGES = {"tifffile": "tifffile", "zarr": "zarr", "openslide": "openslide-python", "skimage": "scikit-image"}
#: Suffixes tifffile opens (OpenSlide opens them too, and the rest of its formats).
TIFF_SUFFIXES = {".tif", ".tiff", ".svs", ".ndpi", ".scn", ".bif", ".qptiff", ".btf", ".tf2", ".tf8"}
#: Microns per unit of a TIFF ResolutionUnit (2 inch, 3 centimetre, 4 millimetre, 5 micrometre).
MICRONS = {2: 25400.0, 3: 1e4, 4: 1e3, 5: 1.0}
#: Rows of a coarse level read at a time to compute its saturation.
BAND_PIXELS = 1 << 22
#: Most cells a side of a framed slide's ``background()``.
FRAME_CELLS = 1024


def _module(name: str, what: str):
    """Import optional reader ``name``, or refuse in one line naming the package to install."""
    try:
        return importlib.import_module(name)
    except (ImportError, OSError) as error:
        extra = " and the OpenSlide library (pip install openslide-bin)" if name == "openslide" else ""
        package = PACKAGES[name.split(".")[0]]
        raise SlideError(f"{what} needs the Python package {package!r}{extra}: pip install "
                         f"{package} (or pip install 'tilec[slide]'); importing {name} failed: {error}") from None


@dataclass(frozen=True)
class Level:
    """One level of a slide's pyramid: its ``height`` x ``width`` pixels and ``mpp``, microns per
    pixel ``(y, x)`` where the file records them (else ``None``)."""

    height: int
    width: int
    mpp: tuple[float, float] | None = None


class Plane:
    """A level's ``array`` (any array-like with basic slicing) read as (rows, cols, channels).
    ``axes`` names its dims in tifffile's letters: ``Y`` rows, ``X`` columns, ``S`` or ``C`` the
    channels; any other dim must have size 1."""

    def __init__(self, array, axes: str):
        if len(axes) != len(array.shape) or "Y" not in axes or "X" not in axes:
            raise SlideError(f"a slide level must have rows Y and columns X, got axes {axes!r} of shape "
                             f"{tuple(array.shape)}")
        others = [a for a, n in zip(axes, array.shape, strict=True) if a not in "YXSC" and n != 1]
        channels = [a for a in axes if a in "SC"]
        if others or len(channels) > 1:
            raise SlideError(f"a slide level must be one image (Y, X and one channel axis), got axes {axes!r} "
                             f"of shape {tuple(array.shape)}")
        self.array, self.axes = array, axes
        self.channel = channels[0] if channels else None
        size = dict(zip(axes, array.shape, strict=True))
        self.shape = (int(size["Y"]), int(size["X"]), int(size[self.channel]) if self.channel else 1)
        self.dtype = np.dtype(getattr(array.dtype, "name", array.dtype))

    def check(self):
        """Every level of an array is read exactly as stored: nothing to refuse."""

    def read(self, rows: tuple[int, int], cols: tuple[int, int]) -> np.ndarray:
        """Pixels ``rows`` x ``cols`` as a (rows, cols, channels) array."""
        bounds = {"Y": slice(*rows), "X": slice(*cols)}
        index = tuple(bounds.get(a, slice(None) if a == self.channel else 0) for a in self.axes)
        kept = [a for a in self.axes if a in bounds or a == self.channel]
        block = np.asarray(self.array[index])
        order = [kept.index("Y"), kept.index("X")] + ([kept.index(self.channel)] if self.channel else [])
        block = block.transpose(order)
        return block if self.channel else block[..., None]


class OpenSlidePlane:
    """Level ``level`` of an ``openslide.OpenSlide`` read as (rows, cols, 3) uint8: RGBA regions
    composited onto white (OpenSlide gives transparent pixels where nothing was scanned). Only
    levels whose downsample is a whole number are read exactly (``check``)."""

    def __init__(self, handle, level: int, name: str):
        self.handle, self.level, self.name = handle, level, name
        width, height = handle.level_dimensions[level]
        self.shape, self.dtype = (height, width, 3), np.dtype("uint8")
        self.downsample = handle.level_downsamples[level]

    def check(self):
        """Refuse a level whose downsample is not a whole number: OpenSlide places a region at
        level-0 coordinates divided by it, and draws a fractional position resampled, so the same
        pixel read in two regions could differ."""
        if self.downsample != int(self.downsample):
            raise SlideError(f"{self.name}: OpenSlide resamples reads at level {self.level} (its downsample "
                             f"{self.downsample:.6g} is not a whole number); read level 0, or the file with "
                             f"tifffile (reader='tifffile') where it is a TIFF")

    def read(self, rows: tuple[int, int], cols: tuple[int, int]) -> np.ndarray:
        size = (cols[1] - cols[0], rows[1] - rows[0])
        if min(size) <= 0:
            return np.empty((max(size[1], 0), max(size[0], 0), 3), dtype=np.uint8)
        origin = (round(cols[0] * self.downsample), round(rows[0] * self.downsample))  # level-0 pixels
        rgba = np.asarray(self.handle.read_region(origin, self.level, size), dtype=np.uint16)
        alpha = rgba[..., 3:]
        return ((rgba[..., :3] * alpha + 255 * (255 - alpha) + 127) // 255).astype(np.uint8)


def _span(entry, n: int):
    """An index ``entry`` of a spatial dim of size ``n`` as the bounds to read and the index into them."""
    if isinstance(entry, slice):
        start, stop, step = entry.indices(n)
        if step < 1:
            raise IndexError(f"a slide is read with positive slice steps, got step {step}")
        return (start, max(start, stop)), slice(None, None, step)
    position = int(entry)
    if not -n <= position < n:
        raise IndexError(f"index {position} is out of bounds for a slide dim of size {n}")
    position %= n
    return (position, position + 1), 0


def _within(bounds: tuple[int, int], offset: int, size: int) -> tuple[int, int]:
    """Frame pixels ``bounds`` as level pixels (``+ offset``) clipped to a level of ``size`` pixels
    (empty where they miss it)."""
    return min(max(bounds[0] + offset, 0), size), max(min(bounds[1] + offset, size), 0)


def _four(index) -> tuple:
    """``index`` as four entries, one per dim (N, C, H, W), ``Ellipsis`` expanded."""
    index = index if isinstance(index, tuple) else (index,)
    if any(entry is None or isinstance(entry, np.ndarray | list) for entry in index):
        raise IndexError("a slide takes basic slicing only (integers and slices)")
    if Ellipsis in index:
        at = index.index(Ellipsis)
        index = index[:at] + (slice(None),) * (5 - len(index)) + index[at + 1:]
    if len(index) > 4:
        raise IndexError(f"a slide has 4 dims (1, C, H, W), got {len(index)} indices")
    return index + (slice(None),) * (4 - len(index))


class Slide:
    """Level ``level`` of a slide, seen as a read-only (1, C, H, W) array: ``shape``, ``dtype`` and
    NumPy basic slicing, each read touching only the file tiles under the region asked for.

    ``levels``: every level of the pyramid (``Level``), finest first; ``mpp``: this level's
    microns per pixel ``(y, x)`` or ``None``; ``at(k)``: the same slide at level ``k``;
    ``tissue()`` and ``masked()``: the tissue and the slide with its background made constant;
    ``framed()``: the level as an image of another size. ``mask`` covers the level; ``frame`` is
    ``(top, left, height, width)``: frame pixel ``(r, c)`` shows level pixel ``(r + top, c + left)``,
    and ``fill`` where that lies outside the level (or outside the mask's tissue)."""

    def __init__(self, name: str, planes: list, levels: tuple[Level, ...], level: int = 0, mask=None, fill=None,
                 frame: tuple[int, int, int, int] | None = None):
        if not -len(planes) <= level < len(planes):
            raise SlideError(f"{name} has {len(planes)} level(s) (0 to {len(planes) - 1}), got level {level}")
        self.name, self.planes, self.levels = name, planes, levels
        self.level = level % len(planes)
        self.plane = planes[self.level]
        self.plane.check()
        height, width, channels = self.plane.shape
        if frame is not None:
            height, width = frame[2:]
        self.shape, self.dtype, self.ndim = (1, channels, height, width), self.plane.dtype, 4
        self.mpp = levels[self.level].mpp
        self.mask, self.fill, self.frame = mask, fill, frame

    def __repr__(self) -> str:
        mpp = f", {self.mpp[1]:.4g} µm/px" if self.mpp else ""
        masked = ", masked" if self.mask is not None else ""
        framed = "" if self.frame is None else f", framed at level pixel {tuple(self.frame[:2])}"
        return (f"Slide({self.name!r}, level {self.level} of {len(self.levels)}, {self.shape} "
                f"{self.dtype.name}{mpp}{masked}{framed})")

    def at(self, level: int) -> Slide:
        """The same slide at level ``level`` (unmasked, unframed)."""
        return Slide(self.name, self.planes, self.levels, level)

    def __getitem__(self, index) -> np.ndarray:
        batch, channel, row, col = _four(index)
        (rows, row_index), (cols, col_index) = _span(row, self.shape[2]), _span(col, self.shape[3])
        block = self._read(rows, cols) if self.frame is not None else self._read_level(rows, cols)
        return block.transpose(2, 0, 1)[None][batch, channel, row_index, col_index]

    def _read(self, rows, cols) -> np.ndarray:
        """Frame pixels ``rows`` x ``cols`` as (rows, cols, channels): the level's pixels under
        them, ``fill`` around them."""
        top, left = self.frame[:2]
        height, width, channels = self.plane.shape
        inner = _within(rows, top, height), _within(cols, left, width)
        if inner == ((rows[0] + top, rows[1] + top), (cols[0] + left, cols[1] + left)):
            return self._read_level(*inner)
        block = np.full((rows[1] - rows[0], cols[1] - cols[0], channels), self.fill, dtype=self.dtype)
        (r0, r1), (c0, c1) = inner
        if r1 > r0 and c1 > c0:
            block[r0 - top - rows[0]:r1 - top - rows[0], c0 - left - cols[0]:c1 - left - cols[0]] = self._read_level(
                *inner)
        return block

    def _read_level(self, rows, cols) -> np.ndarray:
        """Level pixels ``rows`` x ``cols`` as (rows, cols, channels), masked where the slide is."""
        block = self.plane.read(rows, cols)
        return block if self.mask is None else self._masked(block, rows, cols)

    def _masked(self, block: np.ndarray, rows, cols) -> np.ndarray:
        """``block`` (level pixels ``rows`` x ``cols``) with its pixels outside the tissue set to
        ``fill``: pixel ``r`` of the level lies in mask row ``r * mask_rows // height`` (columns alike)."""
        mask_rows, mask_cols = self.mask.shape
        height, width = self.plane.shape[:2]
        inside = self.mask[np.ix_(np.arange(*rows) * mask_rows // height, np.arange(*cols) * mask_cols // width)]
        return np.where(inside[..., None], block, np.asarray(self.fill, dtype=self.dtype))

    def tissue(self, level: int = -1) -> np.ndarray:
        """The tissue of the slide as a boolean mask of level ``level`` (the coarsest by default):
        Otsu's threshold (scikit-image) on the saturation ``(max - min) / max`` of the RGB pixels,
        computed band of rows by band of rows. Tissue is stained, so saturated; background and
        glass are white or grey."""
        filters = _module("skimage.filters", "computing a tissue mask")
        plane = self.planes[level]
        height, width, channels = plane.shape
        if channels < 3:
            raise SlideError(f"{self.name}: a tissue mask needs RGB pixels, level {level} has {channels} channel(s)")
        saturation = np.empty((height, width), dtype=np.uint8)
        step = max(1, BAND_PIXELS // max(width, 1))
        for start in range(0, height, step):
            rgb = plane.read((start, min(start + step, height)), (0, width))[..., :3].astype(np.float32)
            top, bottom = rgb.max(axis=2), rgb.min(axis=2)
            band = np.divide(top - bottom, top, out=np.zeros_like(top), where=top > 0)
            saturation[start:start + step] = np.rint(band * 255)
        if saturation.min() == saturation.max():
            return np.zeros((height, width), dtype=bool)
        return saturation > filters.threshold_otsu(saturation)

    def tissue_box(self, mask=None) -> tuple[tuple[int, int], tuple[int, int]] | None:
        """The bounding box ``((top, bottom), (left, right))`` of the tissue of ``mask`` (a 2-D
        boolean array over any level; by default the slide's mask, else ``tissue()``) in this
        level's pixels, or ``None`` where it has none: the least frame (``framed``) that keeps
        every tissue pixel."""
        mask = self._mask(self.mask if mask is None else mask)
        if not mask.any():
            return None
        height, width = self.plane.shape[:2]
        box = []
        for found, cells, size in ((mask.any(axis=1), mask.shape[0], height), (mask.any(axis=0), mask.shape[1], width)):
            first, last = int(found.argmax()), cells - int(found[::-1].argmax())
            box.append((-(-first * size // cells), -(-last * size // cells)))  # the pixels of cells [first, last)
        return tuple(box)

    def background(self) -> Background | None:
        """Where this slide is one colour whatever its pixels: outside its mask (``masked``), in the
        mask's cells, and a frame's padding (``framed``), in cells of the frame at most
        ``FRAME_CELLS`` a side (a cell is background where all its pixels are); ``None`` where
        neither. Given to ``tilec.compile`` as an input, it lets the time estimate count the tiles
        computed once (``tilec.cost.background``)."""
        if self.mask is None and self.frame is None:
            return None
        height, width = self.plane.shape[:2]
        level = Background(np.zeros((1, 1), dtype=bool) if self.mask is None else ~self.mask, height, width)
        if self.frame is None:
            return level
        top, left, frame_height, frame_width = self.frame
        side = max(1, -(-max(frame_height, frame_width) // FRAME_CELLS))
        intervals = []
        for size, offset, bound in ((frame_height, top, height), (frame_width, left, width)):
            cells = -(-size // side)
            edges = -(-np.arange(cells + 1) * size // cells) + offset  # the level pixels of each cell
            edges = np.clip(edges, 0, bound)
            intervals.append(np.stack([edges[:-1], edges[1:]], axis=1))
        return Background(level.constant(*intervals), frame_height, frame_width)

    def masked(self, mask=None, fill=None) -> Slide:
        """This slide with every pixel outside ``mask`` (a 2-D boolean array over any level, by
        default ``tissue()``) set to ``fill`` (by default white: the dtype's maximum, 1.0 for a
        float slide), applied to each region as it is read; framed as this one is, its padding
        ``fill`` too."""
        return Slide(self.name, self.planes, self.levels, self.level, mask=self._mask(mask), fill=self._fill(fill),
                     frame=self.frame)

    def _mask(self, mask) -> np.ndarray:
        """``mask`` (by default ``tissue()``) as a 2-D boolean array, or a one-line ``SlideError``."""
        mask = self.tissue() if mask is None else np.asarray(mask, dtype=bool)
        if mask.ndim != 2:
            raise SlideError(f"{self.name}: a tissue mask is 2-D (rows, cols), got shape {mask.shape}")
        return mask

    def framed(self, height: int, width: int, origin: tuple[int, int] | None = None, fill=None) -> Slide:
        """This level seen as a ``height`` x ``width`` image whose pixel ``(0, 0)`` is level pixel
        ``origin`` (``(row, col)``, either may be negative), the level cropped where it is larger
        and ``fill`` around it (by default the mask's fill, else white). By default, per axis, the
        frame starts where a masked slide's ``tissue_box()`` (else the level) starts, so that the
        padding lies in one band after it, where the most tiles lie wholly in it; a box longer than
        the frame is centred in it instead, cut equally at both ends. Every slide framed to one size
        runs the one plan compiled for that size; frame pixels outside the level are one constant,
        so the tiles reading only them (and the masked background) are computed once. What the
        model sees is the framed image: global pooling averages over the padding too."""
        if not (isinstance(height, int) and isinstance(width, int) and height > 0 and width > 0):
            raise SlideError(f"{self.name}: a frame is a positive height and width in pixels, got {height} x {width}")
        if origin is None:
            box = self.tissue_box() if self.mask is not None else None
            box = box or ((0, self.plane.shape[0]), (0, self.plane.shape[1]))
            origin = tuple(start if stop - start <= size else (start + stop - size) // 2
                           for (start, stop), size in zip(box, (height, width), strict=True))
        frame = (int(origin[0]), int(origin[1]), height, width)
        return Slide(self.name, self.planes, self.levels, self.level, mask=self.mask, fill=self._fill(fill),
                     frame=frame)

    def _fill(self, fill):
        """``fill``, by default this slide's, else white: the dtype's maximum, 1.0 for a float slide."""
        if fill is not None:
            return fill
        if self.fill is not None:
            return self.fill
        return np.iinfo(self.dtype).max if np.issubdtype(self.dtype, np.integer) else 1.0


def slide(source, level: int = 0, reader: str | None = None) -> Slide:
    """Open ``source`` and return its level ``level`` as a ``Slide`` (module docstring): a path to
    a slide file, a zarr store or an ``.npy``, or an (H, W, C) or (H, W) array-like, or a list of
    them, finest first. ``reader``: ``"tifffile"`` or ``"openslide"`` to choose the reader of a
    file; by default tifffile for TIFF-based files, then OpenSlide."""
    if reader not in (None, "tifffile", "openslide"):
        raise SlideError(f"reader must be 'tifffile' or 'openslide', got {reader!r}")
    if isinstance(source, str | os.PathLike):
        name, planes, levels = _open_path(Path(source), reader)
    else:
        arrays = list(source) if isinstance(source, list | tuple) else [source]
        planes = [_array_plane(array, f"level {k}") for k, array in enumerate(arrays)]
        name, levels = type(arrays[0]).__name__, tuple(Level(p.shape[0], p.shape[1]) for p in planes)
    return Slide(name, planes, levels, level)


def _array_plane(array, what: str) -> Plane:
    """An (H, W, C) or (H, W) array-like as a level."""
    if not all(hasattr(array, a) for a in ("shape", "dtype", "__getitem__")) or len(array.shape) not in (2, 3):
        raise SlideError(f"{what} must be an (H, W, C) or (H, W) array with shape, dtype and slicing, got "
                         f"{type(array).__name__} of shape {getattr(array, 'shape', None)}")
    return Plane(array, "YXS"[:len(array.shape)])


def _open_path(path: Path, reader: str | None):
    """``(name, planes, levels)`` of the file or store at ``path``, by ``reader`` or the one its kind needs."""
    if not path.exists():
        raise SlideError(f"slide file {path} does not exist")
    suffix = path.suffix.lower()
    if reader == "openslide":
        return _open_openslide(path)
    if suffix == ".npy":
        plane = _array_plane(np.load(path, mmap_mode="r"), str(path))
        return str(path), [plane], (Level(plane.shape[0], plane.shape[1]),)
    if reader is None and (suffix == ".zarr" or path.is_dir()):
        return _open_zarr(path)
    if reader == "tifffile" or suffix in TIFF_SUFFIXES:
        tifffile = _module("tifffile", f"reading {path.name}")
        try:
            return _open_tiff(path, tifffile)
        except (tifffile.TiffFileError, ValueError, RuntimeError, OSError, IndexError) as error:
            if reader == "tifffile" or importlib.util.find_spec("openslide") is None:
                raise SlideError(f"tifffile cannot read {path} ({error}); OpenSlide may: pip install "
                                 f"openslide-python openslide-bin") from None
    return _open_openslide(path)


def _open_zarr(path: Path):
    zarr = _module("zarr", f"reading {path.name}")
    try:
        store = zarr.open(str(path), mode="r")
    except Exception as error:  # zarr raises many kinds for what is not a store
        raise SlideError(f"{path} is not a zarr store: {error}") from None
    arrays = _zarr_levels(store)
    planes = [_array_plane(array, f"{path} level {k}") for k, array in enumerate(arrays)]
    return str(path), planes, tuple(Level(p.shape[0], p.shape[1]) for p in planes)


def _zarr_levels(store) -> list:
    """A zarr array, or a multiscale group's arrays in its ``multiscales`` order (else by name)."""
    if hasattr(store, "shape"):
        return [store]
    scales = store.attrs.get("multiscales")
    names = [d["path"] for d in scales[0]["datasets"]] if scales else sorted(k for k, _ in store.arrays())
    return [store[name] for name in names]


def _open_tiff(path: Path, tifffile):
    """A TIFF's first series as levels read through zarr, with the microns per pixel it records;
    one region is read to find a compression tifffile cannot decode (which OpenSlide may)."""
    zarr = _module("zarr", f"reading {path.name}")
    with tifffile.TiffFile(path) as tif:
        series = tif.series[0]
        axes = series.axes
        mpp = _tiff_mpp(tif)
    store = zarr.open(tifffile.imread(path, aszarr=True), mode="r")
    planes = [Plane(array, axes) for array in _zarr_levels(store)]
    planes[0].read((0, 1), (0, 1))
    return str(path), planes, _with_mpp(planes, mpp)


def _tiff_mpp(tif) -> tuple[float, float] | None:
    """Level 0's microns per pixel ``(y, x)``: Aperio's ``MPP``, OME's physical sizes, or the
    resolution tags where their unit is a length."""
    page = tif.pages[0]
    if tif.is_svs:
        found = re.search(r"\|\s*MPP\s*=\s*([0-9.eE+-]+)", page.description)
        return (float(found[1]), float(found[1])) if found else None
    if tif.is_ome:
        from tifffile import xml2dict

        image = xml2dict(tif.ome_metadata)["OME"]["Image"]
        pixels = (image[0] if isinstance(image, list) else image)["Pixels"]
        if "PhysicalSizeY" in pixels and pixels.get("PhysicalSizeYUnit", "µm") in ("µm", "um"):
            return float(pixels["PhysicalSizeY"]), float(pixels["PhysicalSizeX"])
        return None
    unit = int(page.resolutionunit)
    x, y = page.resolution
    return (MICRONS[unit] / y, MICRONS[unit] / x) if unit in MICRONS and x > 0 and y > 0 else None


def _with_mpp(planes: list, mpp: tuple[float, float] | None) -> tuple[Level, ...]:
    """Each level's size and microns per pixel: level 0's scaled by its size over the level's."""
    (height, width, _) = planes[0].shape
    return tuple(Level(p.shape[0], p.shape[1], None if mpp is None else
                       (mpp[0] * height / p.shape[0], mpp[1] * width / p.shape[1])) for p in planes)


def _open_openslide(path: Path):
    openslide = _module("openslide", f"reading {path.name}")
    try:
        handle = openslide.OpenSlide(str(path))
    except openslide.OpenSlideUnsupportedFormatError:
        raise SlideError(f"{path} is not a slide format tifffile or OpenSlide reads") from None
    except openslide.OpenSlideError as error:
        raise SlideError(f"OpenSlide cannot read {path}: {error}") from None
    planes = [OpenSlidePlane(handle, k, str(path)) for k in range(handle.level_count)]
    x, y = (handle.properties.get(f"openslide.mpp-{a}") for a in "xy")
    mpp = (float(y), float(x)) if x and y and math.isfinite(float(x)) else None
    return str(path), planes, _with_mpp(planes, mpp)
