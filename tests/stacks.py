"""Hypothesis strategies for random valid ``nn.Sequential`` stacks of every supported layer kind."""

from __future__ import annotations

from hypothesis import strategies as st
from torch import nn

POINTWISE_KINDS = (
    "relu", "relu6", "hardtanh", "leaky_relu", "elu", "gelu", "gelu_tanh", "silu",
    "sigmoid", "tanh", "hardswish", "identity", "dropout", "dropout2d", "batch_norm",
    "batch_norm_plain",
)
WINDOW_KINDS = ("conv", "max_pool", "avg_pool")
KINDS = WINDOW_KINDS + POINTWISE_KINDS

#: Layers whose output autograd does not save, so an in-place activation may follow them
#: (in untiled PyTorch too: after a pass-through layer or on the leaf input it would fail).
FRESH_OUTPUT = (nn.Conv2d, nn.MaxPool2d, nn.AvgPool2d, nn.BatchNorm2d)
IN_PLACE = {
    "relu_": lambda: nn.ReLU(inplace=True),
    "relu6_": lambda: nn.ReLU6(inplace=True),
    "hardtanh_": lambda: nn.Hardtanh(-0.5, 0.5, inplace=True),
    "leaky_relu_": lambda: nn.LeakyReLU(0.1, inplace=True),
    "elu_": lambda: nn.ELU(inplace=True),
    "silu_": lambda: nn.SiLU(inplace=True),
    "hardswish_": lambda: nn.Hardswish(inplace=True),
}


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@st.composite
def conv(draw, channels: int) -> nn.Conv2d:
    out_channels = draw(st.integers(1, 4))
    groups = draw(st.sampled_from([g for g in _divisors(channels) if out_channels % g == 0]))
    kernel = draw(st.one_of(st.integers(1, 4), st.tuples(st.integers(1, 4), st.integers(1, 4))))
    dilation = draw(st.one_of(st.integers(1, 3), st.tuples(st.integers(1, 2), st.integers(1, 3))))
    padding = draw(st.one_of(
        st.integers(0, 3), st.tuples(st.integers(0, 3), st.integers(0, 3)), st.sampled_from(["same", "valid"])
    ))
    if padding == "same":
        stride = 1
    else:
        stride = draw(st.one_of(st.integers(1, 3), st.tuples(st.integers(1, 3), st.integers(1, 2))))
    bias = draw(st.booleans())
    return nn.Conv2d(channels, out_channels, kernel, stride=stride, padding=padding, dilation=dilation,
                     groups=groups, bias=bias)


@st.composite
def _pool_geometry(draw):
    kernel = draw(st.one_of(st.integers(1, 4), st.tuples(st.integers(1, 4), st.integers(1, 3))))
    kh, kw = (kernel, kernel) if isinstance(kernel, int) else kernel
    if draw(st.booleans()):
        padding = draw(st.integers(0, min(kh, kw) // 2))
    else:
        padding = (draw(st.integers(0, kh // 2)), draw(st.integers(0, kw // 2)))
    stride = draw(st.one_of(st.none(), st.integers(1, 3), st.tuples(st.integers(1, 3), st.integers(1, 3))))
    return kernel, stride, padding, draw(st.booleans())


@st.composite
def max_pool(draw) -> nn.MaxPool2d:
    kernel, stride, padding, ceil_mode = draw(_pool_geometry())
    dilation = draw(st.one_of(st.integers(1, 2), st.tuples(st.integers(1, 2), st.integers(1, 3))))
    return nn.MaxPool2d(kernel, stride=stride, padding=padding, dilation=dilation, ceil_mode=ceil_mode)


@st.composite
def avg_pool(draw) -> nn.AvgPool2d:
    kernel, stride, padding, ceil_mode = draw(_pool_geometry())
    return nn.AvgPool2d(kernel, stride=stride, padding=padding, ceil_mode=ceil_mode,
                        count_include_pad=draw(st.booleans()),
                        divisor_override=draw(st.one_of(st.none(), st.integers(1, 7))))


@st.composite
def pointwise(draw, kind: str, channels: int) -> nn.Module:
    if kind == "relu":
        return nn.ReLU()
    if kind == "relu6":
        return nn.ReLU6()
    if kind == "hardtanh":
        low = draw(st.sampled_from([-2.0, -1.0, -0.25, 0.0]))
        return nn.Hardtanh(low, low + draw(st.sampled_from([0.5, 1.0, 3.0])))
    if kind == "leaky_relu":
        return nn.LeakyReLU(draw(st.sampled_from([0.01, 0.2, 1.5, 0.0, -0.3])))
    if kind == "elu":
        return nn.ELU(draw(st.sampled_from([1.0, 0.5, 2.0])))
    if kind == "gelu":
        return nn.GELU()
    if kind == "gelu_tanh":
        return nn.GELU(approximate="tanh")
    if kind == "silu":
        return nn.SiLU()
    if kind == "sigmoid":
        return nn.Sigmoid()
    if kind == "tanh":
        return nn.Tanh()
    if kind == "hardswish":
        return nn.Hardswish()
    if kind == "identity":
        return nn.Identity()
    if kind == "dropout":
        return nn.Dropout(draw(st.sampled_from([0.0, 0.3, 0.5]))).eval()
    if kind == "dropout2d":
        return nn.Dropout2d(0.4).eval()
    if kind == "batch_norm":
        return nn.BatchNorm2d(channels, eps=draw(st.sampled_from([1e-5, 1e-3, 0.1]))).eval()
    if kind == "batch_norm_plain":
        return nn.BatchNorm2d(channels, affine=False).eval()
    raise AssertionError(kind)


@st.composite
def layer(draw, kind: str, channels: int) -> nn.Module:
    if kind == "conv":
        return draw(conv(channels))
    if kind == "max_pool":
        return draw(max_pool())
    if kind == "avg_pool":
        return draw(avg_pool())
    return draw(pointwise(kind, channels))


@st.composite
def stacks(draw, min_layers: int = 1, max_layers: int = 6) -> tuple[nn.Sequential, int]:
    """A random valid stack (eval mode) and its input channel count; sometimes with nested Sequentials."""
    in_channels = channels = draw(st.integers(1, 3))
    kinds = draw(st.lists(st.sampled_from(KINDS), min_size=min_layers, max_size=max_layers))
    layers = []
    for kind in kinds:
        if len(layers) == max_layers:
            break
        module = draw(layer(kind, channels))
        if isinstance(module, nn.Conv2d):
            channels = module.out_channels
        layers.append(module)
        if isinstance(module, FRESH_OUTPUT) and len(layers) < max_layers and draw(st.integers(0, 3)) == 0:
            layers.append(IN_PLACE[draw(st.sampled_from(sorted(IN_PLACE)))]())
    if len(layers) >= 2 and draw(st.booleans()):
        first = draw(st.integers(0, len(layers) - 1))
        stop = draw(st.integers(first + 1, len(layers)))
        layers[first:stop] = [nn.Sequential(*layers[first:stop])]
    return nn.Sequential(*layers).eval(), in_channels
