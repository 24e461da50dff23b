"""Inputs of any dtype, several of them, read by region from arrays on disk (tilec.runtime.sources).

Every check runs the model untiled on the materialised tensors and tiled on the given sources,
in float64, and compares the outputs and every gradient.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner
from torch import nn

from tilec.cli import main
from tilec.pipeline import build
from tilec.planner import plan as plan_of
from tilec.report import describe_plan, input_reads
from tilec.runtime.sources import Source, _mapping
from tilec.trace import trace

TOLERANCE = 1e-10
GRIDS = [(1, 1), (3, 2), (4, 3)]


class Stem(nn.Module):
    """uint8 image -> float64 features: the model converts its own input."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 3, padding=1)
        self.conv2 = nn.Conv2d(6, 8, 3, stride=2, padding=1)
        self.pool = nn.MaxPool2d(3, stride=2, padding=1)
        self.conv3 = nn.Conv2d(8, 4, 3, padding=1)

    def forward(self, image):
        x = (image.to(torch.float64) - 127.5) / 64
        return self.conv3(self.pool(torch.relu(self.conv2(torch.relu(self.conv1(x))))))


class SegmentationLoss(nn.Module):
    """A two-level U-Net returning its per-pixel cross-entropy against a uint8 mask (2 = ignored)."""

    def __init__(self):
        super().__init__()
        self.down = nn.Conv2d(3, 8, 3, padding=1)
        self.pool = nn.MaxPool2d(2)
        self.bottom = nn.Conv2d(8, 8, 3, padding=1)
        self.up = nn.ConvTranspose2d(8, 8, 2, stride=2)
        self.out = nn.Conv2d(16, 3, 3, padding=1)

    def forward(self, image, mask):
        x = image.to(torch.float64) / 255
        skip = torch.relu(self.down(x))
        up = self.up(torch.relu(self.bottom(self.pool(skip))))
        up = F.pad(up, [0, skip.shape[3] - up.shape[3], 0, skip.shape[2] - up.shape[2]])
        logits = self.out(torch.cat([skip, up], 1))
        return F.cross_entropy(logits, mask.long(), ignore_index=2)


class LabelledClassifier(nn.Module):
    """A float image and per-sample labels (N,) -> the classifier's cross-entropy."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, stride=2, padding=1)
        self.fc = nn.Linear(8, 5)

    def forward(self, image, label):
        return F.cross_entropy(self.fc(torch.relu(self.conv(image)).mean((2, 3))), label)


def _seeded(model: nn.Module) -> nn.Module:
    torch.manual_seed(0)
    for parameter in model.parameters():
        nn.init.normal_(parameter, std=0.3)
    return model.double()


def _errors(model, tiled, reference_inputs, tiled_inputs) -> dict[str, float]:
    """Max abs difference of every output and parameter gradient (``sum`` of the outputs)."""
    params = list(model.parameters())
    ref = model(*reference_inputs)
    ref_grads = torch.autograd.grad(ref.sum(), params)
    got = tiled(*tiled_inputs)
    got_grads = torch.autograd.grad(got.sum(), params)
    errors = {"output": (ref - got).abs().max().item()}
    errors.update({f"grad {k}": (a - b).abs().max().item() for k, (a, b) in enumerate(zip(ref_grads, got_grads,
                                                                                         strict=True))})
    return errors


def _image(shape=(1, 3, 37, 29), seed=0) -> torch.Tensor:
    return torch.randint(0, 256, shape, generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)


def _sources(image: torch.Tensor, kind: str, folder):
    """``image`` (N, C, H, W uint8) as the source ``kind`` gives it."""
    if kind == "tensor":
        return image
    if kind == "npy":
        np.save(folder / "image.npy", image.numpy())
        return np.load(folder / "image.npy", mmap_mode="r")
    if kind == "hwc-npy":  # an H x W x C file seen as (1, C, H, W)
        np.save(folder / "image.npy", image[0].permute(1, 2, 0).contiguous().numpy())
        return np.load(folder / "image.npy", mmap_mode="r").transpose(2, 0, 1)[None]
    zarr = pytest.importorskip("zarr")
    array = zarr.open_array(str(folder / "image.zarr"), mode="w", shape=tuple(image.shape), chunks=(1, 3, 16, 16),
                            dtype="uint8")
    array[...] = image.numpy()
    return array


@pytest.mark.parametrize("grid", GRIDS)
@pytest.mark.parametrize("kind", ["tensor", "npy", "hwc-npy", "zarr"])
def test_uint8_input_from_every_source_is_exact(kind, grid, tmp_path):
    model = _seeded(Stem())
    image = _image()
    tiled = build(model, [((1, 3, 37, 29), "uint8")], grid, dtype="float64")
    errors = _errors(model, tiled, [image], [_sources(image, kind, tmp_path)])
    assert max(errors.values()) <= TOLERANCE, errors
    segment = type(tiled).steps[0].run
    if kind != "tensor" and grid == (1, 1):  # a stored segment reads the input whole, once
        assert tiled.reading.bytes == image.numel()
    elif kind != "tensor":  # each tile read its region once in forward and once in backward, nothing else
        regions = sum((row[0][0][1] - row[0][0][0]) * (col[0][0][1] - col[0][0][0])
                      for row in segment.rows for col in segment.cols)
        assert tiled.reading.bytes == 2 * 3 * regions


@pytest.mark.parametrize("grid", GRIDS)
def test_two_input_unet_loss_against_a_mask_file_is_exact(grid, tmp_path):
    model = _seeded(SegmentationLoss())
    image, mask = _image((2, 3, 41, 30)), torch.randint(0, 3, (2, 41, 30), dtype=torch.uint8)
    np.save(tmp_path / "mask.npy", mask.numpy())
    tiled = build(model, [((2, 3, 41, 30), "uint8"), ((2, 41, 30), "uint8")], grid, dtype="float64")
    errors = _errors(model, tiled, [image, mask], [_sources(image, "npy", tmp_path),
                                                   np.load(tmp_path / "mask.npy", mmap_mode="r")])
    assert max(errors.values()) <= TOLERANCE, errors
    assert [name for name, _, _ in tiled.plan.inputs] == ["image", "mask"]


@pytest.mark.parametrize("later", [(2, 2), (1, 1)])
def test_a_segmented_plan_reads_an_input_in_a_later_segment(later, tmp_path):
    """The mask is read by the loss, in the second segment: by region if it is tiled, whole if stored."""
    model = _seeded(SegmentationLoss())
    image, mask = _image((1, 3, 33, 35)), torch.randint(0, 3, (1, 33, 35), dtype=torch.uint8)
    np.save(tmp_path / "mask.npy", mask.numpy())
    tiled = build(model, [((1, 3, 33, 35), "uint8"), ((1, 33, 35), "uint8")],
                  segments=[(0, 5, (3, 3)), (5, 13, later)], dtype="float64")
    errors = _errors(model, tiled, [image, mask], [_sources(image, "npy", tmp_path),
                                                   np.load(tmp_path / "mask.npy", mmap_mode="r")])
    assert max(errors.values()) <= TOLERANCE, errors


def test_per_sample_labels_reach_the_loss_and_only_a_float_input_gets_a_gradient():
    model = _seeded(LabelledClassifier())
    image = torch.randn(3, 3, 23, 19, dtype=torch.float64)
    label = torch.tensor([1, 4, 0])
    tiled = build(model, [((3, 3, 23, 19), None), ((3,), "int64")], (3, 2), dtype="float64")
    reference, given = image.clone().requires_grad_(), image.clone().requires_grad_()
    expected = model(reference, label)
    expected.backward()
    got = tiled(given, label)
    got.backward()
    assert (expected - got).abs().item() <= TOLERANCE
    assert (reference.grad - given.grad).abs().max().item() <= TOLERANCE
    frozen = image.clone()
    tiled(frozen, label).backward()
    assert frozen.grad is None


def test_reading_ahead_or_not_gives_the_same_step(tmp_path):
    model = _seeded(Stem())
    image = _image()
    array = _sources(image, "npy", tmp_path)
    source = build(model, [((1, 3, 37, 29), "uint8")], (3, 3), dtype="float64")
    plan_class = type(source)
    results = []
    for ahead in (True, False):
        tiled = plan_class(model, read_ahead=ahead)
        out = tiled(array)
        results.append((out, torch.autograd.grad(out.sum(), list(model.parameters()))))
    assert torch.equal(results[0][0], results[1][0])
    assert all(torch.equal(a, b) for a, b in zip(results[0][1], results[1][1], strict=True))


def test_the_pages_a_read_touched_are_handed_back(tmp_path):
    array = np.lib.format.open_memmap(tmp_path / "big.npy", mode="w+", dtype=np.uint8, shape=(1, 4, 2048, 2048))
    array[...] = 7
    del array
    array = np.load(tmp_path / "big.npy", mmap_mode="r")
    assert _mapping(array) is not None and _mapping(array.transpose(0, 1, 3, 2)) is not None

    def file_pages() -> int:
        status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines())
        return int(status["RssFile"].split()[0]) * 1024

    from tilec.runtime.sources import Reading

    source = Source("big", array, "cpu", Reading(), ahead=False)
    before, most = file_pages(), 0
    for start in range(0, 2048, 256):
        assert int(source.region((2, 3), (start, start + 256), (0, 2048)).sum()) == 7 * 4 * 256 * 2048
        most = max(most, file_pages() - before)
    assert most < 4 << 20  # a region is 2 MiB; the 16 MiB file never stays


def test_staging_is_counted_and_inspect_shows_how_each_input_is_read():
    graph = trace(_seeded(SegmentationLoss()), [((2, 3, 41, 30), "uint8"), ((2, 41, 30), "uint8")])
    plan = plan_of(graph, name="model", grid=(3, 2), dtype="float64")
    assert plan.staging_bytes > 0 and plan.staging_bytes <= plan.predicted_peak_bytes
    lines = input_reads(plan)
    assert lines[0].startswith("input image 2x3x41x30 uint8: read by region by the tiles of segment(s) 0")
    assert "staging of inputs read by region" in lines[-1]
    assert "image 2x3x41x30 uint8, mask 2x41x30 uint8" in describe_plan(plan).title


@pytest.mark.parametrize(("given", "message"), [
    (lambda image: (image.float(),), "input 'image' is float32, plan 'model' needs uint8"),
    (lambda image: (image[:, :, :-1],), "input 'image' has shape (1, 3, 36, 29), plan 'model' needs (1, 3, 37, 29)"),
    (lambda image: (image, image), "plan 'model' takes 1 input(s) (image), got 2"),
    (lambda image: ([1, 2, 3],), "input 'image' must be a torch.Tensor or an array with shape, dtype and slicing"),
])
def test_a_wrong_input_is_refused_in_one_line_naming_it(given, message):
    tiled = build(_seeded(Stem()), [((1, 3, 37, 29), "uint8")], (2, 2), dtype="float64")
    with pytest.raises(ValueError) as error:
        tiled(*given(_image()))
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


MODEL_FILE = '''
import torch
import torch.nn.functional as F
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 2, 3, padding=1)

    def forward(self, image, mask):
        return F.cross_entropy(self.conv(image.float() / 255), mask.long())


model = Net
INPUTS = ["1,3,32,32:uint8", "1,32,32:uint8"]
'''


def test_the_cli_takes_one_input_flag_per_argument(tmp_path):
    path = tmp_path / "net.py"
    path.write_text(MODEL_FILE)
    runner = CliRunner()
    flags = ["--out-dir", str(tmp_path), "--plan-dir", str(tmp_path), "--grid", "2x2"]
    given = runner.invoke(main, ["compile", str(path), "--input", "1,3,48,40:uint8", "--input", "1,48,40:uint8",
                                 "--name", "given", *flags])
    assert given.exit_code == 0, given.output
    assert "image 1x3x48x40 uint8, mask 1x48x40 uint8" in " ".join(given.output.split())
    from_file = runner.invoke(main, ["compile", str(path), "--name", "from_file", *flags])
    assert from_file.exit_code == 0, from_file.output
    assert '{"name": "mask", "shape": [1, 32, 32], "dtype": "uint8"}' in (tmp_path / "from_file.plan.json").read_text()


@pytest.mark.parametrize(("flags", "message"), [
    (["--input", "1,3,32,32:uint7", "--input", "1,32,32:uint8"], "--input '1,3,32,32:uint7': dtype 'uint7' is not"),
    (["--input", "1,3,32,32"], "the model's forward takes 2 tensor input(s) (image, mask); give one shape per"),
    (["--input", "1,3,32,32:uint8", "--input-shape", "1,3,32,32"], "give either --input (once per input) or"),
    (["--input", "1,3,x,32:uint8", "--input", "1,32,32:uint8"], "--input must be SHAPE[:DTYPE]"),
])
def test_bad_input_flags_are_refused_in_one_line(flags, message, tmp_path):
    path = tmp_path / "net.py"
    path.write_text(MODEL_FILE)
    result = CliRunner().invoke(main, ["compile", str(path), *flags, "--grid", "2x2", "--out-dir", str(tmp_path),
                                       "--plan-dir", str(tmp_path)])
    assert result.exit_code == 2
    line = " ".join(result.output.split())
    assert re.search(re.escape(message), line), line
    assert "Traceback" not in result.output and not list(tmp_path.glob("*.plan.json"))


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["tensor", "npy"])
def test_a_host_input_of_a_cuda_model_is_copied_tile_by_tile(kind, tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    model = _seeded(SegmentationLoss())
    image, mask = _image((2, 3, 41, 30)), torch.randint(0, 3, (2, 41, 30), dtype=torch.uint8)
    tiled = build(model, [((2, 3, 41, 30), "uint8"), ((2, 41, 30), "uint8")], (3, 2), dtype="float64")
    expected = _errors(model, tiled, [image, mask], [image, mask])  # both on the CPU first
    model.cuda()
    params = list(model.parameters())
    reference = model(image.cuda(), mask.cuda())
    ref_grads = torch.autograd.grad(reference, params)
    got = tiled(_sources(image, kind, tmp_path), mask)  # host image and mask, model on CUDA
    got_grads = torch.autograd.grad(got, params)
    assert max(expected.values()) <= TOLERANCE
    assert got.device.type == "cuda" and (got - reference).abs().item() <= TOLERANCE
    assert max((a - b).abs().max().item() for a, b in zip(ref_grads, got_grads, strict=True)) <= TOLERANCE
    assert tiled.reading.bytes > 0
