"""Linear attention over the pixels (EfficientViT's multi-scale ReLU attention, timm's ``LiteMLA``):
the model splits its channels into heads as it flattens the pixels, chunks queries, keys and
values, pads the values with a row of ones, sums the keys' outer products with them over the
pixels (a reduction, by a sweep) and applies the sum to every query (a matrix per head, per pixel).

An inline copy in float64 is exact against plain PyTorch on odd sizes and grids in both modes.
timm's own block computes its attention in float32 inside ``torch.autocast(enabled=False)``,
whatever the model's dtype: there tiled and plain are each compared with the same model computing
that attention in float64, and tiled must be as close to it as plain is.
"""

from __future__ import annotations

import copy
import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tilec.trace import trace

from support.exactness import max_errors
from support.published import published

TOLERANCE = 1e-10


class LinearAttention(nn.Module):
    """EfficientViT's ``LiteMLA`` as its forward writes it, without the float32 casts: ``qkv`` by a
    1x1 convolution and a 5x5 depthwise aggregation, heads of ``dim`` channels, ReLU kernels."""

    def __init__(self, channels: int = 12, dim: int = 4, eps: float = 1e-5):
        super().__init__()
        self.dim, self.eps = dim, eps
        self.qkv = nn.Conv2d(channels, 3 * channels, 1, bias=False)
        self.aggregate = nn.Sequential(nn.Conv2d(3 * channels, 3 * channels, 5, padding=2, groups=3 * channels),
                                       nn.Conv2d(3 * channels, 3 * channels, 1, groups=3 * channels // dim))
        self.proj = nn.Sequential(nn.Conv2d(2 * channels, channels, 1, bias=False), nn.BatchNorm2d(channels))

    def forward(self, x):
        b, _, h, w = x.shape
        qkv = self.qkv(x)
        qkv = torch.cat([qkv, self.aggregate(qkv)], dim=1).reshape(b, -1, 3 * self.dim, h * w).transpose(-1, -2)
        q, k, v = qkv.chunk(3, dim=-1)
        q, k = F.relu(q), F.relu(k)
        v = F.pad(v, (0, 1), mode="constant", value=1.0)
        out = q @ (k.transpose(-1, -2) @ v)
        out = out[..., :-1] / (out[..., -1:] + self.eps)
        return x + self.proj(out.transpose(-1, -2).reshape(b, -1, h, w))


def _network() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 12, 3, padding=1, bias=False), nn.BatchNorm2d(12), nn.Hardswish(),
                         LinearAttention(), nn.Conv2d(12, 12, 3, stride=2, padding=1), LinearAttention(),
                         nn.AdaptiveAvgPool2d(1))


def _worst(errors: dict[str, float]) -> tuple[str, float]:
    worst = max(errors, key=errors.get)
    return worst, errors[worst]


def test_the_attention_becomes_a_sum_over_the_image_and_a_matrix_per_pixel():
    graph = trace(_network().eval(), (1, 3, 15, 13))
    assert all(n.tileable for n in graph)
    sums = [n for n in graph if n.op == "einsum"]
    assert len(sums) == 2 and all(n.spatial is None for n in sums)  # Σ k vᵀ over the pixels, per head
    matmuls = [n for n in graph if n.op == "matmul"]
    assert len(matmuls) == 2 and all(n.spatial == (2, 3) for n in matmuls)  # each query times that sum


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("grid", [(2, 2), (3, 2), (7, 5)], ids=lambda g: f"{g[0]}x{g[1]}")
def test_tiled_equals_plain(grid, train):
    """Relative to each tensor's magnitude: a query near 0 divides by about ``eps``, and gradients
    reach some 1e2."""
    torch.manual_seed(0)
    errors = max_errors(_network().train(train), (2, 3, 15, 13), grid=grid, relative=True, eval_after=train)
    assert _worst(errors)[1] <= TOLERANCE, _worst(errors)


def _float64_attention(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose ``LiteMLA`` blocks compute their attention in the model's dtype."""
    exact = copy.deepcopy(model)
    lite = published("timm.models.efficientvit_mit").LiteMLA

    def attention(self, q, k, v):
        out = q @ (k.transpose(-1, -2) @ v)
        return out[..., :-1] / (out[..., -1:] + self.eps)

    for module in exact.modules():
        if isinstance(module, lite):
            module._attn = types.MethodType(attention, module)
    return exact


class _Shared(nn.Module):
    """``exact``'s forward run on ``model``'s parameters and buffers (``torch.func.functional_call``)."""

    def __init__(self, model: nn.Module, exact: nn.Module):
        super().__init__()
        self.model, self.exact = model, exact

    def forward(self, x):
        state = {**dict(self.model.named_parameters()), **dict(self.model.named_buffers())}
        return torch.func.functional_call(self.exact, state, (x,))


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_timm_efficientvit_is_as_close_to_float64_attention_as_plain(train):
    """timm's EfficientViT-B0 at one block a stage, one training or eval step, float64 but for the
    attention: tiled's difference from plain is within a few times plain's own difference from the
    same model with float64 attention, per output and gradient."""
    timm = published("timm")
    torch.manual_seed(0)
    model = timm.create_model("efficientvit_b0", pretrained=False, depths=(1, 1, 1, 1, 1), head_widths=(64, 32),
                              num_classes=10).train(train)
    options = {"grid": (3, 2), "relative": True}
    shape = (2, 3, 80, 72)
    tiled = max_errors(copy.deepcopy(model), shape, **options)
    torch.manual_seed(0)
    model = model.double()
    plain = max_errors(model, shape, tiled=_Shared(model, _float64_attention(model)), **options)
    beyond = {key: (tiled[key], plain[key]) for key in tiled if tiled[key] > 4 * plain[key] + 1e-12}
    assert not beyond, beyond
