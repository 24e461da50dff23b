"""``TiledModel(model, kernels="compiled")``: every tile function compiled by ``torch.compile``
(``tilec.runtime.compiled``) gives untiled PyTorch's outputs, gradients and buffers in float64;
dynamo traces the tiles whole (no graph break); where compiling fails, each segment says so once
and its tiles run uncompiled, as exactly. ``kernels="cudagraphs"`` and ``"reduce-overhead"``:
what a replay writes over is never read again (a stand-in with CUDA graphs' memory on the CPU),
where no CUDA graph is captured (the CPU) each segment says so once, and the tile functions
as torch's CUDA graph backend gets them mutate no input and hold no op it cannot capture."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
from test_reuse import SHAPE, Slide, _compare, _seeded, _slide
from torch import nn
from torch._dynamo.utils import counters

from tilec.pipeline import build
from tilec.runtime.compiled import Origins
from tilec.runtime.dropout import counter_dropout, op_key, step_stream
from tilec.trace import trace

from support.exactness import TOLERANCE, check_exact
from support.zoo import TRAIN_SHAPES, TRAIN_ZOO, dropout_segmenter


def test_compiled_tiles_equal_untiled_in_float64():
    """MONAI's BasicUNet in training mode: instance norm by sweeps (moments by ``var_mean``), max
    pooling and LeakyReLU in place in the forms dynamo traces, transposed convolutions,
    concatenated skips; two shape classes (each compiles in several variants: some 50 s)."""
    torch._dynamo.reset()
    counters.clear()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="tilec: torch.compile failed")
        check_exact(TRAIN_ZOO["basic_unet"](), TRAIN_SHAPES["basic_unet"], grid=(2, 1), kernels="compiled")
    assert counters["stats"]["unique_graphs"] > 0
    assert not counters["graph_break"], dict(counters["graph_break"])


def _compile_raising(error):
    """A stand-in for ``torch.compile`` whose compiled functions raise ``error`` when called."""
    def compile(fn, **options):
        def compiled(*args):
            raise error
        return compiled

    return compile


def test_a_tile_function_that_does_not_compile_runs_uncompiled_and_says_so_once(monkeypatch):
    monkeypatch.setattr(torch, "compile", _compile_raising(torch._dynamo.exc.TorchDynamoException("no C++ compiler")))
    model, shape = TRAIN_ZOO["resnet_head"](), TRAIN_SHAPES["resnet_head"]
    with pytest.warns(RuntimeWarning, match="torch.compile failed") as caught:
        check_exact(model, shape, grid=(2, 3), kernels="compiled")
    said = [str(w.message) for w in caught if "torch.compile failed" in str(w.message)]
    assert said and len(said) == len(set(said)), said  # once per segment
    for line in said:
        assert re.fullmatch(r"tilec: torch.compile failed on segment \d+ \(no C\+\+ compiler\); its tiles run "
                            r"uncompiled", line), line


def test_other_errors_in_a_compiled_tile_are_raised(monkeypatch):
    monkeypatch.setattr(torch, "compile", _compile_raising(RuntimeError("out of memory")))
    with pytest.raises(RuntimeError, match="out of memory"):
        check_exact(TRAIN_ZOO["resnet_head"](), TRAIN_SHAPES["resnet_head"], grid=(2, 1), kernels="compiled")


#: The stand-in's memory, by what was written there: a call's output, a gradient of an input.
_REPLAYED = {}


#: ``torch.compile``'s options that capture CUDA graphs, per ``kernels`` choice.
GRAPHS = {"cudagraphs": {"backend": "cudagraphs"}, "reduce-overhead": {"mode": "reduce-overhead"}}


def _replaying(fn, dynamic=None, **options):
    """A stand-in for ``torch.compile(fn, ...)`` with ``GRAPHS``' options, with CUDA graphs' memory on the
    CPU: what any call returned, and the gradients its backward handed on, live in memory that the
    next call (of any function) writes over with garbage, as the next replay would; a gradient of
    a model tensor or leaf is handed on as a fresh tensor in that memory, which autograd may keep
    as the tensor's ``grad`` as it is."""
    assert options in GRAPHS.values(), options

    def static(key, t):
        buffer = _REPLAYED.get(key)
        if buffer is None or buffer.shape != t.shape or buffer.dtype != t.dtype or buffer.stride() != t.stride():
            buffer = _REPLAYED[key] = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype)
        return buffer.copy_(t).view_as(buffer)

    class Replayed(torch.autograd.Function):
        @staticmethod
        def forward(ctx, key, t):
            ctx.key = key
            return t.view_as(t)

        @staticmethod
        def backward(ctx, g):
            return None, static(("grad", *ctx.key), g)

    def routed(key, value):
        if isinstance(value, torch.Tensor):
            return Replayed.apply(key, value) if value.requires_grad else value
        if isinstance(value, (tuple, list)):
            return type(value)(routed((*key, k), v) for k, v in enumerate(value))
        return value

    def returned(key, value):
        if isinstance(value, torch.Tensor):
            return static(key, value)
        if isinstance(value, (tuple, list)):
            return type(value)(returned((*key, k), v) for k, v in enumerate(value))
        return value

    def compiled(xs, bs, p, arena, r, *rest):
        for buffer in _REPLAYED.values():  # the previous call's results are dead
            buffer.fill_(float("nan") if buffer.is_floating_point() else -7)
        r = {name: routed(("r", name), value) for name, value in r.items()}
        found = fn(routed(("x",), xs), routed(("b",), bs), routed(("p",), p), arena, r, *rest)
        return found if torch.is_grad_enabled() else returned(("out",), found)

    return compiled


@pytest.mark.parametrize(("name", "grid", "batch", "kernels"), [
    ("resnet_head", (2, 3), None, "cudagraphs"), ("resnet_head", (3, 3), 2, "reduce-overhead"),
    ("segmentation_loss", (3, 2), None, "cudagraphs")])
def test_cuda_graph_tiles_keep_nothing_a_replay_overwrites(monkeypatch, name, grid, batch, kernels):
    """CUDA graphs' kernels in float64 with a stand-in whose replays write over what earlier
    calls returned: the runtime copies the partials it merges and keeps, and gives the leaves a
    ``grad`` of their own to accumulate into, so the step stays exact (training-mode BatchNorm by
    sweeps, a classifier head, tiles one by one and stacked two per call; a per-pixel loss)."""
    monkeypatch.setattr(torch, "compile", _replaying)
    _REPLAYED.clear()
    check_exact(TRAIN_ZOO[name](), TRAIN_SHAPES[name], grid=grid, batch=batch, kernels=kernels)
    assert _REPLAYED


def test_cuda_graph_tiles_reuse_background_tiles_exactly(monkeypatch):
    """The same stand-in on a uint8 slide, mostly background, through two training-mode segments
    (``test_reuse``): reused tiles' partials, leaf sweeps, and input gradients apart stay exact."""
    monkeypatch.setattr(torch, "compile", _replaying)
    _REPLAYED.clear()
    model = _seeded(Slide(nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
        nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 2, 3, padding=1))), train=True)
    count = len(trace(model, [(SHAPE, "uint8")]))
    tiled = build(model, [(SHAPE, "uint8")], segments=[(0, count - 4, (6, 5)), (count - 4, count, (6, 5))],
                  dtype="float64", kernels="cudagraphs")
    errors = _compare(model, tiled, [_slide()])
    assert max(errors.values()) <= TOLERANCE, errors
    assert all(reused > 0 for _, reused in tiled.reuse.passes.values()), tiled.reuse.passes
    assert _REPLAYED


@pytest.mark.parametrize("kernels", ["cudagraphs", "reduce-overhead"])
def test_cuda_graphs_skipped_are_said_once_per_segment(kernels):
    """On the CPU no CUDA graph is captured: each segment says so once, and its tiles run compiled,
    as exactly."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 2, 3, padding=1))
    with pytest.warns(RuntimeWarning, match="CUDA graphs skipped") as caught:
        check_exact(model, (1, 3, 11, 9), segments=[(0, 2, (2, 1)), (2, 3, (1, 2))], kernels=kernels)
    said = [str(w.message) for w in caught if "CUDA graphs skipped" in str(w.message)]
    assert len(said) == len(set(said)) == 2, said
    for line in said:
        assert re.fullmatch(r"tilec: CUDA graphs skipped on segment \d+ \(TORCH_LOGS=cudagraphs says why\); its "
                            r"tiles run compiled without them", line), line


def _positional_steps(grid, seeds):
    """Steps of a model whose tiles read their origins with ``kernels="compiled"`` (dynamo alone)
    on ``grid``, each compared with plain PyTorch under the same masks; the unique graphs dynamo
    made by the end of each step."""
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.Dropout(0.3), nn.Conv2d(4, 4, 3, padding=1),
                          nn.AdaptiveMaxPool2d(1), nn.Flatten(), nn.Linear(4, 2)).double().train()
    x = torch.randn(1, 3, 24, 24, dtype=torch.float64)
    tiled = build(model, tuple(x.shape), grid, dtype="float64", kernels="compiled")
    graphs = []
    for seed in seeds:
        torch.manual_seed(seed)
        out = tiled(x)
        out.sum().backward()
        grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        torch.manual_seed(seed)
        with counter_dropout(model):
            want = model(x)
        want.sum().backward()
        assert (out - want).abs().max().item() < TOLERANCE
        for got, p in zip(grads, model.parameters(), strict=True):
            assert (got - p.grad).abs().max().item() < TOLERANCE
        model.zero_grad()
        graphs.append(counters["stats"]["unique_graphs"])
    assert not counters["graph_break"], dict(counters["graph_break"])
    return graphs


def test_tiles_reading_their_origins_trace_whole_once_for_every_step_and_position(monkeypatch):
    """Element-wise dropout (the step's seed, the tile's origin) and global max pooling with
    indices (the first maximum's position): dynamo (alone, ``backend="eager"``) traces each tile
    function whole, once for every seed and origin: a 4x4 grid (2 tiles of each edge class, 4 of
    the inner one) makes as many graphs as a 3x3 grid of the same 9 classes, however many steps.
    Three steps with three seeds equal plain PyTorch's under the same masks."""
    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **options: compile_(fn, backend="eager", dynamic=False))
    single = _positional_steps((3, 3), [0])
    graphs = _positional_steps((4, 4), [0, 1, 2])
    assert single[0] > 0 and graphs == single * 3, (single, graphs)


def _capturable(found):
    """A backend for ``torch.compile`` that records, for each graph autograd makes of a tile
    function (forward, backward, and without gradients), the inputs it mutates (inference graphs
    keep their mutations, as inductor's do) and its first op CUDA graphs cannot capture (one with
    an output of data-dependent shape), as inductor and torch's backend "cudagraphs" check them
    before capturing (the device aside), and runs the graphs as they are."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.backends.cudagraphs import find_input_mutations
    from torch._dynamo.backends.debugging import boxed_nop
    from torch._inductor.utils import count_tangents, get_first_incompatible_cudagraph_node, num_fw_fixed_arguments

    def backend(graph, inputs):
        def check(fixed, aot_graph, aot_inputs):
            mutated = find_input_mutations(aot_graph.graph) - set(range(fixed))
            found.append((sorted(mutated), get_first_incompatible_cudagraph_node(aot_graph)))
            return boxed_nop(aot_graph, aot_inputs)

        def forward(aot_graph, aot_inputs, is_inference=False):
            return check(num_fw_fixed_arguments(len(inputs), len(aot_inputs)), aot_graph, aot_inputs)

        return aot_autograd(fw_compiler=forward, inference_compiler=forward, keep_inference_input_mutations=True,
                            bw_compiler=lambda g, i: check(count_tangents(g), g, i))(graph, inputs)

    compile = torch.compile
    return lambda fn, **options: compile(fn, dynamic=False, backend=backend)


@pytest.mark.parametrize(("name", "grid", "batch"), [("resnet_head", (3, 2), None), ("resnet_head", (3, 3), 2),
                                                     ("segmentation_loss", (3, 2), None),
                                                     ("efficientnet_drop", (2, 2), None)])
def test_tile_functions_can_be_captured_as_cuda_graphs(monkeypatch, name, grid, batch):
    """What keeps a graph from being captured on CUDA, but for its device, shows on the CPU: every
    forward and backward graph of every tile function (training-mode BatchNorm by sweeps, stacked
    tiles, a per-pixel loss, squeeze-and-excitation with stochastic depth and Dropout2d) mutates
    no input and holds no op CUDA graphs cannot capture, and the step stays exact."""
    torch._dynamo.reset()
    counters.clear()
    found = []
    monkeypatch.setattr(torch, "compile", _capturable(found))
    check_exact(TRAIN_ZOO[name](), TRAIN_SHAPES[name], grid=grid, batch=batch, kernels="cudagraphs")
    assert len(found) >= 4 and all(checked == ([], None) for checked in found), found
    assert not counters["graph_break"], dict(counters["graph_break"])


def test_tiles_reading_their_origins_can_be_captured_as_cuda_graphs(monkeypatch):
    """DeepLabV3's and FCN's heads with element-wise Dropout in training mode: each tile reads its
    origins and the dropout's stream, which are tensors on the tiles' device (CUDA graphs capture no
    graph holding a CPU tensor); every graph passes the capture check, and the step is exact."""
    torch._dynamo.reset()
    counters.clear()
    found = []
    monkeypatch.setattr(torch, "compile", _capturable(found))
    check_exact(dropout_segmenter(), (2, 3, 17, 15), grid=(2, 2), kernels="cudagraphs", counter=True)
    assert len(found) >= 4 and all(checked == ([], None) for checked in found), found
    assert not counters["graph_break"], dict(counters["graph_break"])


def test_origins_and_streams_are_made_on_the_tiles_device():
    """What a positional tile reads besides its slices is on the slices' device, one tensor per
    value and place among its origins."""
    origins = Origins()
    made = origins.of([(3, 3), (3, 0)], torch.device("meta"))
    assert [t.device.type for pair in made for t in pair] == ["meta"] * 4
    assert len({id(t) for pair in made for t in pair}) == 4  # no two places share one
    assert made[0][0] is origins.of([(3, 7)], torch.device("meta"))[0][0]
    assert [t.item() for t in origins.of([(3, 5)], torch.device("cpu"))[0]] == [3, 5]
    assert step_stream({}, op_key("head", 0), True, torch.device("meta")).device.type == "meta"


def test_a_segment_of_many_levels_compiles_every_variant(monkeypatch):
    """MONAI's BasicUNet as one tiled segment: its instance norms make 10 levels of sweeps, and
    each level's backward sweep calls a tile function with other tensors wanting gradients, a
    variant of its own (12 for each class, where dynamo's limit is 8). The segment raises the limit
    to what its plan needs, so that dynamo (alone, ``backend="eager"``) compiles every call and
    runs none uncompiled; exact in float64."""
    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **options: compile_(fn, backend="eager", dynamic=False))
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 8)
    torch._dynamo.reset()
    counters.clear()
    model, shape = TRAIN_ZOO["basic_unet"](), TRAIN_SHAPES["basic_unet"]
    check_exact(model, shape, segments=[(0, len(trace(model, shape)), (2, 1))], kernels="compiled")
    assert counters["frames"]["total"] == counters["frames"]["ok"] > 0, dict(counters)
    assert not counters["unimplemented"] and not counters["graph_break"], dict(counters)
