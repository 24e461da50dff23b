"""Unit tests of the 1-D region math: Interval, Window (shape and halo rules) and split."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from tilec.layers import lookup
from tilec.regions import Interval, Window, split

FAST = settings(max_examples=60, deadline=None)


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
    assert split(7, 3) == (Interval(0, 3), Interval(3, 5), Interval(5, 7))
    assert split(8, 4) == (Interval(0, 2), Interval(2, 4), Interval(4, 6), Interval(6, 8))
    assert split(5, 5) == tuple(Interval(i, i + 1) for i in range(5))
    assert split(11, 4) == (Interval(0, 3), Interval(3, 6), Interval(6, 9), Interval(9, 11))


@FAST
@given(st.integers(1, 500), st.data())
def test_split_partitions(size, data):
    parts = data.draw(st.integers(1, size))
    pieces = split(size, parts)
    assert len(pieces) == parts
    assert pieces[0].start == 0 and pieces[-1].stop == size
    assert all(a.stop == b.start for a, b in zip(pieces[:-1], pieces[1:], strict=True))
    lengths = [p.length for p in pieces]
    assert min(lengths) >= 1 and max(lengths) - min(lengths) <= 1
    assert lengths == sorted(lengths, reverse=True)  # the longer ones come first
    assert lengths.count(size // parts + 1) == size % parts


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


# --- output_size against PyTorch --------------------------------------------------------------


def _windows(module: nn.Module) -> tuple[Window, Window]:
    _, semantics = lookup("0", module)
    return semantics.rows, semantics.cols


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


@settings(max_examples=150, deadline=None)
@given(
    kernel=st.one_of(st.integers(1, 5), pairs),
    stride=st.one_of(st.integers(1, 4), st.tuples(st.integers(1, 4), st.integers(1, 4))),
    dilation=st.one_of(st.integers(1, 3), st.tuples(st.integers(1, 3), st.integers(1, 3))),
    padding=st.one_of(st.integers(0, 4), st.tuples(st.integers(0, 4), st.integers(0, 4)),
                      st.sampled_from(["same", "valid"])),
    height=sizes,
    width=sizes,
)
def test_conv_output_size_matches_pytorch(kernel, stride, dilation, padding, height, width):
    if padding == "same":
        stride = 1
    _check_shape(nn.Conv2d(1, 1, kernel, stride=stride, padding=padding, dilation=dilation), height, width)


@st.composite
def pool_args(draw):
    kernel = draw(st.one_of(st.integers(1, 5), pairs))
    kh, kw = (kernel, kernel) if isinstance(kernel, int) else kernel
    padding = draw(st.one_of(st.integers(0, min(kh, kw) // 2),
                             st.tuples(st.integers(0, kh // 2), st.integers(0, kw // 2))))
    stride = draw(st.one_of(st.none(), st.integers(1, 4), st.tuples(st.integers(1, 4), st.integers(1, 4))))
    return kernel, stride, padding, draw(st.booleans())


@settings(max_examples=150, deadline=None)
@given(pool_args(), st.one_of(st.integers(1, 3), st.tuples(st.integers(1, 3), st.integers(1, 3))), sizes, sizes)
def test_max_pool_output_size_matches_pytorch(args, dilation, height, width):
    kernel, stride, padding, ceil_mode = args
    module = nn.MaxPool2d(kernel, stride=stride, padding=padding, dilation=dilation, ceil_mode=ceil_mode)
    _check_shape(module, height, width)


@settings(max_examples=150, deadline=None)
@given(pool_args(), st.booleans(), sizes, sizes)
def test_avg_pool_output_size_matches_pytorch(args, include, height, width):
    kernel, stride, padding, ceil_mode = args
    module = nn.AvgPool2d(kernel, stride=stride, padding=padding, ceil_mode=ceil_mode, count_include_pad=include)
    _check_shape(module, height, width)


@pytest.mark.parametrize(
    ("kernel", "dilation", "expected"),
    [(4, 1, (1, 2)), (2, 3, (1, 2)), (3, 2, (2, 2)), ((4, 1), (1, 1), (1, 2)), (5, 1, (2, 2))],
)
def test_same_padding_split(kernel, dilation, expected):
    """'same' puts the smaller half of the padding before, as PyTorch does."""
    rows, cols = _windows(nn.Conv2d(1, 1, kernel, padding="same", dilation=dilation))
    assert (rows.pad_before, rows.pad_after) == expected


def test_same_padding_even_kernel_matches_pytorch_values():
    """Asymmetric 'same' padding: an explicit pad with our split reproduces PyTorch's output."""
    torch.manual_seed(0)
    conv = nn.Conv2d(2, 3, (4, 2), padding="same", dilation=(1, 3)).double()
    rows, cols = _windows(conv)
    x = torch.randn(1, 2, 9, 8, dtype=torch.float64)
    padded = nn.functional.pad(x, (cols.pad_before, cols.pad_after, rows.pad_before, rows.pad_after))
    expected = nn.functional.conv2d(padded, conv.weight, conv.bias, dilation=conv.dilation)
    torch.testing.assert_close(conv(x), expected, rtol=0, atol=1e-12)
