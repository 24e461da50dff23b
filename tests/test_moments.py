"""``ChannelMoments``, BatchNorm's partial on channels-last CPU tensors, against ``var_mean`` in
float64: mean, M2 and the input gradient, on whole tensors and on regions of them, with one block
per sample or several (``BLOCK``), and where it does not apply."""

import pytest
import torch

from tilec.runtime.reduce import BLOCK, ChannelMoments, partial_moments

SHAPES = [
    (1, 3, 7, 5),
    (3, 5, 17, 13),
    (2, 3, 1000, 100),  # several blocks per sample
    (1, 2, 3, BLOCK // 2 + 1),  # a row larger than a block
]


def _reference(x):
    var, mean = torch.var_mean(x, (0, 2, 3), correction=0, keepdim=True)
    return mean, var * (x.numel() // x.shape[1])


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("region", [False, True])
def test_channel_moments_equal_var_mean_in_float64(shape, region):
    generator = torch.Generator().manual_seed(0)
    full = (torch.randn(shape, dtype=torch.float64, generator=generator) * 2 + 3).contiguous(
        memory_format=torch.channels_last)
    x = full[:, :, 1:, : max(1, shape[3] - 2)] if region else full
    x = x.detach().requires_grad_()
    assert ChannelMoments.applies(x, (0, 2, 3))
    count, mean, m2 = partial_moments(x, (0, 2, 3))
    want_mean, want_m2 = _reference(x)
    assert torch.equal(count, torch.full_like(mean, x.numel() // x.shape[1]))
    assert torch.allclose(mean, want_mean, rtol=1e-13, atol=0)
    assert torch.allclose(m2, want_m2, rtol=1e-12, atol=0)
    grads = torch.randn(mean.shape, dtype=torch.float64, generator=generator), torch.randn(
        m2.shape, dtype=torch.float64, generator=generator)
    got = torch.autograd.grad((mean * grads[0]).sum() + (m2 * grads[1]).sum(), x)[0]
    want = torch.autograd.grad((want_mean * grads[0]).sum() + (want_m2 * grads[1]).sum(), x)[0]
    assert (got - want).abs().max().item() <= 1e-10


@pytest.mark.parametrize("which", [1, 2])
def test_channel_moments_back_propagate_one_output_alone(which):
    x = torch.randn(2, 4, 6, 5, dtype=torch.float64).contiguous(memory_format=torch.channels_last).requires_grad_()
    got = partial_moments(x, (0, 2, 3))[which]
    want = _reference(x)[which - 1]
    assert torch.allclose(torch.autograd.grad(got.sum(), x)[0], torch.autograd.grad(want.sum(), x)[0],
                          rtol=0, atol=1e-12)


def test_channel_moments_apply_only_to_channels_innermost_batch_statistics():
    x = torch.randn(2, 4, 6, 5)
    assert not ChannelMoments.applies(x, (0, 2, 3))  # contiguous: channels are not innermost
    last = x.contiguous(memory_format=torch.channels_last)
    assert ChannelMoments.applies(last, (0, 2, 3))
    assert not ChannelMoments.applies(last, (2, 3))  # per sample: instance norm
    assert not ChannelMoments.applies(last.half(), (0, 2, 3))
    assert not ChannelMoments.applies(last[:, :, :0], (0, 2, 3))
