"""The merges of reductions' partials (``tilec.runtime.reduce``), against untiled PyTorch.

The image is cut into horizontal bands, one partial each. Merged in order, the partials give the
untiled reduction; and a band's share of the merged partial's gradient (``shares_of``, in closed form)
equals its gradient through the merge of all the bands.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tilec.runtime.reduce import (
    Gradients,
    merged,
    partial_argmax,
    partial_logsumexp,
    partial_max,
    partial_moments,
    partial_sum,
    shares_of,
)

KINDS = ("sum", "moments", "max", "argmax", "logsumexp")


def partial(kind, band, row, width):
    if kind == "sum":
        return partial_sum(band, (2, 3))
    if kind == "moments":
        return partial_moments(band, (0, 2, 3))
    if kind == "max":
        return partial_max(band, (2, 3))
    if kind == "logsumexp":
        return partial_logsumexp(band, (2, 3))
    return partial_argmax(band, (row, 0), width)


def bands_of(image, cuts):
    """``image`` cut along its rows at ``cuts``, each band a leaf requiring grad, and their first rows."""
    edges = [0, *cuts, image.shape[2]]
    return [image[:, :, a:b].detach().clone().requires_grad_(True)
            for a, b in zip(edges, edges[1:], strict=False)], edges[:-1]


def gradients(kept, weights):
    """The merged partial ``kept``'s gradients ``weights`` (those of ``weighted(kept, weights)``), as
    the runtime hands them to every tile's share (what depends on a tile's count alone made once)."""
    return Gradients(w if isinstance(t, torch.Tensor) and t.is_floating_point() else None
                     for t, w in zip(kept, weights, strict=True))


def band_grads(kind, kept, parts, grads, bands):
    """The gradient of each of ``bands`` from its partial's (``parts``) share of the merged partial
    ``kept``'s gradients ``grads``, all shared in one go."""
    pairs = shares_of([(kind, kept, part, grads) for part in parts])
    got = torch.autograd.grad([a for a, _ in pairs], bands, [b for _, b in pairs], allow_unused=True) if pairs else [
        None] * len(bands)
    return [torch.zeros_like(band) if g is None else g for band, g in zip(bands, got, strict=True)]


def weighted(values, weights):
    """A scalar of the differentiable tensors of ``values``, each times its fixed weights (a count,
    a number, has none)."""
    return sum((t * w).sum() for t, w in zip(values, weights, strict=True) if w is not None and t.requires_grad)


@st.composite
def cases(draw):
    kind = draw(st.sampled_from(KINDS))
    rows = draw(st.integers(1, 9))
    cuts = sorted(draw(st.sets(st.integers(1, rows - 1), max_size=rows - 1))) if rows > 1 else []
    shape = (draw(st.integers(1, 2)), draw(st.integers(1, 3)), rows, draw(st.integers(1, 4)))
    seed = draw(st.integers(0, 2**16))
    ties = draw(st.booleans())  # few distinct values, and all-zero channels as after a ReLU
    generator = torch.Generator().manual_seed(seed)
    image = torch.randn(shape, dtype=torch.float64, generator=generator)
    if ties:
        image = image.round().clamp(min=0)
        image[:, 0] = 0
    return kind, image, cuts, seed


@settings(max_examples=150, deadline=None)
@given(cases())
def test_merged_partials_are_the_untiled_reduction(case):
    kind, image, cuts, _ = case
    bands, starts = bands_of(image, cuts)
    got = merged(kind, [partial(kind, band, row, image.shape[3]) for band, row in zip(bands, starts, strict=True)])
    if kind == "sum":
        torch.testing.assert_close(got[0], image.sum((2, 3), keepdim=True), rtol=1e-12, atol=1e-12)
    elif kind == "moments":
        var, mean = torch.var_mean(image, (0, 2, 3), correction=0, keepdim=True)
        count = image.numel() // image.shape[1]
        assert got[0] == count and isinstance(got[0], int)
        torch.testing.assert_close(got[1], mean, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got[2], var * count, rtol=1e-12, atol=1e-12)
    elif kind == "logsumexp":
        torch.testing.assert_close(got[0], torch.logsumexp(image, (2, 3), keepdim=True), rtol=1e-12, atol=1e-12)
    elif kind == "max":
        top = image.amax((2, 3), keepdim=True)
        assert torch.equal(got[0], top) and torch.equal(got[1], (image == top).sum((2, 3), keepdim=True).double())
    else:
        top, index = torch.nn.functional.adaptive_max_pool2d(image, 1, return_indices=True)
        assert torch.equal(got[0], top) and torch.equal(got[1], index)


@settings(max_examples=150, deadline=None)
@given(cases())
def test_a_bands_share_of_the_merged_gradient_is_its_gradient_through_all(case):
    kind, image, cuts, seed = case
    bands, starts = bands_of(image, cuts)
    width = image.shape[3]
    whole = merged(kind, [partial(kind, band, row, width) for band, row in zip(bands, starts, strict=True)])
    generator = torch.Generator().manual_seed(seed + 1)
    weights = [torch.randn(t.shape, dtype=torch.float64, generator=generator) if isinstance(t, torch.Tensor) else None
               for t in whole]
    want = torch.autograd.grad(weighted(whole, weights), bands)
    kept = tuple(t.detach() if isinstance(t, torch.Tensor) else t for t in whole)
    grads = gradients(kept, weights)  # bands of one height share what their count makes
    parts = [partial(kind, band, row, width) for band, row in zip(bands, starts, strict=True)]
    for got, grad in zip(band_grads(kind, kept, parts, grads, bands), want, strict=True):
        torch.testing.assert_close(got, grad, rtol=1e-10, atol=1e-12)


def test_ties_across_bands_share_the_gradient_evenly():
    """A constant image: every element is a maximum, and each gets 1/numel of the gradient, as
    ``amax`` gives it; max pooling gives it all to the first."""
    image = torch.zeros(1, 1, 6, 3, dtype=torch.float64)
    bands, starts = bands_of(image, [1, 4])
    for kind, want in (("max", torch.full_like(image, 1 / 18)), ("argmax", torch.zeros_like(image))):
        parts = [partial(kind, b, r, 3) for b, r in zip(bands, starts, strict=True)]
        kept = tuple(t.detach() for t in merged(kind, parts))
        ones = Gradients([torch.ones_like(kept[0]), None])
        parts = [partial(kind, b, r, 3) for b, r in zip(bands, starts, strict=True)]
        got = torch.cat(band_grads(kind, kept, parts, ones, bands), dim=2)
        if kind == "argmax":
            want[0, 0, 0, 0] = 1
        torch.testing.assert_close(got, want, rtol=0, atol=1e-15)
