"""Branches of a pooled map run inside the tiled segment: a training-mode BatchNorm on it (the
squeeze-and-excitation of ReXNet, selective kernels, ResNeSt's split attention) updates its running
statistics once per step, and its upsampling back to the image's size (DeepLab's image pooling)
is computed by each tile for its own part. Before, both ran in a stored segment, and the map they
gate or join was kept whole across it: the smallest budget grew with the image."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tilec.pipeline import build, plan_for
from tilec.target import REFERENCE
from tilec.trace import trace

from support.exactness import check_exact
from support.published import published

GRIDS = [(1, 1), (2, 2), (3, 2), (7, 5), (999, 999)]


class GateWithNorm(nn.Module):
    """Squeeze and excitation with a BatchNorm between its two 1x1 convolutions (ReXNet's, SK's)."""

    def __init__(self):
        super().__init__()
        self.conv, self.out = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 4, 3, padding=1)
        self.squeeze = nn.Sequential(nn.Conv2d(8, 4, 1), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 8, 1))

    def forward(self, x):
        y = F.relu(self.conv(x))
        return self.out(y * torch.sigmoid(self.squeeze(y.mean((2, 3), keepdim=True))))


class ImagePooling(nn.Module):
    """DeepLab's ASPP image pooling beside a convolution: pooled, 1x1 convolution, BatchNorm, ReLU,
    upsampled back to the map's size, concatenated, projected."""

    def __init__(self, mode: str = "bilinear"):
        super().__init__()
        self.mode = mode
        self.conv, self.project = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(12, 4, 1)
        self.pooling = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Conv2d(8, 4, 1), nn.BatchNorm2d(4), nn.ReLU())

    def forward(self, x):
        y = F.relu(self.conv(x))
        size = {"size": y.shape[-2:], "mode": self.mode}
        pooled = F.interpolate(self.pooling(y), **size, **({"align_corners": False} if self.mode == "bilinear" else {}))
        return self.project(torch.cat([y, pooled], 1))


MODELS = {"gate": GateWithNorm, "pooling": ImagePooling, "pooling_nearest": lambda: ImagePooling("nearest")}


@pytest.mark.parametrize("grid", GRIDS)
@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_training_step_then_eval_equal_plain(name, grid):
    check_exact(MODELS[name]().train(), (2, 3, 13, 11), grid=grid, eval_after=True)


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("kernels", ["auto", "generic"])
def test_compiled_in_eval_mode_equal_plain(name, kernels):
    check_exact(MODELS[name]().eval(), (2, 3, 13, 11), grid=(3, 2), kernels=kernels)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_one_tiled_segment_holds_the_branch(name):
    graph = trace(MODELS[name]().train(), (2, 3, 13, 11))
    assert all(node.tileable for node in graph)
    segments = plan_for(graph, REFERENCE, "m", grid=(3, 2)).segments
    assert [s.mode for s in segments] == ["tiled"]


def test_a_plan_compiled_in_eval_mode_trains_the_pooled_batch_norm():
    """The pooled BatchNorm follows its module's mode at run time, as a tiled one does."""
    torch.manual_seed(0)
    model = GateWithNorm().double().eval()
    tiled = build(model, (2, 3, 13, 11), (3, 2))
    model.train()
    x = torch.randn(2, 3, 13, 11, dtype=torch.float64)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    tiled(x).sum().backward()
    tiled_state = {k: v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict(start)
    model(x).sum().backward()
    for key, value in model.state_dict().items():
        assert torch.allclose(tiled_state[key].double(), value.double(), rtol=0, atol=1e-12), key
    assert not torch.equal(tiled_state["squeeze.1.running_mean"], start["squeeze.1.running_mean"])


@pytest.mark.parametrize(("package", "build_model"), [
    ("torchvision", lambda: published("torchvision.models.segmentation").deeplabv3_resnet50(
        weights=None, weights_backbone=None, num_classes=3)),
    ("timm", lambda: published("timm").create_model("rexnet_100", pretrained=False, num_classes=3)),
    ("timm", lambda: published("timm").create_model("skresnet18", pretrained=False, num_classes=3)),
], ids=["deeplabv3_resnet50", "rexnet_100", "skresnet18"])
@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_published_models_tile_up_to_their_heads(package, build_model, train):
    """Every node before the last one reading an image tiles (a classifier head's dropout after the
    global pooling runs stored, where it cuts nothing large)."""
    graph = trace(build_model().train(train), (2, 3, 96, 64))
    last = max(k for k, node in enumerate(graph) if graph.sliced_inputs(node))
    assert [node.name for node in list(graph)[:last] if not node.tileable] == []
