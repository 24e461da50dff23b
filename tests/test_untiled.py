"""An op tilec cannot run tile by tile (no tiling rule: ``flip``, ``roll``, ``cumsum`` over an
image axis, ``im2col``; or one its rule sees mixing the image: circular padding,
a concatenation of rows, a positional embedding, alpha dropout in training mode) runs untiled, in a
stored segment between tiled ones, and the step stays exact; ``tilec compile`` names each such node
and why. Uneven sizes, odd grids, eval and training mode, a budget plan."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner
from torch import nn

from tilec.cli import main
from tilec.pipeline import plan_for
from tilec.report import untiled, untiled_nodes
from tilec.target import REFERENCE
from tilec.trace import trace

from support.exactness import check_exact
from support.models import Lambda

SHAPE = (2, 3, 13, 11)
GRIDS = [(2, 2), (3, 2), (5, 4)]


class Body(nn.Module):
    """A convolution with BatchNorm, then ``op`` inside a submodule at path ``stage.op``, then a
    convolution with BatchNorm and global pooling: tiled segments on both sides of it."""

    def __init__(self, op, channels: int = 4):
        super().__init__()
        self.conv = nn.Conv2d(3, channels, 3, padding=1)
        self.norm = nn.BatchNorm2d(channels)
        self.stage = nn.Sequential()
        self.stage.add_module("op", Lambda(op))
        self.last = nn.Conv2d(channels, 2, 3)
        self.last_norm = nn.BatchNorm2d(2)

    def forward(self, x):
        y = self.stage(F.relu(self.norm(self.conv(x))))
        return F.relu(self.last_norm(self.last(y))).mean((2, 3))


def _unfolded(x):
    """im2col and col2im: a 3x3 neighbourhood gathered into channels, summed back."""
    return F.fold(F.unfold(x, 3, padding=1) * 0.5, x.shape[2:], 3, padding=1)


def _unpooled(x):
    """Pooling with indices in overlapping windows, and unpooling to them."""
    pooled, indices = F.max_pool2d(x, 3, 2, 1, return_indices=True)
    return F.max_unpool2d(pooled * 2, indices, 3, 2, 1, output_size=x.shape[2:]) + x


#: name: (op, the aten op that runs untiled, why it does)
OPS = {
    "flip": (lambda x: x + torch.flip(x, [2]), "flip", "no tiling rule"),
    "roll": (lambda x: torch.roll(x, 1, 3), "roll", "no tiling rule"),
    "cumsum": (lambda x: x.cumsum(2) / 4, "cumsum", "no tiling rule"),
    "sort": (lambda x: x.sort(1).values, "sort", "no tiling rule"),
    "unfold": (_unfolded, "im2col", "no tiling rule"),
    "unpool": (_unpooled, "max_unpool2d", "windows overlap"),
    "circular": (lambda x: F.pad(x, (1, 1, 1, 1), mode="circular"), "pad", "padding mode 'circular'"),
    "cat_rows": (lambda x: torch.cat([x, x * 2], dim=2), "cat", "along an image axis"),
    "strided": (lambda x: x[:, :, ::2], "slice", "step other than 1"),
    "einsum": (lambda x: torch.einsum("bchw,bchw->bchw", x, x), "einsum", "an einsum other than"),
    "first_row": (lambda x: x[:, :, :1].expand_as(x) * x, "expand_as", "broadcasts one image over another"),
    "local_response": (lambda x: F.local_response_norm(x, 3), "avg_pool3d", "no tiling rule"),
}


@pytest.mark.parametrize("grid", GRIDS, ids=lambda g: f"{g[0]}x{g[1]}")
@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("name", list(OPS))
def test_an_op_without_a_tile_rule_runs_untiled_and_exact(name, train, grid):
    op, aten, why = OPS[name]
    model = Body(op).train(train)
    graph = trace(model, SHAPE)
    found = {node.op: reason for node, reason in untiled_nodes(graph)}
    assert aten in found and why in found[aten]
    segments = plan_for(graph, REFERENCE, "m", grid=grid).segments
    assert segments[0].mode == "tiled" and "stored" in [s.mode for s in segments]
    check_exact(Body(op).train(train), SHAPE, grid=grid, traced_as=f"body {name}")


class PositionalEmbedding(nn.Module):
    """A parameter the size of the image added to it (a ViT-style positional embedding), or
    computed from that parameter."""

    def __init__(self, scaled: bool):
        super().__init__()
        self.conv, self.scaled = nn.Conv2d(3, 4, 3, padding=1), scaled
        self.position = nn.Parameter(torch.randn(1, 4, 13, 11))
        self.last = nn.Conv2d(4, 2, 3, padding=1)

    def forward(self, x):
        return self.last(self.conv(x) + (self.position * 2 if self.scaled else self.position))


@pytest.mark.parametrize("scaled", [False, True], ids=["parameter", "computed"])
def test_a_positional_embedding_runs_untiled_and_exact(scaled):
    found = untiled_nodes(trace(PositionalEmbedding(scaled), SHAPE))
    assert [node.op for node, _ in found] == ["add"] and "positional embedding" in found[0][1]
    check_exact(PositionalEmbedding(scaled), SHAPE, grid=(3, 2))


def test_a_circular_padding_mode_convolution_runs_untiled_and_exact():
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(),
                          nn.Conv2d(4, 4, 3, padding=1, padding_mode="circular"), nn.Conv2d(4, 2, 3))
    assert [node.op for node, _ in untiled_nodes(trace(model, SHAPE))] == ["pad"]
    check_exact(model, SHAPE, grid=(3, 2))


def test_alpha_dropout_in_training_mode_runs_untiled_drawing_torchs_masks():
    """Untiled, alpha dropout draws PyTorch's own mask from its generator: the tiled step, seeded
    as the plain one, draws the same one."""
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.SELU(), nn.AlphaDropout(0.3), nn.Conv2d(4, 2, 3)).train()
    found = untiled_nodes(trace(model, SHAPE))
    assert [node.op for node, _ in found] == ["alpha_dropout"] and "training mode" in found[0][1]
    check_exact(model, SHAPE, grid=(2, 3))


def test_a_budget_plan_stores_only_the_untiled_node():
    """With a small budget, the search plans around the untiled node: it runs in a stored segment
    with the sum reading it, the training-mode BatchNorms on both sides by sweeps in tiled ones."""
    plan = plan_for(trace(Body(OPS["flip"][0]), (1, 3, 512, 512)), REFERENCE, "m", memory_budget="16MiB")
    modes = [(s.mode, [node.op for node in plan.model.nodes[s.first:s.stop]]) for s in plan.segments]
    assert modes == [("tiled", ["conv2d", "batch_norm", "relu"]), ("stored", ["flip", "add"]),
                     ("tiled", ["conv2d", "batch_norm", "relu", "mean"])]
    assert plan.predicted_peak_bytes <= 0.9 * 16 * 2**20


def test_compile_and_inspect_name_the_untiled_nodes(tmp_path):
    (tmp_path / "m.py").write_text(
        "import torch\nfrom torch import nn\n"
        "class M(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.conv = nn.Conv2d(3, 4, 3, padding=1)\n"
        "        self.shift = Shift()\n"
        "    def forward(self, x):\n"
        "        return self.shift(self.conv(x)).mean((2, 3))\n"
        "class Shift(nn.Module):\n"
        "    def forward(self, x):\n"
        "        return torch.roll(x, 2, 3)\n"
        "model = M()\nINPUT_SHAPE = (1, 3, 16, 16)\n")
    result = CliRunner().invoke(main, ["compile", str(tmp_path / "m.py"), "--grid", "2x2", "--out-dir",
                                       str(tmp_path), "--plan-dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    line = " ".join(result.output.split())
    assert "1 node(s) run untiled, the maps around them kept whole: roll (aten.roll, shift): tilec has no tiling " \
           "rule for it" in line
    nodes = CliRunner().invoke(main, ["inspect", str(tmp_path / "m.plan.json"), "--nodes"], terminal_width=400)
    (row,) = [line for line in nodes.output.splitlines() if "│ roll " in line]
    assert "no: tilec has no tiling rule for it" in row and "stored" in row


def test_untiled_lists_five_nodes_and_counts_the_rest():
    class Many(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3, padding=1)

        def forward(self, x):
            y = self.conv(x)
            for _ in range(7):
                y = torch.flip(y, [3]) + 1
            return self.conv(y[:, :3])

    model = Many()
    graph = trace(model, SHAPE)
    (line,) = untiled(plan_for(graph, REFERENCE, "m", grid=(2, 2)))
    assert line.startswith("7 node(s) run untiled") and line.endswith("and 2 more (tilec inspect --nodes)")
