"""Identical tiles computed once (``tilec.runtime.reuse``): exact in float64 against untiled PyTorch,
and counted.

A uint8 slide whose background is one colour (the model converts it itself) is tiled; tiles of one
shape class whose whole read region is background are computed once, forward and backward (where an
input gradient is wanted and their output gradients differ, their input gradients apart). Every
test compares the outputs and every parameter gradient (and the input gradient where the input is
float) with the untiled step, and asserts how many tiles were reused.
"""

import copy
import itertools
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from tilec.pipeline import build
from tilec.runtime.bits import SAMPLE, as_bits, constants, fingerprints
from tilec.runtime.reuse import Keys, slice_keys
from tilec.trace import trace

from support.exactness import TOLERANCE, randomise_buffers, tiled_segments
from support.zoo import ResNetHead, UNet, dropout_segmenter

SHAPE = (1, 3, 70, 61)
BACKGROUND = (243, 240, 246)
GRIDS = [(4, 3), (6, 5), (7, 8)]


class Slide(nn.Module):
    """A uint8 slide converted by the model (``/ 255``, in float64), then ``body``."""

    def __init__(self, body: nn.Module):
        super().__init__()
        self.body = body

    def forward(self, image):
        return self.body(image.to(torch.float64) / 255)


class SlideLoss(nn.Module):
    """A U-Net's per-pixel cross-entropy against a uint8 mask (background label 0), mean-reduced."""

    def __init__(self):
        super().__init__()
        self.unet = UNet("transposed", classes=3)

    def forward(self, image, mask):
        return F.cross_entropy(self.unet(image.to(torch.float64) / 255), mask.long())


def _seeded(model: nn.Module, train: bool = False) -> nn.Module:
    torch.manual_seed(0)
    model = model.double()
    randomise_buffers(model, torch.Generator().manual_seed(1))
    return model.train(train)


def _slide(shape=SHAPE, tissue=(slice(5, 30), slice(8, 27))) -> torch.Tensor:
    """A slide of background colour ``BACKGROUND`` with a textured rectangle ``tissue`` (rows,
    columns): the background touches every border."""
    image = torch.tensor(BACKGROUND, dtype=torch.uint8).view(1, 3, 1, 1).expand(shape).clone()
    texture = torch.randint(0, 256, shape, generator=torch.Generator().manual_seed(2), dtype=torch.uint8)
    image[..., tissue[0], tissue[1]] = texture[..., tissue[0], tissue[1]]
    return image


def _mask(image: torch.Tensor) -> torch.Tensor:
    """Labels 1-2 over the tissue, 0 over the background."""
    background = (image == torch.tensor(BACKGROUND, dtype=torch.uint8).view(1, 3, 1, 1)).all(1)
    return torch.where(background, 0, 1 + (image[:, 0] > 127).to(torch.uint8)).to(torch.uint8)


def _compare(model, tiled, inputs, float_input=False):
    """Max abs differences of the tiled step from the untiled one (on a copy of ``model`` taken
    first): outputs, parameter gradients, buffers, and the input gradient if ``float_input``; the
    output gradient is random."""
    reference = copy.deepcopy(model)

    def step(forward, params):
        given = [x.clone().requires_grad_(float_input) if k == 0 and float_input else x for k, x in enumerate(inputs)]
        out = forward(*given)
        grad = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(3))
        wanted = [*params, given[0]] if float_input else params
        return out, torch.autograd.grad(out, wanted, grad)

    want, want_grads = step(reference, list(reference.parameters()))
    got, got_grads = step(tiled, list(model.parameters()))
    errors = {"output": (want - got).abs().max().item()}
    errors.update({f"grad {k}": (a - b).abs().max().item() for k, (a, b) in enumerate(zip(want_grads, got_grads,
                                                                                         strict=True))})
    for (name, a), b in zip(reference.named_buffers(), model.buffers(), strict=True):
        errors[f"buffer {name}"] = (a.double() - b.double()).abs().max().item()
    return errors


def _float_tiled(model, rolled):
    """``model`` on a float slide, tiled in one segment (``rolled`` ``None``) or two, the first of
    its first node, the second's input gradient rolled or whole as ``rolled`` says."""
    if rolled is None:
        return build(model, SHAPE, (6, 5), dtype="float64")
    count = len(trace(model, SHAPE))
    tiled = build(model, SHAPE, segments=[(0, 1, (5, 4)), (1, count, (6, 5))], dtype="float64")
    tiled_segments(tiled)[1].rolled = (rolled,)
    return tiled


def _passes(tiled, ending):
    """``[ran, reused]`` of the passes whose label ends with ``ending``, summed."""
    found = [counts for label, counts in tiled.reuse.passes.items() if label.endswith(ending)]
    assert found, tiled.reuse.passes
    return [sum(c[0] for c in found), sum(c[1] for c in found)]


@pytest.mark.parametrize("grid", GRIDS)
def test_classifier_on_a_background_slide_reuses_tiles_forward_and_backward(grid):
    model = _seeded(Slide(ResNetHead()))
    image = _slide()
    tiled = build(model, [(SHAPE, "uint8")], grid, dtype="float64")
    errors = _compare(model, tiled, [image])
    assert max(errors.values()) <= TOLERANCE, errors
    forward, backward = _passes(tiled, "level 1"), _passes(tiled, "backward")
    assert forward[1] > 0 and backward[1] > 0, tiled.reuse.passes  # the pooled gradient is uniform
    assert forward[0] + forward[1] == grid[0] * grid[1]


@pytest.mark.parametrize("grid", GRIDS[:2])
def test_training_batch_norm_network_on_a_background_slide_is_exact(grid):
    """One tiled segment, its batch statistics by sweeps: every sweep reuses."""
    model = _seeded(Slide(ResNetHead()), train=True)
    image = _slide()
    count = len(trace(model, [(SHAPE, "uint8")]))
    tiled = build(model, [(SHAPE, "uint8")], segments=[(0, count, grid)], dtype="float64")
    errors = _compare(model, tiled, [image])
    assert max(errors.values()) <= TOLERANCE, errors
    assert len([label for label in tiled.reuse.passes if "level" in label]) == 6  # six batch norms
    assert all(reused > 0 for _, reused in tiled.reuse.passes.values()), tiled.reuse.passes


class AttentionPooled(nn.Module):
    """Gated attention pooling over a feature map's flattened pixels (``tilec.unflatten``): the
    softmax's normaliser and the weighted sum merge a reused tile's partials once per member."""

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.ReLU(), nn.Conv2d(6, 6, 3, padding=1),
                                      nn.ReLU())
        self.v, self.u, self.w, self.head = nn.Linear(6, 4), nn.Linear(6, 4), nn.Linear(4, 1), nn.Linear(6, 2)

    def forward(self, x):
        tokens = self.features(x).flatten(2).transpose(1, 2)
        scores = self.w(torch.tanh(self.v(tokens)) * torch.sigmoid(self.u(tokens)))
        return self.head((torch.softmax(scores, dim=1) * tokens).sum(1))


@pytest.mark.parametrize("grid", [(6, 5), (7, 8)])
def test_attention_pooling_on_a_background_slide_reuses_tiles(grid):
    """One tiled segment: the normaliser's sweep, the weighted sum's and the backward all reuse."""
    model = _seeded(Slide(AttentionPooled()))
    count = len(trace(model, [(SHAPE, "uint8")]))
    tiled = build(model, [(SHAPE, "uint8")], segments=[(0, count, grid)], dtype="float64")
    errors = _compare(model, tiled, [_slide()])
    assert max(errors.values()) <= TOLERANCE, errors
    assert all(reused > 0 for _, reused in tiled.reuse.passes.values()), tiled.reuse.passes


@pytest.mark.parametrize("grid", [(8, 6), (7, 8)])
def test_unet_loss_against_a_mask_with_a_constant_background_label(grid):
    model = _seeded(SlideLoss())
    shape = (1, 3, 160, 144)  # the U-Net's halo is wide
    image = _slide(shape)
    mask = _mask(image)
    tiled = build(model, [(shape, "uint8"), (shape[:1] + shape[2:], "uint8")], grid, dtype="float64")
    errors = _compare(model, tiled, [image, mask])
    assert max(errors.values()) <= TOLERANCE, errors
    assert _passes(tiled, "backward")[1] > 0, tiled.reuse.passes  # the loss's gradient is the same per pixel


def test_a_feature_map_output_with_a_random_gradient_reuses_backward_where_no_input_gradient_is_wanted():
    """A random output gradient differs per position: a representative back-propagates the sum of
    its members' gradients (backprop is linear), as many tiles as forward."""
    model = _seeded(Slide(nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 2, 3, padding=1))))
    image = _slide()
    tiled = build(model, [(SHAPE, "uint8")], (6, 5), dtype="float64")
    errors = _compare(model, tiled, [image])
    assert max(errors.values()) <= TOLERANCE, errors
    forward = _passes(tiled, "forward")
    assert forward[1] > 0
    assert _passes(tiled, "backward") == forward


@pytest.mark.parametrize("rolled", [None, False, True])
def test_a_float_input_under_a_random_output_gradient_gets_each_tile_its_own_input_gradient(rolled):
    """A float slide requiring grad and a feature map out with a random gradient, in one segment
    (``None``) or two, the second's input gradient whole or rolled: the tiles of one key have
    different output gradients, so each back-propagates its own into its input gradient through
    one recompute of their representative (``Sweep.band``)."""
    model = _seeded(nn.Sequential(nn.Hardtanh(0.2, 0.9), nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(),
                                  nn.Conv2d(4, 2, 3, padding=1)))
    image = _slide().to(torch.float64) / 255
    tiled = _float_tiled(model, rolled)
    errors = _compare(model, tiled, [image], float_input=True)
    assert max(errors.values()) <= TOLERANCE, errors
    last = tiled_segments(tiled)[-1].label
    assert tiled.reuse.passes[f"{last} forward"][1] > 0, tiled.reuse.passes
    assert tiled.reuse.passes[f"{last} backward"][1] > 0, tiled.reuse.passes


@pytest.mark.parametrize("grid", [(7, 6), (8, 8)])
def test_a_training_segmentation_network_reuses_tiles_in_every_backward_sweep(grid):
    """Two segments with batch statistics by sweeps and a per-pixel output with a random gradient:
    the backward sweeps of the leaves reuse as many tiles as their forward; so does the first
    segment's last sweep (the slide wants no gradient); the second's, whose input wants one,
    computes its members' input gradients apart."""
    model = _seeded(Slide(nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
        nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 2, 3, padding=1))), train=True)
    image = _slide()
    count = len(trace(model, [(SHAPE, "uint8")]))
    tiled = build(model, [(SHAPE, "uint8")], segments=[(0, count - 4, grid), (count - 4, count, grid)],
                  dtype="float64")
    errors = _compare(model, tiled, [image])
    assert max(errors.values()) <= TOLERANCE, errors
    first, second = (segment.label for segment in tiled_segments(tiled))
    passes = tiled.reuse.passes
    assert passes[f"{first} backward sweep"] == passes[f"{first} level 1"], passes
    assert passes[f"{first} backward"] == passes[f"{first} forward"], passes
    assert passes[f"{first} backward"][1] > 0, passes
    assert passes[f"{second} backward sweep"] == passes[f"{second} level 1"], passes
    assert passes[f"{second} backward"][1] > 0, passes


def _expected_reuse(segment, pixel):
    """Tiles reused where every tile but those reading ``pixel`` (row, col of the input) is
    background: per shape class, all but the first of the tiles not reading it."""
    classes = [(row[2], col[2]) for row in segment.rows for col in segment.cols
               if not (row[0][0][0] <= pixel[0] < row[0][0][1] and col[0][0][0] <= pixel[1] < col[0][0][1])]
    return len(classes) - len(set(classes)), len(segment.rows) * len(segment.cols) - len(classes)


@pytest.mark.parametrize("grid", GRIDS)
def test_a_pixel_differing_in_a_halo_stops_reuse_of_the_tiles_reading_it(grid):
    model = _seeded(Slide(ResNetHead()))
    image = _slide(tissue=(slice(0, 0), slice(0, 0)))  # all background
    pixel = (37, 29)
    image[0, 1, pixel[0], pixel[1]] = BACKGROUND[1] + 1
    tiled = build(model, [(SHAPE, "uint8")], grid, dtype="float64")
    errors = _compare(model, tiled, [image])
    assert max(errors.values()) <= TOLERANCE, errors
    segment, = tiled_segments(tiled)
    reused, reading = _expected_reuse(segment, pixel)
    assert reading >= 2  # the pixel lies in another tile's halo too
    assert _passes(tiled, "level 1") == [grid[0] * grid[1] - reused, reused]
    assert _passes(tiled, "backward") == [grid[0] * grid[1] - reused, reused]


@pytest.mark.parametrize("rolled", [None, False, True])
def test_a_float_input_requiring_grad_gets_each_tile_its_own_gradient(rolled):
    """A float slide requiring grad, in one segment (``None``) or two, the second's input gradient
    whole or rolled (``tilec.runtime.tiles.Rolled``, its tiles then grouped by row): the
    representative's input gradient, divided among its members, goes into each one's slice. The
    first segment is element-wise, so that the second's input is constant over the background."""
    model = _seeded(nn.Sequential(nn.Hardtanh(0.2, 0.9), nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(),
                                  nn.Conv2d(4, 5, 3, stride=2, padding=1), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                                  nn.Linear(5, 2)))
    image = _slide().to(torch.float64) / 255
    tiled = _float_tiled(model, rolled)
    errors = _compare(model, tiled, [image], float_input=True)
    assert max(errors.values()) <= TOLERANCE, errors
    last = tiled_segments(tiled)[-1].label
    assert tiled.reuse.passes[f"{last} backward"][1] > 0, tiled.reuse.passes


def test_a_slice_is_constant_only_where_its_bits_are():
    spatial = (2, 3)
    x = torch.zeros(1, 2, 3, 3, dtype=torch.float64)
    x[0, 1] = 5.0
    assert constants(x, spatial) is not None
    x[0, 0, 1, 1] = -0.0
    assert constants(x, spatial) is None  # -0.0 == 0.0, but not the same bits
    assert constants(torch.full((1, 1, 2, 2), float("nan")), spatial) is not None  # one NaN's bits
    assert constants(torch.tensor([[[[1, 2]]]], dtype=torch.uint8), spatial) is None
    x = torch.full((1, 2, 2 * SAMPLE + 3, 5), 7, dtype=torch.uint8)
    assert constants(x, spatial) == (7, 7)
    x[0, 1, SAMPLE + 1, 4] = 8  # in a row the first look skips
    assert constants(x, spatial) is None


def _keys(x, heights, width):
    """The keys of a column of tiles ``heights`` rows each of a one-input segment reading ``x``."""
    col, tiles, start = (((0, width),), ((0, width),), 0, ()), [], 0
    for index, height in enumerate(heights):
        rows = (start, start + height)
        tiles.append((index, ((rows,), (rows,), 0, ()), col))
        start += height
    segment = SimpleNamespace(reuse=True, sliced=[(2, 3)], tiles=lambda group: iter(tiles))
    keys = Keys()
    keys.prepare(segment, [x], None)
    return [keys.find(segment, [x], index, row, col) for index, row, col in tiles]


def test_tiles_whose_first_looks_agree_are_one_key_only_where_all_their_bits_do():
    """Three tiles of a float tensor, the second differing from the first only in a row that the
    fingerprint skips: its fingerprint is the first's, but its bits are not, and it has no key; the
    third holds the first's bits and is its member."""
    height = 2 * SAMPLE
    first = torch.randn(1, 2, height, 5, dtype=torch.float64)
    x = torch.cat([first, first.clone(), first], dim=2)
    x[0, 0, height + 3, 1] += 1
    keys = _keys(x, [height] * 3, 5)
    assert keys[0] is not None and keys[1] is None and keys[2] == keys[0]
    assert keys[0][3][0][0] == "f"


def test_constant_tiles_are_keyed_by_their_bits_and_a_tile_without_an_equal_has_no_key():
    """Tiles of one constant per channel are keyed by it, where every row holds it (a row the first
    look skips is looked at too, and -0.0 is not 0.0); a tile no other tile equals has no key."""
    height = 2 * SAMPLE + 1
    x = torch.zeros(1, 2, 5 * height, 4, dtype=torch.float64)
    x[0, 1] = 3.5
    x[0, 0, 2 * height + SAMPLE + 1, 2] = -0.0  # the third tile: not one constant, and unique
    x[0, 1, 3 * height:4 * height] = torch.randn(height, 4, dtype=torch.float64)  # the fourth: unique
    keys = _keys(x, [height] * 5, 4)
    bits = (0, torch.tensor(3.5, dtype=torch.float64).view(torch.int64).item())
    assert keys[0] == keys[1] == keys[4] and keys[0][3] == (("c", bits),)
    assert keys[2] is None and keys[3] is None


@st.composite
def channel_slices(draw):
    """Slices of one tensor (N, C, H, W) of a drawn dtype, each channel of each drawn constant
    (0.0 or -0.0 among them), textured, or constant but for one element, in any row."""
    dtype = draw(st.sampled_from([torch.uint8, torch.int16, torch.float32, torch.float64, torch.bfloat16]))
    count, channels = draw(st.integers(1, 4)), draw(st.integers(1, 3))
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    found = []
    for _ in range(count):
        height, width = draw(st.integers(0, 3 * SAMPLE)), draw(st.integers(1, 5))
        x = torch.empty(1, channels, height, width, dtype=torch.float64)
        for c in range(channels):
            kind = draw(st.sampled_from(["constant", "textured", "one off"]))
            x[0, c] = draw(st.sampled_from([0.0, -0.0, 3.0, 200.0]))
            if kind == "textured":
                x[0, c] = torch.randint(0, 3, (height, width), generator=generator).double()
            elif kind == "one off" and height:
                x[0, c, draw(st.integers(0, height - 1)), draw(st.integers(0, width - 1))] += 1
        found.append(x.to(dtype))
    return found


@settings(max_examples=200, deadline=None)
@given(channel_slices())
def test_the_looks_on_the_device_give_the_hosts_exact_answers(slices):
    """``slice_keys`` (sampled rows first, the whole slice where they agree, all slices at once)
    keys each slice as the host's exact ``constants`` and ``fingerprints`` do."""
    spatial = (2, 3)
    for got, x in zip(slice_keys([as_bits(x) for x in slices], spatial), slices, strict=True):
        constant = constants(x, spatial)
        assert got == (("c", constant) if constant is not None else ("f", fingerprints([(x, spatial)])[0]))


def test_the_keys_of_a_segment_are_read_off_its_device_a_few_times_however_many_its_tiles(monkeypatch):
    """Finding the keys of 40 tiles, half of them background, waits for the device three times: the
    first looks, the second look at the background candidates, and the pairwise comparison of the
    fingerprinted tiles (not once or twice per tile)."""
    reads = []
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(t.shape) or tolist(t))
    texture = torch.randn(1, 3, SAMPLE, 6, dtype=torch.float64)
    x = torch.cat([texture if k % 4 == 0 else texture + k if k % 2 else torch.ones_like(texture) for k in range(40)],
                  dim=2)
    keys = _keys(x, [SAMPLE] * 40, 6)
    assert len(reads) == 3, reads
    assert set(keys[1::2]) == {None}  # the textured tiles 4k + 1 and 4k + 3 are each unique
    assert len(set(keys[::4])) == 1 and keys[0][3][0][0] == "f"
    assert len(set(keys[2::4])) == 1 and keys[2][3][0][0] == "c"


def test_a_segment_drawing_element_wise_dropout_never_reuses_and_one_without_may():
    """Element-wise dropout draws by absolute position (``Op.positional``): its segment's identical
    tiles are not identical."""
    drawing = build(dropout_segmenter(pooling=False), (1, 3, 24, 24), grid=(2, 2))
    plain = build(dropout_segmenter(pooling=False).eval(), (1, 3, 24, 24), grid=(2, 2))
    flags = [[step.run.reuse for step in model.steps if hasattr(step.run, "reuse")] for model in (drawing, plain)]
    assert flags[0] and not all(flags[0])  # the segments drawing dropout
    assert flags[1] and all(flags[1])


def test_a_later_segment_reuses_the_tiles_whose_slices_of_a_stored_activation_are_equal():
    """Cut in two, the second segment reads an activation the first wrote, whose background tiles
    are copies of one representative's owned values but not one constant: those tiles are keyed
    by their slices' bits (``Keys.find``), and the second segment reuses them too."""
    model = _seeded(Slide(ResNetHead()))
    shape = (1, 3, 110, 97)
    image = _slide(shape, tissue=(slice(4, 30), slice(6, 25)))
    count = len(trace(model, [(shape, "uint8")]))
    tiled = build(model, [(shape, "uint8")], segments=[(0, count // 2, (7, 6)), (count // 2, count, (7, 6))],
                  dtype="float64")
    errors = _compare(model, tiled, [image])
    assert max(errors.values()) <= TOLERANCE, errors
    assert tiled.reuse.passes["segment 1 level 1"][1] > 0, tiled.reuse.passes


@pytest.mark.parametrize("rolled", [None, False, True])
def test_tiles_whose_output_gradients_repeat_share_one_input_gradient_per_class(rolled, monkeypatch):
    """A float slide requiring grad, a feature map out whose gradient repeats every two tiles
    (12-pixel tiles, a 24-pixel pattern): the last segment's background tiles of one key fall into
    at most four classes of equal owned output gradients (``Sweep.alike``), each back-propagates
    one input gradient for all its tiles, and the step is exact (in two segments, the first's
    output gradients, summed over the second's halos near the tissue and the borders, differ)."""
    shape = (1, 3, 72, 60)
    model = _seeded(nn.Sequential(nn.Hardtanh(0.2, 0.9), nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(),
                                  nn.Conv2d(4, 2, 3, padding=1)))
    image = _slide(shape, tissue=(slice(3, 20), slice(5, 22))).to(torch.float64) / 255
    pattern = torch.randn(1, 2, 24, 24, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    grad = pattern.repeat(1, 1, 3, 3)[..., :shape[2], :shape[3]]
    if rolled is None:
        tiled = build(model, shape, (6, 5), dtype="float64")
    else:
        tiled = build(model, shape, segments=[(0, 1, (6, 5)), (1, len(trace(model, shape)), (6, 5))],
                      dtype="float64")
        tiled_segments(tiled)[1].rolled = (rolled,)
    found = []
    sweep = type(tiled).__init__.__globals__["Sweep"]  # the generated module's copy of the runtime
    alike, tolist = sweep.alike, torch.Tensor.tolist

    def recording(self, tiles):
        reads = []
        with monkeypatch.context() as patch:
            patch.setattr(torch.Tensor, "tolist", lambda t: reads.append(t.shape) or tolist(t))
            classes = alike(self, tiles)
        # the fingerprints, then per round every tile against its bucket's first (a round makes a
        # class at least), not a read or two per tile
        assert len(reads) <= 1 + len(classes), (reads, len(classes))
        grads = {tile: self.owned_grads(tile[1], tile[2]) for tile in tiles}  # each class's are equal
        assert all(torch.equal(g, h) for members in classes for tile in members
                   for (g, _), (h, _) in zip(grads[members[0]], grads[tile], strict=True) if g is not None)
        assert sorted(tile for members in classes for tile in members) == sorted(tiles)
        assert not any(all(torch.equal(g, h) for (g, _), (h, _) in zip(grads[a[0]], grads[b[0]], strict=True)
                           if g is not None) for a, b in itertools.combinations(classes, 2))  # and differ
        found.append((self.segment.label, len(tiles), len(classes)))
        return classes

    monkeypatch.setattr(sweep, "alike", recording)
    reference = copy.deepcopy(model)
    results = []
    for forward, params in ((reference, list(reference.parameters())), (tiled, list(model.parameters()))):
        given = image.clone().requires_grad_()
        out = forward(given)
        results.append((out, torch.autograd.grad(out, [*params, given], grad)))
    (want, want_grads), (got, got_grads) = results
    errors = [(want - got).abs().max().item(), *((a - b).abs().max().item() for a, b in zip(want_grads, got_grads,
                                                                                            strict=True))]
    assert max(errors) <= TOLERANCE, errors
    last = [(tiles, classes) for label, tiles, classes in found if label == tiled_segments(tiled)[-1].label]
    assert last and all(classes <= min(tiles, 4) for tiles, classes in last), found
    assert any(tiles > classes for tiles, classes in last), found
