"""Layouts that published networks use and tilec once refused, each tiled exactly (float64 <= 1e-10):

* MONAI's ``UpCat``: upsample, ``F.pad(x, widths, "replicate")`` to the skip's size (zero widths at
  even sizes), concatenate; and a convolution with ``padding_mode="reflect"`` (a reflect pad);
* timm's GhostNet: ``x += shortcut`` written into a channel slice of a concatenation (an in-place
  write into a view, made a ``slice_scatter`` by ``tilec.functionalize``);
* a model that calls ``x.float()`` (a cast and a metadata assertion, which computes nothing);
* a grid finer than a segment's outputs, which compile output and ``tilec inspect`` name.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner
from torch import nn

from tilec.cli import main
from tilec.errors import UnsupportedLayerError
from tilec.pipeline import build
from tilec.trace import trace

from support.exactness import check_exact


class UpCat(nn.Module):
    """MONAI's ``UpCat``: the decoder's input upsampled, padded to the skip's size in replicate
    mode, concatenated with the skip, convolved."""

    def __init__(self, channels: int):
        super().__init__()
        self.up = nn.Upsample(scale_factor=2)
        self.conv = nn.Conv2d(2 * channels, channels, 3, padding=1)

    def forward(self, x, skip):
        x = self.up(x)
        widths = [0, skip.shape[-1] - x.shape[-1], 0, skip.shape[-2] - x.shape[-2]]
        return self.conv(torch.cat([skip, F.pad(x, widths, "replicate")], 1))


class MonaiLike(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3, padding=1)
        self.down = nn.Conv2d(4, 4, 3, stride=2, padding=1)
        self.upcat = UpCat(4)
        self.head = nn.Conv2d(4, 2, 3, padding=2, padding_mode="reflect")
        self.edge = nn.ReplicationPad2d((2, 0, 1, 3))

    def forward(self, x):
        skip = torch.relu(self.stem(x))
        return self.edge(self.head(self.upcat(torch.relu(self.down(skip)), skip)))


class Ghost(nn.Module):
    """timm's GhostBottleneck shape: a cheap depthwise half concatenated to a primary half, and the
    shortcut added in place into a channel slice, then into all channels."""

    def __init__(self):
        super().__init__()
        self.primary = nn.Conv2d(8, 4, 1)
        self.cheap = nn.Conv2d(4, 4, 3, padding=1, groups=4)
        self.out = nn.Conv2d(8, 8, 3, padding=1)

    def forward(self, x):
        primary = self.primary(x)
        y = torch.cat([primary, self.cheap(primary)], 1)
        y[:, :6] += x[:, :6]
        whole = y[:, :8]
        whole += x
        return self.out(y)


@pytest.mark.parametrize("shape, grid", [((1, 3, 17, 15), (2, 2)), ((1, 3, 17, 15), (3, 4)),
                                         ((1, 3, 16, 16), (2, 3)), ((2, 3, 9, 11), (4, 4))])
def test_replicate_and_reflect_padding_tile_exactly(shape, grid):
    torch.manual_seed(0)
    model = MonaiLike()
    assert all(node.tileable for node in trace(model, shape)), "every node runs tile by tile"
    check_exact(model, shape, grid=grid)


@pytest.mark.parametrize("grid", [(2, 2), (3, 3), (13, 11)])
def test_in_place_writes_into_channel_slices_tile_exactly(grid):
    torch.manual_seed(0)
    graph = trace(Ghost(), (1, 8, 13, 11))
    assert [n.op for n in graph if n.op in ("slice_scatter", "add")] == ["add", "slice_scatter", "add"]
    assert all(node.tileable for node in graph)
    check_exact(Ghost(), (1, 8, 13, 11), grid=grid)


def test_a_write_through_a_reshaped_view_is_refused_naming_the_module():
    class Reshaped(nn.Module):
        def forward(self, x):
            y = x * 2
            y.view(1, 3, -1)[..., :4].add_(1)
            return y

    refusal = (r"op aten.add_ from the model's forward \(Reshaped\) is not supported: it writes in place "
               r"through an aten.view")
    with pytest.raises(UnsupportedLayerError, match=refusal):
        trace(Reshaped(), (1, 3, 8, 8))


def test_a_view_taken_before_a_write_reads_the_value_before_it():
    class Stale(nn.Module):
        def forward(self, x):
            y = x * 1
            view = y[:, :2]
            y.add_(1)
            return view * 2

    x = torch.randn(1, 3, 8, 8, dtype=torch.float64)
    tiled = build(Stale(), tuple(x.shape), (2, 2), dtype="float64")
    assert torch.equal(tiled(x), Stale()(x))


def test_a_model_calling_float_compiles_and_trains_within_float32_rounding():
    class Floats(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3, padding=1)

        def forward(self, x):
            return self.conv(x.float() / 255)

    torch.manual_seed(0)
    model = Floats()
    assert "_assert_tensor_metadata" not in [n.op for n in trace(model, (1, 3, 9, 10))]
    tiled = build(model, (1, 3, 9, 10), (2, 2))
    x = torch.rand(1, 3, 9, 10).mul(255).requires_grad_()
    expected, got = model(x), tiled(x)
    assert torch.allclose(got, expected, rtol=1e-5, atol=1e-6)
    (want,) = torch.autograd.grad(expected.sum(), x)
    (have,) = torch.autograd.grad(got.sum(), x)
    assert torch.allclose(have, want, rtol=1e-5, atol=1e-7)


def test_a_clipped_grid_is_named_by_compile_and_inspect(tmp_path):
    model_file = tmp_path / "small.py"
    model_file.write_text("from torch import nn\nINPUT_SHAPE = (1, 3, 16, 16)\n"
                          "model = nn.Sequential(nn.Conv2d(3, 4, 3, stride=4, padding=1), nn.ReLU())\n")
    runner = CliRunner()
    compiled = runner.invoke(main, ["compile", str(model_file), "--grid", "64x64", "--out-dir", str(tmp_path),
                                    "--plan-dir", str(tmp_path)])
    assert compiled.exit_code == 0, compiled.output
    line = "--grid 64x64 is finer than the outputs of segment 0: clipped to 4x4"
    assert line in " ".join(compiled.output.split())
    inspected = runner.invoke(main, ["inspect", str(tmp_path / "small.plan.json")])
    assert inspected.exit_code == 0 and line in " ".join(inspected.output.split())
