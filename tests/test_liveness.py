"""The tile liveness simulation (``tilec.cost.liveness``) on cases worked out by hand.

``Timeline`` records storages coming alive and dying (a pinned one, a tile's arena tensor, stays
alive to the end of the run whoever lets go of it) and events (allocations, with transient extras
and constants); ``Trace.levels`` / ``peak`` turn that into bytes alive for given quantity sizes.
``Forward`` and ``program`` simulate a segment of a traced conv -> ReLU -> conv: every storage,
hold and event below is derived by hand from the rules in the module docstring.
"""

from __future__ import annotations

import numpy as np
import pytest
from torch import nn

from tilec.cost.estimator import Estimator
from tilec.cost.liveness import COPY, KINDS, OUT, PADDED, Forward, Timeline, Trace, program
from tilec.runtime.device import CONVOLVE_INTO, PACK
from tilec.target import Target
from tilec.trace import trace

HAS_ONEDNN = CONVOLVE_INTO is not None and PACK is not None


# --- Timeline and Trace ----------------------------------------------------------------------------


def _run() -> tuple[Timeline, tuple]:
    """Quantities 0, 1, 2. Returns the run and a snapshot mark taken after its second event."""
    run = Timeline()
    a = run.new(0)                 # change 1: +q0
    run.event()                    # event 0 after 1 change
    b = run.new(1, pinned=True)    # change 2: +q1, pinned
    run.hold(a)
    run.drop(a)                    # a still held once: no change
    run.event({2: 0.5}, constant=7.0)  # event 1 after 2 changes, with half of q2 on top, and 7 bytes
    mark = run.mark(True)
    run.drop(b)                    # pinned: stays alive, no change
    c = run.new(2)                 # change 3: +q2
    run.drop(a)                    # change 4: -q0
    run.hold(None)
    run.drop(None)                 # no storage: nothing
    run.event()                    # event 2 after 4 changes
    run.drop(c)                    # change 5: -q2
    return run, mark


def test_the_timeline_records_holders_pinned_storages_and_events():
    run, _ = _run()
    got = run.trace()
    assert got.change_quantity.tolist() == [0, 1, 2, 0, 2] and got.change_sign.tolist() == [1, 1, 1, -1, -1]
    assert got.events.tolist() == [1, 2, 4] and got.constants.tolist() == [0.0, 7.0, 0.0]
    assert (got.transient_event.tolist(), got.transient_quantity.tolist(), got.transient_multiple.tolist()) == (
        [1], [2], [0.5])
    assert run.holders == {} and run.pinned == {1}  # b was let go of, yet never died


def test_levels_and_peak_by_hand():
    run, _ = _run()
    got = run.trace()
    sizes = np.array([[10.0, 100.0, 1000.0], [1.0, 2.0, 3.0]])
    alive, at = got.levels(sizes)
    assert alive.tolist() == [[0, 10, 110, 1110, 1100, 100], [0, 1, 3, 6, 5, 2]]
    # event 1: q0 + q1, half of q2 and 7 bytes
    assert at.tolist() == [[10, 110 + 500 + 7, 1100], [1, 3 + 1.5 + 7, 5]]
    assert got.peak(sizes) == 1100
    assert got.peak(np.array([[1.0, 2.0, 3.0]])) == 12  # 11.5, rounded
    assert Trace(*(np.zeros(0, dtype=int) for _ in range(6)), np.zeros(0)).peak(sizes) == 0


def test_a_mark_traces_the_run_so_far_and_forks_it():
    run, mark = _run()
    assert mark[:3] == (2, 2, 1) and mark[3] == {0: 1, 1: 1}
    so_far = run.trace(mark)
    assert so_far.change_quantity.tolist() == [0, 1] and so_far.events.tolist() == [1, 2]
    other = run.fork(mark, events=True)
    storage = next(iter(other.holders))  # a, still held once
    other.drop(storage)
    other.event()
    forked = other.trace()
    assert forked.change_quantity.tolist() == [0, 1, 0] and forked.change_sign.tolist() == [1, 1, -1]
    assert forked.events.tolist() == [1, 2, 3] and forked.constants.tolist() == [0.0, 7.0, 0.0]
    fresh = run.fork(mark, events=False)
    fresh.event(constant=3.0)
    assert fresh.trace().events.tolist() == [2] and fresh.trace().constants.tolist() == [3.0]
    assert run.trace().events.tolist() == [1, 2, 4], "forks leave the run alone"


# --- a conv -> ReLU -> conv segment ------------------------------------------------------------------

SHAPE = (1, 1, 8, 8)


@pytest.fixture(scope="module")
def estimator() -> Estimator:
    model = nn.Sequential(nn.Conv2d(1, 2, 3, padding=1), nn.ReLU(), nn.Conv2d(2, 1, 3, padding=1))
    return Estimator(trace(model, SHAPE), Target(), "float32")


def test_the_facts_of_the_tiny_graph(estimator):
    facts = estimator.facts
    assert estimator.graph.order == ("conv2d", "relu", "conv2d_1")
    first, relu, second = facts.nodes
    assert (first.weights, second.weights) == ((2 * 9 + 2) * 4, (2 * 9 + 1) * 4)
    assert first.in_arena == second.in_arena == HAS_ONEDNN  # float32 convolutions on oneDNN, into the arena
    assert not first.gemm and not second.gemm  # fewer input channels than GEMM_MIN_CHANNELS
    assert relu.overwrites and relu.gradient_reader == 2  # in place, and back-propagated in place by conv2d_1
    assert relu.dies_at == (0,) and second.dies_at == (1,) and first.dies_at == ()
    # a spread (3x3) kernel's weight is copied once per call into the arena, twice outside it
    assert first.weight_copies == first.weights * (1 if HAS_ONEDNN else 2)
    assert second.backward_weight_copies == 3 * second.weights  # one more copy and two blocked ones, or two and one
    assert first.tile_workspace == (0.0, 0.0) and first.stored_workspace == (1.0, 2.5)
    full = {name: 4 * count for name, count in (("input", 64), ("conv2d", 128), ("relu", 128), ("conv2d_1", 64))}
    assert facts.full == full
    assert facts.scale_full.tolist() == [[512, 256, 256, 1024], [512, 512, 512, 1024], [256, 512, 512, 512]]


def test_a_tiled_forward_by_hand(estimator):
    """The tiled forward, without autograd: each tile's slice of the input (quantity 0, pinned),
    then per node quantity ``1 + KINDS * position + kind``. conv2d makes a padded copy of its read
    (a border tile's, pinned) and its result (pinned in the arena); the ReLU runs in place on it
    (no storage, no event); conv2d_1 likewise; the ReLU's storage dies at conv2d_1 (in the arena:
    not before the tile ends). Each convolution's event carries its weight copies, none where
    the forward packed its weight once for the pass."""
    forward = Forward(estimator.facts, 0, 3, tiled=True, autograd=False)
    assert forward.slices == (-1,)

    def q(position, kind):
        return 1 + KINDS * position + kind

    got = forward.run.trace()
    changes = [(0, 1), (q(0, COPY), 1), (q(0, OUT), 1), (q(2, COPY), 1), (q(2, OUT), 1)]
    if not HAS_ONEDNN:
        changes.append((q(0, OUT), -1))  # conv2d's (and the ReLU's) result, once conv2d_1 ran
    assert list(zip(got.change_quantity.tolist(), got.change_sign.tolist(), strict=True)) == changes
    assert got.events.tolist() == [3, 5]
    facts = estimator.facts.nodes
    assert got.constants.tolist() == ([0.0, 0.0] if HAS_ONEDNN else [facts[0].weight_copies, facts[2].weight_copies])
    assert len(got.transient_event) == 0 and forward.saved == {}
    assert len(forward.marks) == 3 and forward.marks[1][:2] == forward.marks[0][:2]  # the ReLU: nothing


def test_a_tiled_segment_program_by_hand(estimator):
    """Tiled forward under autograd on fresh tensors (no arena: each storage dies with its last
    holder), then backward: the output's gradient (its tile's part), the gradient conv2d_1 hands
    the ReLU (over its padded read), which the in-place ReLU hands on to conv2d as it is; conv2d's
    input needs no gradient. Each op's saved tensors go after its backward. Every event keeps its
    weight and weight copies; the backward's carry the backward copies too."""
    facts = estimator.facts.nodes
    simulated = program(estimator.facts, estimator.forward, 0, 3, True)
    assert (simulated.first, simulated.stop, simulated.slices) == (0, 3, (("input", ("conv2d",)),))

    def q(position, kind):
        return 1 + KINDS * position + kind

    backward = simulated.backward
    changes = [(0, 1), (q(0, COPY), 1), (q(0, OUT), 1), (q(2, COPY), 1), (q(2, OUT), 1),  # forward
               (q(2, OUT), 1),      # the output gradient of the tile
               (q(2, PADDED), 1),   # conv2d_1's input gradient: the ReLU's, over the padded read
               (q(2, OUT), -1),     # the output gradient, once conv2d_1 back-propagated
               (q(2, COPY), -1),    # conv2d_1's saved padded copy of its read
               (q(0, OUT), -1),     # the ReLU's result (conv2d's storage), saved for its backward
               (q(2, PADDED), -1),  # the ReLU's gradient, which it handed conv2d, after conv2d
               (0, -1), (q(0, COPY), -1)]  # conv2d's saved input slice and padded copy
    assert list(zip(backward.change_quantity.tolist(), backward.change_sign.tolist(), strict=True)) == changes
    assert backward.events.tolist() == [3, 5, 7, 9, 10]
    forward_copies = [facts[0].weight_copies, facts[2].weight_copies]
    assert backward.constants.tolist() == [*forward_copies, facts[2].weights + facts[2].backward_weight_copies, 0.0,
                                           facts[0].weights + facts[0].backward_weight_copies]
    assert len(backward.transient_event) == 0
    assert simulated.forward.events.tolist() == [3, 5]  # the forward without autograd, as above
    # levels by hand, with quantity q sized 2**q bytes
    sizes = np.array([[2.0 ** k for k in range(1 + KINDS * 3)]])
    alive = np.cumsum([0] + [sign * 2 ** quantity for quantity, sign in changes])
    _, at = backward.levels(sizes)
    assert at[0].tolist() == [alive[e] + c for e, c in zip(backward.events.tolist(), backward.constants.tolist(),
                                                             strict=True)]
    assert backward.peak(sizes) == max(at[0])


def test_a_stored_segment_program_by_hand(estimator):
    """Stored, through autograd: no slices, quantity ``KINDS * position + kind``; conv2d keeps its
    input (the model input: none of this segment's), the ReLU its result (which outlives conv2d's
    result, now dead), conv2d_1 its input (the ReLU's result). Convolutions take their stored
    workspace on their padded input. Backward: the output is dropped (the caller holds it), the
    gradients come alive and die as autograd makes and frees them."""
    simulated = program(estimator.facts, estimator.forward, 0, 3, False)
    assert simulated.slices == () and simulated.forward is None
    ahead = estimator.forward(0, False, True)
    forward = ahead.run.trace()
    assert list(zip(forward.change_quantity.tolist(), forward.change_sign.tolist(), strict=True)) == [
        (0 + OUT, 1), (4 + OUT, 1), (0 + OUT, -1), (8 + OUT, 1)]
    assert forward.events.tolist() == [1, 2, 4] and forward.constants.tolist() == [0.0, 0.0, 0.0]
    assert list(zip(forward.transient_event.tolist(), forward.transient_quantity.tolist(),
                    forward.transient_multiple.tolist(), strict=True)) == [(0, 0 + PADDED, 1.0), (2, 8 + PADDED, 1.0)]
    backward = simulated.backward
    changes = [(0, 1), (4, 1), (0, -1), (8, 1),      # the forward
               (8, -1),                              # the output: the caller's
               (8 + PADDED, 1),                      # conv2d_1's input gradient (the ReLU's)
               (0 + OUT, 1),                         # the ReLU's input gradient (conv2d's)
               (8 + PADDED, -1), (4 + OUT, -1),      # the ReLU's gradient and its saved result
               (0 + OUT, -1)]                        # conv2d's gradient, after conv2d
    assert list(zip(backward.change_quantity.tolist(), backward.change_sign.tolist(), strict=True)) == changes
    facts = estimator.facts.nodes
    assert backward.events.tolist() == [6, 7, 9]
    assert backward.constants.tolist() == [facts[2].weights, 0.0, facts[0].weights]
    assert list(zip(backward.transient_event.tolist(), backward.transient_quantity.tolist(),
                    backward.transient_multiple.tolist(), strict=True)) == [(0, 8 + PADDED, 2.5), (2, 0 + PADDED, 2.5)]
    # the bytes: OUT of conv2d and relu 512 each, of conv2d_1 256; PADDED of conv2d 256 (the input), of conv2d_1 512
    sizes = estimator.facts.scale_full[0:3].reshape(1, -1)
    _, at = backward.levels(sizes)
    assert at[0].tolist() == [1024 + 76 + 2.5 * 512, 1536, 512 + 80 + 2.5 * 256]
    assert backward.peak(sizes) == 2380
    _, forward_at = forward.levels(sizes)
    assert forward_at[0].tolist() == [512 + 256, 1024, 768 + 512]
    cost = estimator.segment(0, 3, (), (), stored=True)
    # the output's gradient (the model output, 256) and every parameter's gradient (80 + 76) besides
    assert cost.backward_local == 256 + 156 + 2380
    assert cost.forward_local == 1280 and cost.kept == 512 + 256  # the ReLU's result (saved) and the output
