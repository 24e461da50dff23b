"""Unit tests of the 1-D region math: Interval, Window, split, and every op's halo rule.

The rule tests trace a one-op model, ask its rule (``tilec.ops.rule(node).need``) what an output
interval needs of the input, and compare with what the output really depends on: the input gradient of a sum
over that output interval is non-zero exactly on the dependence set (weights are positive, so
nothing cancels). The rule's interval, clipped to the input, must be the hull of that set.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from tilec.graph import Graph
from tilec.ir import NodeSpec
from tilec.ops import rule
from tilec.ops.window import conv_padding, window_args
from tilec.regions import Interval, Period, Window, partition, parts_of, split, strides_of
from tilec.trace import trace

from support.models import Lambda

FAST = settings(max_examples=60, deadline=None, derandomize=True)


# --- Interval ---------------------------------------------------------------------------------


def test_interval_basics():
    a = Interval(2, 7)
    assert a.length == 5
    assert Interval(4, 4).length == 0
    assert a.hull(Interval(5, 11)) == Interval(2, 11)
    assert a.hull(Interval(-3, 0)) == Interval(-3, 7)
    assert a.hull(Interval(3, 4)) == a
    assert a.shift(3) == Interval(5, 10)
    assert a.shift(-2) == Interval(0, 5)
    assert tuple(a) == (2, 7)


@pytest.mark.parametrize(
    ("interval", "size", "expected"),
    [
        ((0, 5), 5, ((0, 5), 0, 0)),  # exactly the input
        ((1, 3), 5, ((1, 3), 0, 0)),  # interior
        ((-2, 3), 5, ((0, 3), 2, 0)),  # runs into the leading padding
        ((3, 8), 5, ((3, 5), 0, 3)),  # runs into the trailing padding (e.g. ceil_mode)
        ((-1, 7), 5, ((0, 5), 1, 2)),  # both sides
        ((-3, 0), 5, ((0, 0), 3, 0)),  # wholly in the leading padding
        ((-3, -1), 5, ((0, 0), 2, 0)),  # wholly before, not touching 0
        ((5, 7), 5, ((5, 5), 0, 2)),  # wholly in the trailing padding
        ((6, 7), 5, ((5, 5), 0, 1)),  # wholly after, not touching the end
        ((2, 2), 5, ((2, 2), 0, 0)),  # empty stays empty
    ],
)
def test_interval_clip(interval, size, expected):
    clipped, before, after = Interval(*interval).clip(size)
    assert (tuple(clipped), before, after) == expected


@FAST
@given(st.integers(-20, 40), st.integers(0, 20), st.integers(1, 30))
def test_interval_clip_properties(start, length, size):
    interval = Interval(start, start + length)
    clipped, before, after = interval.clip(size)
    assert 0 <= clipped.start <= clipped.stop <= size
    assert before >= 0 and after >= 0
    assert before + clipped.length + after == interval.length
    inside = set(range(interval.start, interval.stop)) & set(range(size))
    assert set(range(clipped.start, clipped.stop)) == inside
    assert before == len([i for i in range(interval.start, interval.stop) if i < 0])
    assert after == len([i for i in range(interval.start, interval.stop) if i >= size])


# --- split ------------------------------------------------------------------------------------


def test_split_examples():
    assert split(7, 1) == (Interval(0, 7),)
    assert split(7, 3) == (Interval(0, 3), Interval(3, 6), Interval(6, 7))
    assert split(8, 4) == (Interval(0, 2), Interval(2, 4), Interval(4, 6), Interval(6, 8))
    assert split(5, 5) == tuple(Interval(i, i + 1) for i in range(5))
    assert split(256, 11)[1:-1] == tuple(Interval(24 * i, 24 * i + 24) for i in range(1, 10))
    assert split(256, 11)[-1] == Interval(240, 256)
    # ceil(10 / 6) = 2 would leave the sixth part empty: lengths differing by one instead
    assert split(10, 6) == (Interval(0, 2), Interval(2, 4), Interval(4, 6), Interval(6, 8), Interval(8, 9),
                            Interval(9, 10))


@FAST
@given(st.integers(1, 500), st.data())
def test_split_partitions(size, data):
    parts = data.draw(st.integers(1, size))
    pieces = split(size, parts)
    assert len(pieces) == parts
    assert pieces[0].start == 0 and pieces[-1].stop == size
    assert all(a.stop == b.start for a, b in zip(pieces[:-1], pieces[1:], strict=True))
    lengths = [p.length for p in pieces]
    assert min(lengths) >= 1 and max(lengths) == -(-size // parts)  # no tile longer than it must be
    uniform = len(set(lengths[:-1])) <= 1
    balanced = max(lengths) - min(lengths) <= 1 and lengths == sorted(lengths, reverse=True)
    assert uniform or balanced
    if (parts - 1) * -(-size // parts) < size:
        assert uniform  # every interior tile one shape wherever the last part can take the rest


def test_a_period_tiles_every_stride_of_an_input_alike():
    """A 10,000-pixel side in tiles of 640 pixels: at strides 1 to 32 (sizes 10,000 to 313) every
    tensor has 16 tiles of 640 / stride, the last taking the rest; at stride 3 (640 not a multiple)
    and a size no stride gives, none."""
    period = Period.of(10_000, 32, 16)
    assert period == Period(640, 10_000) and period.parts == 16
    for stride in (1, 2, 4, 8, 16, 32):
        size = -(-10_000 // stride)
        pieces = partition(size, period)
        assert len(pieces) == 16 and pieces[-1].stop == size
        assert pieces[:-1] == tuple(Interval(k * 640 // stride, (k + 1) * 640 // stride) for k in range(15))
    assert period.length(3334) is None and strides_of(3334, 10_000, 10_000) == range(3, 4)
    assert period.length(4000) is None and not strides_of(4000, 10_000, 10_000)
    assert Period(4, 3).length(1) == 1  # stride 4 gives 1 pixel of 3, as 3 does
    with pytest.raises(ValueError, match="not tiled by"):
        partition(4000, period)
    assert partition(7, 3) == split(7, 3) and parts_of(3) == 3


@FAST
@given(st.integers(1, 5000), st.integers(0, 6), st.integers(0, 6), st.integers(1, 64))
def test_one_period_partitions_every_stride_into_as_many_tiles(full, quantum_log, stride_log, tiles):
    """Tile ``k`` of the input at every stride dividing the period covers input pixels
    ``[k * pixels, (k + 1) * pixels)``, and every such tensor has ``ceil(full / pixels)`` tiles."""
    quantum, stride = 1 << quantum_log, 1 << min(stride_log, quantum_log)
    period = Period.of(full, quantum, tiles)
    size = -(-full // stride)
    pieces = partition(size, period)
    assert len(pieces) == period.parts <= tiles and pieces[0].start == 0 and pieces[-1].stop == size
    assert all(a.stop == b.start for a, b in zip(pieces, pieces[1:], strict=False))
    assert all(piece.length * stride == period.pixels for piece in pieces[:-1])
    assert 1 <= pieces[-1].length <= period.pixels // stride


# --- Window -----------------------------------------------------------------------------------


def test_window_defaults_are_pointwise():
    w = Window()
    assert w.span == 1
    assert w.output_size(9) == 9
    assert w.input_interval(Interval(3, 6)) == Interval(3, 6)


def test_window_examples():
    conv = Window(kernel=3, stride=1, pad_before=1, pad_after=1)
    assert conv.span == 3 and conv.output_size(10) == 10
    assert conv.input_interval(Interval(0, 5)) == Interval(-1, 6)
    assert conv.input_interval(Interval(5, 10)) == Interval(4, 11)

    dilated = Window(kernel=3, dilation=2, stride=2, pad_before=2, pad_after=2)
    assert dilated.span == 5
    assert dilated.output_size(11) == 6  # (11 + 4 - 5) // 2 + 1
    assert dilated.input_interval(Interval(1, 3)) == Interval(0, 7)

    pool = Window(kernel=2, stride=2)
    assert pool.output_size(7) == 3
    assert Window(kernel=2, stride=2, ceil_mode=True).output_size(7) == 4
    # ceil_mode: a window that would start in the trailing padding is dropped
    assert Window(kernel=2, stride=2, pad_before=1, pad_after=1, ceil_mode=True).output_size(5) == 3
    assert Window(kernel=3, stride=2, pad_before=1, pad_after=1, ceil_mode=True).output_size(4) == 3

    assert Window(kernel=5).output_size(4) == 0  # too small: nothing, never negative


def _reads(window: Window, o: int) -> list[int]:
    return [o * window.stride - window.pad_before + j * window.dilation for j in range(window.kernel)]


windows = st.builds(
    Window,
    kernel=st.integers(1, 6),
    stride=st.integers(1, 4),
    dilation=st.integers(1, 3),
    pad_before=st.integers(0, 4),
    pad_after=st.integers(0, 4),
    ceil_mode=st.booleans(),
)


@FAST
@given(windows, st.integers(0, 30), st.integers(1, 10))
def test_input_interval_is_hull_of_reads(window, start, length):
    out = Interval(start, start + length)
    reads = [i for o in range(out.start, out.stop) for i in _reads(window, o)]
    assert window.input_interval(out) == Interval(min(reads), max(reads) + 1)
    assert window.span == max(_reads(window, 0)) - min(_reads(window, 0)) + 1


@FAST
@given(windows, st.integers(1, 40), st.data())
def test_input_interval_composes_over_a_partition(window, size, data):
    """The reads of a union of owned tiles are the hull of each tile's reads."""
    out_size = window.output_size(size)
    if out_size < 1:
        return
    parts = data.draw(st.integers(1, out_size))
    pieces = split(out_size, parts)
    whole = window.input_interval(Interval(0, out_size))
    hull = pieces[0]
    for piece in pieces:
        hull = hull.hull(piece)
    assert window.input_interval(hull) == whole
    # every tile reads inside the input plus the layer's own padding, ceil_mode aside
    for piece in pieces:
        read = window.input_interval(piece)
        assert read.start >= -window.pad_before
        if not window.ceil_mode:
            assert read.stop <= size + window.pad_after


@FAST
@given(windows, st.integers(1, 40), st.booleans())
def test_avg_divisors_match_pytorch(window, size, include):
    window = Window(window.kernel, window.stride, 1, window.kernel // 2, window.kernel // 2, window.ceil_mode)
    out_size = window.output_size(size)
    pool = nn.AvgPool2d((1, window.kernel), (1, window.stride), (0, window.pad_before),
                        ceil_mode=window.ceil_mode, count_include_pad=include)
    ones = torch.ones(1, 1, 1, size, dtype=torch.float64)
    got = pool(ones)[0, 0, 0]
    assert got.shape[0] == out_size
    divisors = window.avg_divisors(Interval(0, out_size), size, include)
    reals = []
    for o in range(out_size):
        start = o * window.stride - window.pad_before
        reals.append(min(start + window.kernel, size) - max(start, 0))
    expected = torch.tensor(reals, dtype=torch.float64) / torch.tensor(divisors, dtype=torch.float64)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)


def test_window_read_of_an_empty_output_reads_nothing():
    window = Window(kernel=3, stride=2, pad_before=1, pad_after=1)
    assert window.read(Interval(4, 4), 9) == (Interval(7, 7), 0, 0)
    assert window.read(Interval(0, 2), 9) == (Interval(0, 4), 1, 0)
    assert window.read(Interval(3, 5), 9) == (Interval(5, 9), 0, 1)


# --- traced one-op models -----------------------------------------------------------------------


def _traced(module: nn.Module, shape) -> tuple[NodeSpec, Graph]:
    """The one non-pointwise node of ``module`` traced on ``shape``, and the graph (the rules' shapes)."""
    graph = trace(module, shape)
    (node,) = [n for n in graph if not rule(n).pixel]
    return node, graph


def _windows(module: nn.Module) -> tuple[Window, Window]:
    """Per-axis windows of a conv / pooling module, from its traced node (as the planner sees it)."""
    node, graph = _traced(module, (1, getattr(module, "in_channels", 1), 40, 40))
    if node.op == "conv2d":
        weight = graph.tensor_shapes[node.args[1].value]
        args, pads = window_args(node, weight), conv_padding(node, weight)
        return tuple(Window(args.kernel[a], args.stride[a], args.dilation[a], *pads[a]) for a in (0, 1))
    args = window_args(node)
    return args.axis(0), args.axis(1)


# --- output_size against PyTorch --------------------------------------------------------------


def _check_shape(module: nn.Module, height: int, width: int) -> None:
    rows, cols = _windows(module)
    want = (rows.output_size(height), cols.output_size(width))
    x = torch.zeros(1, getattr(module, "in_channels", 1), height, width)
    try:
        with torch.no_grad():
            y = module(x)
    except RuntimeError:
        assert min(want) < 1, f"PyTorch refuses {module} on {height}x{width}, tilec predicts {want}"
        return
    assert tuple(y.shape[2:]) == want, f"{module} on {height}x{width}"


pairs = st.tuples(st.integers(1, 5), st.integers(1, 5))
sizes = st.integers(1, 30)
SHAPES = settings(max_examples=60, deadline=None, derandomize=True)


@SHAPES
@given(
    kernel=st.one_of(st.integers(1, 5), pairs),
    stride=st.one_of(st.integers(1, 4), st.tuples(st.integers(1, 4), st.integers(1, 4))),
    dilation=st.one_of(st.integers(1, 3), st.tuples(st.integers(1, 3), st.integers(1, 3))),
    padding=st.one_of(st.integers(0, 4), st.tuples(st.integers(0, 4), st.integers(0, 4))),
    height=sizes,
    width=sizes,
)
def test_conv_output_size_matches_pytorch(kernel, stride, dilation, padding, height, width):
    _check_shape(nn.Conv2d(1, 1, kernel, stride=stride, padding=padding, dilation=dilation), height, width)


@st.composite
def pool_args(draw):
    kernel = draw(st.one_of(st.integers(1, 5), pairs))
    kh, kw = (kernel, kernel) if isinstance(kernel, int) else kernel
    padding = draw(st.one_of(st.integers(0, min(kh, kw) // 2),
                             st.tuples(st.integers(0, kh // 2), st.integers(0, kw // 2))))
    stride = draw(st.one_of(st.none(), st.integers(1, 4), st.tuples(st.integers(1, 4), st.integers(1, 4))))
    return kernel, stride, padding, draw(st.booleans())


@SHAPES
@given(pool_args(), st.one_of(st.integers(1, 3), st.tuples(st.integers(1, 3), st.integers(1, 3))), sizes, sizes)
def test_max_pool_output_size_matches_pytorch(args, dilation, height, width):
    kernel, stride, padding, ceil_mode = args
    module = nn.MaxPool2d(kernel, stride=stride, padding=padding, dilation=dilation, ceil_mode=ceil_mode)
    _check_shape(module, height, width)


@SHAPES
@given(pool_args(), st.booleans(), sizes, sizes)
def test_avg_pool_output_size_matches_pytorch(args, include, height, width):
    kernel, stride, padding, ceil_mode = args
    module = nn.AvgPool2d(kernel, stride=stride, padding=padding, ceil_mode=ceil_mode, count_include_pad=include)
    _check_shape(module, height, width)


@pytest.mark.filterwarnings("ignore:Using padding='same'")
@pytest.mark.parametrize(
    ("kernel", "dilation", "expected"),
    [(4, 1, (1, 2)), (2, 3, (1, 2)), (3, 2, (2, 2)), ((4, 1), (1, 1), (1, 2)), (5, 1, (2, 2))],
)
def test_same_padding_split(kernel, dilation, expected):
    """'same' puts the smaller half of the padding before, as PyTorch does."""
    node, graph = _traced(nn.Conv2d(1, 1, kernel, padding="same", dilation=dilation), (1, 1, 20, 20))
    rows, _ = conv_padding(node, graph.tensor_shapes[node.args[1].value])
    assert rows == expected


@pytest.mark.filterwarnings("ignore:Using padding='same'")
@pytest.mark.parametrize("padding", ["same", "valid"])
def test_window_args_of_string_padding(padding):
    node, graph = _traced(nn.Conv2d(1, 1, 3, padding=padding), (1, 1, 9, 9))
    args = window_args(node, graph.tensor_shapes[node.args[1].value])
    assert args.kernel == (3, 3) and args.stride == (1, 1)


@pytest.mark.filterwarnings("ignore:Using padding='same'")
def test_same_padding_even_kernel_matches_pytorch_values():
    """Asymmetric 'same' padding: an explicit pad with tilec's split reproduces PyTorch's output."""
    torch.manual_seed(0)
    conv = nn.Conv2d(2, 3, (4, 2), padding="same", dilation=(1, 3)).double()
    node, graph = _traced(conv, (1, 2, 20, 20))
    rows, cols = conv_padding(node, graph.tensor_shapes[node.args[1].value])
    x = torch.randn(1, 2, 9, 8, dtype=torch.float64)
    padded = nn.functional.pad(x, (*cols, *rows))
    expected = nn.functional.conv2d(padded, conv.weight, conv.bias, dilation=conv.dilation)
    torch.testing.assert_close(conv(x), expected, rtol=0, atol=1e-12)


# --- every rule against autograd dependence ---------------------------------------------------


def _positive(module: nn.Module) -> nn.Module:
    """Float64, with strictly positive weights: input gradients of output sums never cancel."""
    module = module.double()
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.copy_(torch.rand(parameter.shape, dtype=torch.float64) + 0.1)
    return module


def _intervals(size: int, rng: random.Random, count: int = 12) -> list[Interval]:
    """Every single index, the whole axis, and ``count`` random intervals of ``[0, size)``."""
    found = {Interval(o, o + 1) for o in range(size)} | {Interval(0, size)}
    for _ in range(count):
        start = rng.randrange(size)
        found.add(Interval(start, rng.randrange(start + 1, size + 1)))
    return sorted(found)


def _dependence(y: torch.Tensor, x: torch.Tensor, axis: int, out: Interval) -> set[int]:
    """Input indices on ``axis`` whose gradient of ``sum(y[out])`` (all of the other axis) is non-zero."""
    index = [slice(None)] * 4
    index[2 + axis] = slice(out.start, out.stop)
    (grad,) = torch.autograd.grad(y[tuple(index)].sum(), x, retain_graph=True)
    per_index = grad.abs().sum(dim=[d for d in range(4) if d != 2 + axis])
    return {int(i) for i in torch.nonzero(per_index).flatten()}


def check_rule(module: nn.Module, shape, *, pads: bool, seed: int = 0, slack: int = 0,
               loose: tuple[int, ...] = (), front: Callable[[int, Interval], int] | None = None) -> None:
    """For every single output and random output intervals, the rule's input interval clipped to
    the input is the hull of what the output depends on. ``slack``: it may read that many more at
    its end; on ``loose`` axes it need only contain that hull. ``front(axis, out)``: the rule
    starts at or before this input (and reads it alone when the outputs depend on nothing)."""
    node, graph = _traced(module, shape)
    op = rule(node)
    module = _positive(module)
    x = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    y = module(x)
    assert tuple(y.shape) == tuple(node.shape)
    rng = random.Random(seed)
    for axis in (0, 1):
        in_size = shape[2 + axis]
        for out in _intervals(y.shape[2 + axis], rng):
            (need,) = op.need(node, axis, out, graph)
            assert need.input == node.inputs[0] and need.pads is pads
            clipped, _, _ = need.interval.clip(in_size)
            depends = _dependence(y, x, axis, out)
            where = f"{node.target} {[a.value for a in node.args[1:]]}, axis {axis}, output {tuple(out)}"
            first = None if front is None else front(axis, out)
            if not depends:
                wanted = Interval(0, 0) if first is None else Interval(first, first + 1)
                assert axis in loose or clipped.length == wanted.length and (not wanted.length or clipped == wanted), (
                    f"{where}: rule reads {tuple(clipped)}, the output depends on nothing")
                continue
            hull = Interval(min(depends), max(depends) + 1)
            if first is not None:
                hull = Interval(min(hull.start, first), hull.stop)
            assert clipped.start <= hull.start and hull.stop <= clipped.stop, (
                f"{where}: rule reads {tuple(clipped)} (unclipped {tuple(need.interval)}), "
                f"but the output depends on {tuple(hull)}: tiles would miss inputs"
            )
            if axis in loose:
                continue
            assert clipped.start == hull.start and clipped.stop <= hull.stop + slack, (
                f"{where}: rule reads {tuple(clipped)} (unclipped {tuple(need.interval)}), "
                f"the output depends on {tuple(hull)}"
            )


TRANSPOSED = [
    # kernel, stride, padding, output_padding, dilation
    (3, 2, 1, 1, 1),
    (2, 2, 0, 0, 1),
    (4, 2, 1, 0, 1),
    (3, 3, 0, 2, 1),
    (1, 3, 0, 0, 1),  # outputs between the strides depend on nothing
    (2, 3, 0, 1, 1),
    (3, 1, 1, 0, 1),
    (3, 2, 2, 1, 2),
    (5, 3, 4, 2, 2),
    (3, 2, 4, 0, 1),  # padding beyond the kernel
    ((3, 2), (2, 3), (1, 0), (1, 2), (1, 2)),
]


@pytest.mark.parametrize(("kernel", "stride", "padding", "output_padding", "dilation"), TRANSPOSED)
@pytest.mark.parametrize("size", [(7, 9), (10, 5)])
def test_conv_transpose_rule(kernel, stride, padding, output_padding, dilation, size):
    module = nn.ConvTranspose2d(2, 3, kernel, stride=stride, padding=padding, output_padding=output_padding,
                                dilation=dilation)
    check_rule(module, (1, 2, *size), pads=False, loose=_dilated(module), front=_covering(module, size))


def _covering(module: nn.ConvTranspose2d, size) -> Callable[[int, Interval], int]:
    """The input a tile's local transposed convolution must start from: the last whose outputs
    begin at or before the tile's first output (the local convolution crops, never pads in
    front), and a real one (outputs past the last tap still need an input to run on)."""
    def first(axis: int, out: Interval) -> int:
        covering = (out.start + module.padding[axis]) // module.stride[axis]
        return min(covering, size[axis] - 1)
    return first


def _dilated(module: nn.Module) -> tuple[int, ...]:
    """Axes where a (transposed) conv rule is the hull over all kernel taps and so may over-read:
    with dilation above 1 an output's taps can skip the inputs at the edge of that hull, or (with
    a stride) reach no input at all (see the xfail below)."""
    return tuple(a for a in (0, 1) if module.dilation[a] > 1)


@pytest.mark.xfail(strict=True, reason="tilec.ops.transpose.transpose_interval over-reads when stride > 1 and "
                                       "dilation > 1: it takes the hull over all taps, also for outputs no tap "
                                       "reaches (harmless for exactness, costs extra reads)")
def test_conv_transpose_rule_is_tight_when_strided_and_dilated():
    module = nn.ConvTranspose2d(1, 1, 3, stride=2, padding=2, output_padding=1, dilation=2)
    check_rule(module, (1, 1, 7, 9), pads=False, front=_covering(module, (7, 9)))


@settings(max_examples=30, deadline=None, derandomize=True)
@given(kernel=st.integers(1, 5), stride=st.integers(1, 4), padding=st.integers(0, 5), dilation=st.integers(1, 3),
       data=st.data(), height=st.integers(1, 7), width=st.integers(1, 7))
def test_conv_transpose_rule_random(kernel, stride, padding, dilation, data, height, width):
    output_padding = data.draw(st.integers(0, max(stride, dilation) - 1))
    module = nn.ConvTranspose2d(1, 1, kernel, stride=stride, padding=padding, output_padding=output_padding,
                                dilation=dilation)
    try:
        module(torch.zeros(1, 1, height, width))
    except RuntimeError:
        return  # the output would be empty: PyTorch refuses too
    check_rule(module, (1, 1, height, width), pads=False, loose=_dilated(module),
               front=_covering(module, (height, width)))


def _interpolate(**options) -> nn.Module:
    return Lambda(lambda x: F.interpolate(x, **options))


UPSAMPLING = [
    {"scale_factor": 2},
    {"scale_factor": 3},
    {"scale_factor": 1.7},
    {"scale_factor": 2.5},
    {"scale_factor": (1.7, 2.5)},
    {"scale_factor": 0.6},
    {"size": (17, 23)},
    {"size": (5, 11)},
]
MODES = [
    ("nearest", {}),
    ("nearest-exact", {}),
    ("bilinear", {"align_corners": False}),
    ("bilinear", {"align_corners": True}),
    ("bicubic", {"align_corners": False}),
    ("bicubic", {"align_corners": True}),
]


@pytest.mark.parametrize(("mode", "extra"), MODES, ids=["nearest", "nearest_exact", "bilinear", "bilinear_corners",
                                                        "bicubic", "bicubic_corners"])
@pytest.mark.parametrize("options", UPSAMPLING, ids=lambda o: "_".join(f"{k}={v}" for k, v in o.items()))
def test_upsample_rule(mode, extra, options):
    # a bilinear output whose upper weight is exactly 0 still names the upper input: one more read
    check_rule(_interpolate(mode=mode, **extra, **options), (1, 2, 9, 7), pads=False,
               slack=1 if mode == "bilinear" else 0)


@pytest.mark.parametrize(
    "pad",
    [(1, 1, 1, 1), (0, 2, 3, 0), (2, -1, -2, 3), (-1, -2, -3, -1), (4, 0, 0, 5), (1, 2), (-2, 1)],
)
def test_constant_pad_rule(pad):
    check_rule(Lambda(lambda x: F.pad(x, pad, value=0.5)), (1, 2, 9, 8), pads=True)


@pytest.mark.parametrize("crop", [slice(2, -3), slice(None, 5), slice(3, 7), slice(-4, None), slice(1, 100)],
                         ids=["both_ends", "head", "middle", "negative_start", "past_the_end"])
@pytest.mark.parametrize("dim", [2, 3])
def test_slice_rule(crop, dim):
    index = (slice(None),) * dim + (crop,)
    check_rule(Lambda(lambda x: x[index]), (1, 2, 9, 8), pads=False)


@pytest.mark.parametrize(
    "module",
    [
        nn.Conv2d(2, 3, 3, padding=1),
        nn.Conv2d(2, 2, (3, 2), stride=(2, 3), padding=(2, 1), dilation=(2, 3), groups=2),
        nn.Conv2d(2, 1, 1, padding=2),  # border outputs read only padding
        nn.AvgPool2d(3, stride=2, padding=1, ceil_mode=True),
        nn.AvgPool2d((2, 3), stride=(3, 2), ceil_mode=True, count_include_pad=False),
    ],
    ids=["conv", "conv_strided_dilated_grouped", "conv_padding_only", "avg_pool_ceil",
         "avg_pool_rect"],
)
def test_window_rule(module):
    check_rule(module, (1, 2, 11, 9), pads=True, loose=_dilated(module) if isinstance(module, nn.Conv2d) else ())
