"""Whole-slide inputs (tilec.slides): a training step read from a pyramidal TIFF, a zarr store, an
``.npy``, a masked slide and framed slides of several sizes equals the plain PyTorch step on the
arrays they hold, in float64; reads touch regions only; frames read as the padded and cropped
level; levels, microns per pixel and tissue masks; one line per missing reader.
"""

from __future__ import annotations

import sys
from unittest import mock

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import tilec
from tilec.pipeline import described
from tilec.slides import Plane

tifffile = pytest.importorskip("tifffile")
zarr = pytest.importorskip("zarr")

TOLERANCE = 1e-10
GRID = (3, 2)


class SlideNet(nn.Module):
    """uint8 slide (1, 3, H, W) and label (1,) -> cross-entropy; BatchNorm in training mode."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 3, padding=1)
        self.norm = nn.BatchNorm2d(6)
        self.conv2 = nn.Conv2d(6, 8, 3, stride=2, padding=1)
        self.pool = nn.MaxPool2d(3, stride=2, padding=1)
        self.fc = nn.Linear(8, 3)

    def forward(self, slide, label):
        x = torch.relu(self.norm(self.conv1(slide.to(torch.float64) / 255)))
        x = self.pool(torch.relu(self.conv2(x)))
        return F.cross_entropy(self.fc(x.mean((2, 3))), label)


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = SlideNet()
    for parameter in model.parameters():
        nn.init.normal_(parameter, std=0.3)
    return model.double().train()


def _step(model, run, *inputs):
    """Loss and parameter gradients of one step of ``run`` (the model or its TiledModel)."""
    loss = run(*inputs)
    return loss.detach(), torch.autograd.grad(loss, list(model.parameters()))


def _assert_same(want, got):
    errors = [(want[0] - got[0]).abs().item()] + [(a - b).abs().max().item() for a, b in zip(*(want[1], got[1]),
                                                                                              strict=True)]
    assert max(errors) <= TOLERANCE, errors


def _slide_image(height: int, width: int, seed: int) -> np.ndarray:
    """(H, W, 3) uint8: a stained (pink, textured) ellipse on a white, slightly noisy background."""
    rng = np.random.default_rng(seed)
    rows, cols = np.ogrid[:height, :width]
    inside = ((rows - height * 0.45) / (height * 0.3)) ** 2 + ((cols - width * 0.55) / (width * 0.3)) ** 2 < 1
    stain = np.array([200, 110, 190]) + rng.integers(-40, 41, (height, width, 3))
    white = 240 + rng.integers(0, 16, (height, width, 1))
    return np.clip(np.where(inside[..., None], stain, white), 0, 255).astype(np.uint8)


def _write_tiff(path, levels, **options):
    """A pyramidal tiled TIFF: ``levels`` as pages of one chain, the reduced ones marked so
    (both tifffile and OpenSlide read it as a pyramid), deflate-compressed 16x16 tiles."""
    with tifffile.TiffWriter(path) as writer:
        for k, level in enumerate(levels):
            writer.write(level, tile=(16, 16), compression="zlib", photometric="rgb", subfiletype=int(k > 0),
                         **(options if k == 0 else {}))


@pytest.fixture(scope="module")
def pyramid(tmp_path_factory):
    """Levels 0 and 1 (of uneven sizes) as a TIFF, a zarr multiscale store and ``.npy`` files."""
    folder = tmp_path_factory.mktemp("pyramid")
    levels = [_slide_image(53, 71, 0), _slide_image(27, 36, 1)]
    _write_tiff(folder / "slide.tif", levels, resolution=(1e4 / 0.25, 1e4 / 0.25), resolutionunit="CENTIMETER")
    group = zarr.open_group(str(folder / "slide.zarr"), mode="w")
    for k, level in enumerate(levels):
        np.save(folder / f"level{k}.npy", level)
        array = group.create_array(str(k), shape=level.shape, chunks=(16, 16, 3), dtype="uint8")
        array[...] = level
    return folder, levels


@pytest.mark.parametrize("level", [0, 1])
def test_step_from_tiff_zarr_and_npy_equals_plain_step(pyramid, level):
    folder, levels = pyramid
    model = _model()
    height, width, _ = levels[level].shape
    tiled = tilec.compile(model, [((1, 3, height, width), "uint8"), ((1,), "int64")], grid=GRID)
    label = torch.tensor([2])
    plain = torch.from_numpy(np.load(folder / f"level{level}.npy")).permute(2, 0, 1)[None]
    want = _step(model, model, plain, label)
    for path in ("slide.tif", "slide.zarr", f"level{level}.npy"):
        source = tilec.slide(folder / path, level=level if path != f"level{level}.npy" else 0)
        assert source.shape == (1, 3, height, width), path
        _assert_same(want, _step(model, tiled, source, label))
    assert tiled.reading.bytes > 0


class Recorder:
    """An (H, W, 3) array that records the regions read from it."""

    def __init__(self, array):
        self.array, self.shape, self.dtype, self.reads = array, array.shape, array.dtype, []

    def __getitem__(self, index):
        self.reads.append(index)
        return self.array[index]


def test_tiles_read_their_regions_only(pyramid):
    _, levels = pyramid
    recorder = Recorder(levels[0])
    model = _model()
    tiled = tilec.compile(model, [((1, 3, 53, 71), "uint8"), ((1,), "int64")], grid=GRID)
    _step(model, tiled, tilec.slide(recorder), torch.tensor([0]))
    spans = [(index[0].stop - index[0].start) * (index[1].stop - index[1].start) for index in recorder.reads]
    assert len(spans) >= 6 and max(spans) < 53 * 71 * 0.6, spans


def test_masked_step_equals_step_on_masked_array(tmp_path):
    levels = [_slide_image(64, 96, 2)]
    levels += [levels[0][::2, ::2].copy(), levels[0][::4, ::4].copy()]
    _write_tiff(tmp_path / "slide.tif", levels)
    source = tilec.slide(tmp_path / "slide.tif")
    mask = source.tissue()  # on level 2, 16 x 24
    assert mask.shape == (16, 24) and 0.2 < mask.mean() < 0.8
    masked = source.masked(mask)
    inside = np.repeat(np.repeat(mask, 4, axis=0), 4, axis=1)
    reference = np.where(inside[..., None], levels[0], np.uint8(255))
    assert (masked[0] == reference.transpose(2, 0, 1)).all()
    model = _model()
    tiled = tilec.compile(model, [((1, 3, 64, 96), "uint8"), ((1,), "int64")], grid=(4, 3))
    label = torch.tensor([1])
    want = _step(model, model, torch.from_numpy(reference).permute(2, 0, 1)[None], label)
    _assert_same(want, _step(model, tiled, masked, label))


def test_tissue_mask_finds_the_stain():
    image = _slide_image(120, 160, 3)
    rows, cols = np.ogrid[:120, :160]
    stained = ((rows - 54) / 36) ** 2 + ((cols - 88) / 48) ** 2 < 1
    found = tilec.slide(image).tissue()
    assert (found == stained).mean() > 0.97
    assert not tilec.slide(np.full((8, 8, 3), 250, dtype=np.uint8)).tissue().any()


def test_slide_indexes_like_numpy(tmp_path):
    image = _slide_image(37, 45, 4)
    view = image.transpose(2, 0, 1)[None]
    source = tilec.slide(image)
    for index in [(0, slice(None), slice(3, 20), slice(5, 44)), (Ellipsis, slice(-7, None), slice(None, None, 3)),
                  (slice(None), 1, 4), (0, slice(1, 3), slice(30, 10), slice(2, 9, 2)), Ellipsis, (0, 2, -1, -1)]:
        assert np.array_equal(source[index], view[index]), index
    with pytest.raises(IndexError):
        source[0, :, ::-1]


def test_levels_and_microns_per_pixel(tmp_path):
    levels = [_slide_image(40, 48, 5), _slide_image(20, 24, 6)]
    _write_tiff(tmp_path / "generic.tif", levels, resolution=(1e4 / 0.5, 1e4 / 0.5), resolutionunit="CENTIMETER")
    opened = tilec.slide(tmp_path / "generic.tif", level=1)
    assert [(lv.height, lv.width) for lv in opened.levels] == [(40, 48), (20, 24)]
    assert opened.levels[0].mpp == pytest.approx((0.5, 0.5)) and opened.mpp == pytest.approx((1.0, 1.0))
    assert opened.at(0).shape == (1, 3, 40, 48)
    description = "Aperio Image Library v12.0.5\r\n48x40 -> 48x40 - |AppMag = 40|MPP = 0.2501"
    _write_tiff(tmp_path / "aperio.svs", levels, description=description)
    assert tilec.slide(tmp_path / "aperio.svs").mpp == pytest.approx((0.2501, 0.2501))
    tifffile.imwrite(tmp_path / "ome.ome.tif", levels[0], tile=(16, 16), photometric="rgb",
                     metadata={"axes": "YXS", "PhysicalSizeX": 0.3, "PhysicalSizeY": 0.4})
    ome = tilec.slide(tmp_path / "ome.ome.tif")
    assert ome.mpp == pytest.approx((0.4, 0.3)) and np.array_equal(ome[0], levels[0].transpose(2, 0, 1))
    assert tilec.slide(levels[0]).mpp is None


def test_openslide_reads_what_tifffile_reads(tmp_path):
    pytest.importorskip("openslide", exc_type=ImportError)
    levels = [_slide_image(64, 96, 8), _slide_image(32, 48, 9), _slide_image(15, 23, 10)]
    _write_tiff(tmp_path / "slide.tif", levels)
    for level in (0, 1):
        opened = tilec.slide(tmp_path / "slide.tif", level=level, reader="openslide")
        assert opened.shape == (1, 3, *levels[level].shape[:2])
        assert np.array_equal(opened[0, :, 5:40, 3:30], levels[level].transpose(2, 0, 1)[:, 5:40, 3:30])
    with pytest.raises(tilec.SlideError, match="downsample"):
        tilec.slide(tmp_path / "slide.tif", level=2, reader="openslide")


@pytest.mark.parametrize(("hidden", "package", "call"), [
    ("tifffile", "tifffile", lambda folder: tilec.slide(folder / "slide.tif")),
    ("zarr", "zarr", lambda folder: tilec.slide(folder / "slide.zarr")),
    ("openslide", "openslide-python", lambda folder: tilec.slide(folder / "slide.tif", reader="openslide")),
    ("skimage", "scikit-image", lambda folder: tilec.slide(folder / "level1.npy").tissue()),
])
def test_a_missing_reader_names_its_package(pyramid, monkeypatch, hidden, package, call):
    folder, _ = pyramid
    for name in list(sys.modules):
        if name == hidden or name.startswith(hidden + "."):
            monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, hidden, None)
    with pytest.raises(tilec.SlideError) as raised:
        call(folder)
    message = str(raised.value)
    assert f"pip install {package}" in message and "\n" not in message, message


def test_bad_slides_are_refused_in_one_line(tmp_path):
    (tmp_path / "notes.tif").write_text("not a tiff")
    for call, words in [(lambda: tilec.slide(tmp_path / "missing.svs"), "does not exist"),
                        (lambda: tilec.slide(np.zeros((4, 4, 3), np.uint8), level=2), "level"),
                        (lambda: tilec.slide(np.zeros((2, 4, 4, 3), np.uint8)), "(H, W, C)"),
                        (lambda: tilec.slide(tmp_path / "notes.tif", reader="tifffile"), "notes.tif"),
                        (lambda: tilec.slide(np.zeros((4, 4, 3), np.uint8), reader="pil"), "reader")]:
        with pytest.raises(tilec.SlideError, match=None) as raised:
            call()
        assert words in str(raised.value) and "\n" not in str(raised.value)


def test_plane_reads_channel_first_arrays():
    image = _slide_image(9, 11, 7)
    plane = Plane(image.transpose(2, 0, 1)[None], "ZCYX")
    assert plane.shape == (9, 11, 3) and np.array_equal(plane.read((2, 7), (1, 10)), image[2:7, 1:10])


def _framed_reference(level: np.ndarray, top: int, left: int, height: int, width: int, fill) -> np.ndarray:
    """``level`` (H, W, C) as a ``height`` x ``width`` frame whose pixel (r, c) is its (r + top, c + left)."""
    padded = np.full((height, width, level.shape[2]), fill, dtype=level.dtype)
    rows = slice(max(top, 0), min(top + height, level.shape[0]))
    cols = slice(max(left, 0), min(left + width, level.shape[1]))
    if rows.stop > rows.start and cols.stop > cols.start:
        padded[rows.start - top:rows.stop - top, cols.start - left:cols.stop - left] = level[rows, cols]
    return padded


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.integers(1, 30), st.integers(1, 30), st.integers(-10, 40), st.integers(-10, 40), st.booleans(),
       st.sampled_from([1024, 3, 7]), st.data())
def test_a_framed_slide_reads_its_level_padded_and_cropped(height, width, row, col, masked, cells, data):
    """Reads equal the padded and cropped level; its background (in at most ``cells`` cells a
    side) claims only pixels reading as the fill, and with a cell per pixel all the padding."""
    level = _slide_image(23, 19, 11)
    mask = np.random.default_rng((row + 10) * 64 + col + 10).random((5, 4)) < 0.5
    opened = tilec.slide(level)
    if masked:
        opened = opened.masked(mask, fill=7)
        level = np.where(mask[np.arange(23) * 5 // 23][:, np.arange(19) * 4 // 19][..., None], level, np.uint8(7))
    framed = opened.framed(height, width, origin=(row, col))
    reference = _framed_reference(level, row, col, height, width, 7 if masked else 255)
    view = reference.transpose(2, 0, 1)[None]
    assert framed.shape == (1, 3, height, width) and np.array_equal(framed[...], view)
    bounds = st.tuples(st.integers(0, height), st.integers(0, height))
    (r0, r1), (c0, c1) = data.draw(bounds), data.draw(st.tuples(st.integers(0, width), st.integers(0, width)))
    assert np.array_equal(framed[0, :, r0:r1, c0:c1], view[0, :, r0:r1, c0:c1])
    pixels = [np.stack([np.arange(n), np.arange(1, n + 1)], axis=1) for n in (height, width)]
    with mock.patch("tilec.slides.FRAME_CELLS", cells):
        counted = framed.background().constant(*pixels)  # per pixel: the estimate counts it as background
    top, left = row, col
    outside = ((np.arange(height) + top < 0) | (np.arange(height) + top >= 23))[:, None] | (
        (np.arange(width) + left < 0) | (np.arange(width) + left >= 19))[None, :]
    assert (view[0] == (7 if masked else 255)).all(axis=0)[counted].all()
    if cells > max(height, width):
        assert counted[outside].all() and (masked or (counted == outside).all())


def test_a_masked_slide_is_framed_from_its_tissue():
    image = np.full((90, 120, 3), 255, dtype=np.uint8)
    mask = np.zeros((9, 12), dtype=bool)
    mask[2:5, 6:11] = True  # level pixels [20, 50) x [60, 110)
    masked = tilec.slide(image).masked(mask)
    assert masked.tissue_box() == ((20, 50), (60, 110))
    assert masked.framed(40, 64).frame == (20, 60, 40, 64)  # the box fits: it starts the frame
    framed = masked.framed(30, 40)  # the box's rows fit, its columns are cut 5 pixels at each end
    assert framed.frame == (20, 65, 30, 40) and framed.fill == 255
    assert tilec.slide(image).framed(40, 64).frame == (25, 28, 40, 64)
    assert tilec.slide(image).framed(100, 140).frame == (0, 0, 100, 140)
    assert masked.tissue_box(np.zeros((3, 3), dtype=bool)) is None
    padding = tilec.slide(image).framed(100, 140, origin=(-5, -10)).background()
    assert padding.constant(np.array([[0, 5], [0, 6], [95, 100]]), np.array([[10, 130]])).ravel().tolist() == [
        True, False, True]
    with pytest.raises(tilec.SlideError, match="frame"):
        tilec.slide(image).framed(0, 10)


def test_framed_slides_of_several_sizes_train_on_one_plan_and_compute_the_padding_once():
    """Slides larger and smaller than the frame, a training-mode BatchNorm: the step of the one
    plan equals the plain step on each framed array, and the tiles reading only padding are
    computed once."""
    model = _model()
    frame, label = (60, 72), torch.tensor([1])
    slides = [tilec.slide(_slide_image(height, width, seed)).framed(*frame)
              for seed, (height, width) in enumerate([(24, 30), (70, 40), (61, 90)])]
    tiled = tilec.compile(model, [slides[0], ((1,), "int64")], grid=(6, 6), dtype="float64")
    assert list(described([slides[0], ((1,), "int64")])[1]) == [0]  # the estimate knows the padding
    for k, framed in enumerate(slides):
        want = _step(model, model, torch.from_numpy(np.ascontiguousarray(framed[...])), label)
        _assert_same(want, _step(model, tiled, framed, label))
        if k == 0:
            assert tiled.reuse.reused > 0, tiled.reuse
