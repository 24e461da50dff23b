"""``ChannelMoments``, the partial of BatchNorm (per channel) and of group, instance and layer norm
(per sample and channel group) on channels-last CPU tensors, against ``var_mean`` in float64: mean,
M2 and the input gradient, on whole tensors and on regions of them, with one block per sample or
several (``BLOCK``), and where it does not apply."""

import pytest
import torch

from tilec.runtime.reduce import BLOCK, ChannelMoments, grouped, partial_moments

SHAPES = [
    (1, 3, 7, 5),
    (3, 5, 17, 13),
    (2, 3, 1000, 100),  # several blocks per sample
    (1, 2, 3, BLOCK // 2 + 1),  # a row larger than a block
]


def _reference(x, dims=(0, 2, 3)):
    var, mean = torch.var_mean(x, dims, correction=0, keepdim=True)
    return mean, var * (x.numel() // mean.numel())


def _image(shape, region, generator):
    full = (torch.randn(shape, dtype=torch.float64, generator=generator) * 2 + 3).contiguous(
        memory_format=torch.channels_last)
    x = full[:, :, 1:, : max(1, shape[3] - 2)] if region else full
    return x.detach().requires_grad_()


def _check(x, got, want, generator):
    """``got`` and ``want`` (mean, M2) equal, and so are the input gradients they give."""
    for a, b in zip(got, want, strict=True):
        assert torch.allclose(a, b, rtol=1e-12, atol=0)
    grads = [torch.randn(got[0].shape, dtype=torch.float64, generator=generator) for _ in got]
    found = [torch.autograd.grad(sum((t * g).sum() for t, g in zip(pair, grads, strict=True)), x)[0]
             for pair in (got, want)]
    assert (found[0] - found[1]).abs().max().item() <= 1e-10


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("region", [False, True])
def test_channel_moments_equal_var_mean_in_float64(shape, region):
    generator = torch.Generator().manual_seed(0)
    x = _image(shape, region, generator)
    assert ChannelMoments.layout(x, (0, 2, 3)) is not None
    count, mean, m2 = partial_moments(x, (0, 2, 3))
    assert count == x.numel() // x.shape[1]
    _check(x, (mean, m2), _reference(x), generator)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("region", [False, True])
@pytest.mark.parametrize("groups", ["one", "some", "each"])
def test_grouped_channel_moments_equal_var_mean_in_float64(shape, region, groups):
    """Per sample and group: one group (layer norm), a group of channels each (instance norm), or
    a few channels per group (group norm, where the channels divide)."""
    generator = torch.Generator().manual_seed(1)
    x = _image(shape, region, generator)
    count = {"one": 1, "each": shape[1], "some": shape[1] // 2 if shape[1] % 2 == 0 else 1}[groups]
    view = grouped(x, count)
    assert ChannelMoments.layout(view, (2, 3, 4)) is not None
    found, mean, m2 = partial_moments(view, (2, 3, 4))
    assert mean.shape == (shape[0], count, 1, 1, 1)
    assert found == x.numel() // shape[0] // count
    _check(x, (mean, m2), _reference(view, (2, 3, 4)), generator)


@pytest.mark.parametrize("which", [1, 2])
def test_channel_moments_back_propagate_one_output_alone(which):
    x = torch.randn(2, 4, 6, 5, dtype=torch.float64).contiguous(memory_format=torch.channels_last).requires_grad_()
    for view, dims in ((x, (0, 2, 3)), (grouped(x, 2), (2, 3, 4))):
        got = partial_moments(view, dims)[which]
        want = _reference(view, dims)[which - 1]
        assert torch.allclose(torch.autograd.grad(got.sum(), x)[0], torch.autograd.grad(want.sum(), x)[0],
                              rtol=0, atol=1e-12)


def test_channel_moments_apply_only_where_channels_are_innermost():
    x = torch.randn(2, 4, 6, 5)
    assert ChannelMoments.layout(x, (0, 2, 3)) is None  # contiguous: channels are not innermost
    assert ChannelMoments.layout(grouped(x, 2), (2, 3, 4)) is None
    last = x.contiguous(memory_format=torch.channels_last)
    assert ChannelMoments.layout(last, (0, 2, 3)) is not None
    assert ChannelMoments.layout(grouped(last, 2), (2, 3, 4)) is not None
    assert ChannelMoments.layout(last, (2, 3)) is None  # per sample, ungrouped: left to var_mean
    assert ChannelMoments.layout(grouped(last, 2), (3, 4)) is None  # per channel within a group
    assert ChannelMoments.layout(last.half(), (0, 2, 3)) is None
    assert ChannelMoments.layout(last[:, :, :0], (0, 2, 3)) is None
