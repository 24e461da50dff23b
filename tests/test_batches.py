"""Same-shape tiles in one call (``tilec.runtime.batches``): exact in float64 against untiled PyTorch,
batched as the plan says, and planned with their memory and calls counted.

Consecutive tiles of one shape class run ``batch`` at a time, stacked along the batch axis. Every
test compares outputs, the input gradient, every parameter gradient and every buffer with the
untiled step (``check_exact``), on odd sizes and grids whose rows hold border and interior classes.
"""


import numpy as np
import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner
from torch import nn

from tilec.cli import main
from tilec.cost.estimator import Estimator, _calls
from tilec.errors import GridError
from tilec.ir import Plan
from tilec.pipeline import build
from tilec.planner import plan
from tilec.sweeps import batchable
from tilec.trace import trace

from support.exactness import TOLERANCE, check_exact, tiled_segments
from support.zoo import SHAPES, TINY, TRAIN_SHAPES, TRAIN_ZOO, ZOO

#: Models whose ops cover every family a batched tile runs: eval-mode BatchNorm and max pooling,
#: inverted residuals, squeeze-and-excitation scales read by every tile, channel shuffles (views),
#: concatenations, ceil-mode pools, channels-last LayerNorm blocks, transposed convolutions,
#: upsampling, crops and pads.
EVAL_MODELS = ["resnet_head", "mobilenetv2", "squeeze_excite", "shufflenet", "densenet", "inception", "convnext",
               "unet_transposed", "unet_bilinear", "unet_crop"]
#: Training mode: batch statistics (reduced over the stacked tiles together), group and instance
#: norm (one partial per stacked tile), stochastic depth masks, a per-pixel loss, layer norm.
TRAIN_MODELS = ["resnet_basic", "groupnorm_resnet", "basic_unet", "efficientnet_drop", "segmentation_loss",
                "convnext_head"]


def one_sample(shape):
    return (1, *shape[1:])


def counting(tiled):
    """Wrap every tile function of ``tiled``'s segments so that calls and the tiles they stack are
    counted: returns ``{segment label: [calls, tiles]}``."""
    counts = {}
    for segment in tiled_segments(tiled):
        counts[segment.label] = [0, 0]

        def wrap(fn, tally=counts[segment.label]):
            def counted(xs, *rest):
                tally[0] += 1
                tally[1] += next(x.shape[0] for x in xs if x.dim() == 4)
                return fn(xs, *rest)
            return counted

        segment.functions = {key: wrap(fn) for key, fn in segment.functions.items()}
    return counts


@pytest.mark.parametrize("name", EVAL_MODELS)
def test_published_patterns_batched_are_exact(name):
    check_exact(ZOO[name](), one_sample(SHAPES[name]), grid=(4, 5), batch=3)


@pytest.mark.parametrize("name", TRAIN_MODELS)
def test_training_mode_batched_is_exact(name):
    check_exact(TRAIN_ZOO[name](), one_sample(TRAIN_SHAPES[name]), grid=(3, 4), batch=2)


@pytest.mark.parametrize(("grid", "batch"), [((5, 6), 4), ((1, 7), 3), ((7, 1), 2), ((6, 5), 64)])
def test_batches_on_odd_grids_are_exact(grid, batch):
    """A row of interior tiles split in calls of ``batch`` and a remainder; a one-column grid
    stacks tiles of consecutive rows; a batch larger than any run."""
    check_exact(TRAIN_ZOO["resnet_basic"](), (1, 3, 37, 41), grid=grid, batch=batch)


def test_consecutive_tiles_of_one_class_run_as_one_call():
    """A 4x6 grid's rows are classes [0, 1, 1, 1, 1, 2]: with batch 3, each row runs in 1 + 2 + 1
    calls instead of 6, every tile once per pass."""
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1)).double()
    tiled = build(model, (1, 3, 24, 36), (4, 6), batch=3, dtype="float64")
    counts = counting(tiled)
    x = torch.randn(1, 3, 24, 36, dtype=torch.float64, requires_grad=True)
    tiled(x).sum().backward()
    (calls, tiles), = counts.values()
    assert (calls, tiles) == (2 * 4 * 4, 2 * 24)  # forward and backward, 4 calls a row, 24 tiles each
    assert torch.allclose(x.grad, torch.autograd.grad(model(x).sum(), x)[0], atol=TOLERANCE, rtol=0)


def test_batched_and_reused_tiles_mix_exactly():
    """A slide mostly background: a key's first tile runs alone, its members copy it, the other
    tiles run stacked; as many tiles are reused as one by one."""
    from test_reuse import SHAPE, Slide, _compare, _seeded, _slide

    from support.zoo import ResNetHead

    image = _slide()
    found = {}
    for batch in (1, 3):
        model = _seeded(Slide(ResNetHead()))
        tiled = build(model, [(SHAPE, "uint8")], (6, 5), batch=batch, dtype="float64")
        errors = _compare(model, tiled, [image])
        assert max(errors.values()) <= TOLERANCE, (batch, errors)
        found[batch] = dict(tiled.reuse.passes)
    assert found[1] == found[3] and any(reused for _, reused in found[3].values())


def test_a_later_batched_segment_reuses_the_tiles_a_stored_activation_repeats():
    """Cut in two, the second segment reads an activation whose background tiles are copies of one
    representative's (keyed by their slices' bits, ``tilec.runtime.reuse``): stacked three at a
    time, such a tile whose key a later tile of the pass has still runs alone, and the later ones
    reuse it, as many as one by one, as the estimate counts."""
    from test_reuse import Slide, _compare, _seeded, _slide

    from support.zoo import ResNetHead

    shape = (1, 3, 110, 97)
    image = _slide(shape, tissue=(slice(4, 30), slice(6, 25)))
    found = {}
    for batch in (1, 3):
        model = _seeded(Slide(ResNetHead()))
        count = len(trace(model, [(shape, "uint8")]))
        tiled = build(model, [(shape, "uint8")], segments=[(0, count // 2, (7, 6)), (count // 2, count, (7, 6))],
                      batch=batch, dtype="float64")
        errors = _compare(model, tiled, [image])
        assert max(errors.values()) <= TOLERANCE, (batch, errors)
        found[batch] = dict(tiled.reuse.passes)
    assert found[1] == found[3] and found[3]["segment 1 level 1"][1] > 0, found


def test_segments_whose_tiles_cannot_stack_run_one_by_one():
    """Two samples per image, a global max pooling's index (counted from each tile's origin) and
    element-wise dropout (masks by absolute position) keep batch 1; the plan says so."""
    class MaxPooled(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3, padding=1)

        def forward(self, x):
            return F.adaptive_max_pool2d(self.conv(x), 1)

    two = trace(nn.Conv2d(3, 4, 3), (2, 3, 20, 20))
    pooled = trace(MaxPooled(), (1, 3, 20, 20))
    dropped = trace(nn.Sequential(nn.Conv2d(3, 4, 3), nn.Dropout(0.5)).train(), (1, 3, 20, 20))
    for graph in (two, pooled, dropped):
        assert not batchable(graph, 0, len(graph))
        assert {s.batch for s in plan(graph, name="m", grid=(2, 2), batch=4).segments} == {1}
    one = trace(nn.Conv2d(3, 4, 3), (1, 3, 20, 20))
    assert [s.batch for s in plan(one, name="m", grid=(2, 2), batch=4).segments] == [4]


def test_a_plan_with_an_impossible_batch_is_refused():
    graph = trace(nn.Conv2d(3, 4, 3), (2, 3, 20, 20))
    planned = plan(graph, name="m", grid=(2, 2))
    data = planned.model_dump()
    data["segments"][0]["batch"] = 3
    from tilec.errors import PlanError
    from tilec.validate import validate
    with pytest.raises(PlanError, match="batch 3, but its tiles cannot run stacked"):
        validate(Plan.model_validate(data))
    with pytest.raises(GridError, match="batch must be a positive"):
        plan(graph, name="m", grid=(2, 2), batch=0)


def test_the_estimate_counts_a_batch_s_working_set_and_its_calls():
    """The largest call's tiles are held at once: the predicted peak grows with the batch, the op
    calls fall by the runs' chunks, the FLOPs stay."""
    graph = trace(nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1)),
                  (1, 3, 96, 96))
    estimator = Estimator(graph, TINY, "float32")
    planned = plan(graph, TINY, name="m", grid=(6, 6))
    segment = planned.segments[0]
    one, four = (estimator.segment(0, len(graph), segment.rows, segment.cols, False, batch) for batch in (1, 4))
    assert four.flops == one.flops
    assert four.calls * 36 == one.calls * 6 * 3  # rows [0, 1, 1, 1, 1, 2]: 1 + 1 + 1 calls a row
    assert four.forward_local > one.forward_local and four.backward_local > one.backward_local
    batched = plan(graph, TINY, name="m", grid=(6, 6), batch=4)
    assert batched.predicted_peak_bytes > planned.predicted_peak_bytes


def test_calls_follow_the_runtime_s_order():
    rows, cols = np.array([0, 1, 1, 2]), np.array([0, 1, 1, 1, 1, 2])
    assert _calls(rows, cols, 3) == (4 * 4, 3, (1, 3), 0)
    # one column: consecutive rows of one class stack
    assert _calls(np.array([0, 1, 1, 1, 1, 1, 2]), np.array([0]), 2) == (5, 2, (1, 2), 0)
    # constant tiles (the right half) run once per class, by themselves; the others stack
    constant = np.zeros((4, 6), dtype=bool)
    constant[:, 3:] = True  # classes (r, 1) and (r, 2) for r in 0, 1, 2: 6 representatives, 6 reused
    assert _calls(rows, cols, 3)[0] == 16
    calls, largest, sizes, reused = _calls(rows, cols, 3, constant)
    assert reused == 12 - 6 and largest == 2  # rows run [0, 1, 1]: 1 + 1 calls
    assert calls == 6 + 4 * 2


def test_compile_takes_batch_with_a_grid_and_refuses_it_with_a_budget(tmp_path):
    model_file = tmp_path / "net.py"
    model_file.write_text("from torch import nn\nINPUT_SHAPE = (1, 3, 40, 40)\n"
                          "def model():\n    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU())\n")
    runner = CliRunner()
    result = runner.invoke(main, ["compile", str(model_file), "--grid", "4x4", "--batch", "2", "--out-dir",
                                  str(tmp_path), "--plan-dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "4x4 (2 per call)" in result.output
    from tilec.planio import load
    assert [s.batch for s in load(tmp_path / "net.plan.json").segments] == [2]
    refused = runner.invoke(main, ["compile", str(model_file), "--memory-budget", "1MiB", "--batch", "2",
                                   "--out-dir", str(tmp_path), "--plan-dir", str(tmp_path)])
    assert refused.exit_code == 2 and refused.output.count("\n") == 1 and "--batch goes with" in refused.output
    zero = runner.invoke(main, ["compile", str(model_file), "--grid", "4x4", "--batch", "0"])
    assert zero.exit_code == 2 and "--batch" in zero.output
