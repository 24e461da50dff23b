"""The plan IR: frozen pydantic models, serialised as the versioned plan JSON.

Conventions:

* The model is a DAG of ``NodeSpec`` s in one fixed topological (execution) order; a node
  names its tensor inputs (other nodes, or the model's inputs, ``Plan.inputs``) and the
  parameters and buffers it computes with, by their dotted names (``named_parameters``,
  ``named_buffers``: as in its ``state_dict``, where non-persistent buffers are left out).
* The model's inputs are the tensor arguments of its ``forward``, in order, named as its
  parameters are. A 4-D input is (N, C, H, W) and a 3-D one (N, H, W): their last two dims are
  the image's rows and columns; other inputs (per-sample labels) have no image axes.
* A tensor's spatial axes are ``spatial = (row_dim, col_dim)``: ``(2, 3)`` for NCHW, ``(1, 2)``
  after a channels-last permute; ``None`` for a tensor with no image axes (after flatten).
* Every ``Interval`` is half-open ``[start, stop)`` in the coordinates of the full (untiled)
  tensor, serialised as ``[start, stop]``.
* Segments are contiguous runs ``[first, stop)`` of the node order. Every tensor crossing a
  segment boundary is materialised there; one that would be kept for long can instead be
  recomputed: its producers are copied before its late readers (``NodeSpec.recomputes``).
* A plan stores a segment's tiles per axis: tile ``(i, j)`` is the product of ``rows[i]`` and
  ``cols[j]``. This keeps a 64x64 grid at 128 axis entries, not 4096 tiles.
* Modes: ``torch.export`` traces one path through the model's Python, in the modes its modules
  are in. Ops that follow a module's flag at run time (BatchNorm, Dropout modules) serve either
  mode; a forward that branches on ``self.training`` does not. A plan whose graph is the same in
  both modes has ``mode`` null and serves both. Otherwise it is the plan of the mode it was
  traced in (``mode``, the root module's flag; ``flipped``, the other modules in the other
  mode), and ``other`` is the other mode's plan, or ``refused`` says why there is none. A module
  runs a plan only with its modules in the plan's modes (BatchNorm and Dropout modules free).
* Backward regions follow the owned-output strategy the generated code runs: a tile
  back-propagates only its owned output gradient, so every node's output-gradient interval is
  its forward output interval and every input-gradient interval is the interval it read
  (overlapping input gradients are summed).
"""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import BaseModel, ConfigDict, Field

from tilec.regions import Interval

SCHEMA_VERSION = 13

#: How a segment runs: tile by tile, or stored (untiled, through autograd).
SegmentMode = Literal["tiled", "stored"]
SEGMENT_MODES: tuple[str, ...] = get_args(SegmentMode)

#: The most tiles one call stacks, and the most ranks a plan shares its tiles among.
MAX_COUNT = 2**31 - 1


def is_int(value) -> bool:
    """Whether ``value`` is an int and not a bool (``True`` is an int to Python, and a count to no one)."""
    return isinstance(value, int) and not isinstance(value, bool)


Shape = tuple[int, ...]
#: The dtypes a model input may have; the model's own first ops convert it (``x.float() / 255``).
InputDtype = Literal["float32", "float64", "bfloat16", "float16", "uint8", "int8", "int16", "int32", "int64", "bool"]
INPUT_DTYPES = get_args(InputDtype)
#: The floating dtypes a plan trains in (``Plan.dtype``) and autocast computes in.
FloatDtype = Literal["float32", "float64", "bfloat16", "float16"]
FLOAT_DTYPES = get_args(FloatDtype)
Scalar = bool | int | float | str | None
AttrValue = Scalar | tuple[Scalar | tuple[Scalar, ...], ...]


class Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class TensorSpec(Frozen):
    """A parameter or buffer (a non-persistent one too) the model computes with, by its dotted name."""

    name: str
    shape: tuple[int, ...]
    buffer: bool = Field(description="a buffer (no gradient) rather than a parameter")


class InputSpec(Frozen):
    """One tensor argument of the model's ``forward``: its name there, shape and dtype."""

    name: str
    shape: Shape
    dtype: InputDtype

    @property
    def spatial(self) -> tuple[int, int] | None:
        """The dims of its image rows and columns: (2, 3) of (N, C, H, W), (1, 2) of (N, H, W)."""
        return {4: (2, 3), 3: (1, 2)}.get(len(self.shape))


class Arg(Frozen):
    """One positional argument of a node's op: a tensor value, a model tensor, or a constant.

    ``kind`` is ``"node"`` (``value`` names a node or a model input), ``"tensor"`` (``value`` is a
    model tensor's dotted name), ``"nodes"`` (a list of node names, as ``cat`` takes) or ``"const"``.
    """

    kind: Literal["node", "nodes", "tensor", "const"]
    value: AttrValue
    keyword: str | None = Field(None, description="the argument's name when the op takes it by keyword only")


class NodeSpec(Frozen):
    """One op of the traced graph: what it computes and where it came from."""

    name: str = Field(description="unique node name (from torch.export)")
    op: str = Field(description="key of the op in tilec's rule table, e.g. 'conv2d', 'relu', 'add'")
    target: str = Field(description="the functional aten overload the generated code calls")
    path: str = Field(description="dotted path of the module the op came from ('' for the model itself)")
    module_type: str = Field(description="class name of that module")
    args: tuple[Arg, ...]
    inputs: tuple[str, ...] = Field(description="tensor inputs (nodes or model inputs) in argument order")
    shape: Shape = Field(description="output shape (for ops returning a list: each element's shape)")
    spatial: tuple[int, int] | None = Field(description="dims of the output's image rows and columns")
    tileable: bool = Field(description="may run tile by tile; else only in a stored (untiled) segment")
    recomputes: str | None = Field(None, description="the node this one is a copy of, recomputed from the model "
                                                     "input for later readers instead of kept (tilec.recompute)")
    autocast_dtype: FloatDtype | None = Field(
        None, description="the dtype torch.autocast computes the op in, where that differs from the model's "
                          "(plans traced for Plan.autocast)")
    dtype: FloatDtype | None = Field(
        None, description="the floating dtype of the op's result where the model casts to another than its own "
                          "(x.float() in a float64 model); None: the model's (or autocast's)")
    autocast_off: bool = Field(
        False, description="the model computes the op with torch.autocast turned off (a block of its forward "
                           "under torch.autocast(..., enabled=False)); the tiles do too")


class OutputTree(Frozen):
    """How the model's return value is built from nodes: a tensor, a tuple/list, or a mapping."""

    kind: Literal["tensor", "tuple", "list", "dict"]
    node: str | None = None
    keys: tuple[str, ...] = ()
    items: tuple[OutputTree, ...] = ()
    mapping: str | None = Field(
        None, pattern=r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)+$",
        description="for a dict: the model's mapping type when it is not dict, as module.qualname "
                    "(collections.OrderedDict), built from its (key, value) pairs")


class ModelFingerprint(Frozen):
    """Everything about the model a plan depends on, and its SHA-256 digest."""

    digest: str
    tensors: tuple[TensorSpec, ...]
    nodes: tuple[NodeSpec, ...]
    output: OutputTree


class Read(Frozen):
    """What a node reads of one spatial input on one axis: the clipped interval, the border
    padding ``(before, after)`` it applies in place of the clipped part, and the input-gradient
    interval its backward produces (equal to ``read``)."""

    input: str
    read: Interval
    pad: tuple[int, int]
    grad: Interval


class AxisStep(Frozen):
    """One node of one axis tile: its output interval, output-gradient interval, and reads."""

    node: str
    out: Interval
    grad_out: Interval
    reads: tuple[Read, ...]


class AxisTile(Frozen):
    """Index ``index`` of a segment's grid along one axis.

    ``inputs``: per sliced segment input (``Segment.inputs`` order), the interval the tile reads;
    ``owned``: per image output of the segment (``Segment.outputs`` order), the interval the tile
    owns (a partition over the tiles); ``partials``: per reduction (``Segment.reductions``), the
    interval of its reduced inputs the tile's partial covers (a partition over the tiles too).
    """

    index: int
    shape_class: int = Field(description="tiles with equal class share generated code")
    inputs: tuple[Interval, ...]
    owned: tuple[Interval, ...]
    steps: tuple[AxisStep, ...]
    partials: tuple[Interval, ...] = ()


class Level(Frozen):
    """One level of a tiled segment's reductions (``tilec.sweeps``).

    A reduction's level is one more than the highest level of the results its reduced inputs
    depend on in the segment (a reduction of nothing, level 0). Per level, a forward sweep runs the
    tiles up to its reductions' partials; its combine merges them and computes ``small``, the ops
    without image that depend on its results. ``direct``: every reduction reads a segment input, so
    the partials are computed from the input's owned slices without running a tile, and the
    backward sweep is the last one's. ``swept``: tiles read its results, so the backward has a sweep
    for them (unless ``direct``).
    """

    index: int
    reductions: tuple[str, ...]
    small: tuple[str, ...]
    direct: bool
    swept: bool


class SegmentInput(Frozen):
    """A tensor a segment reads from before it: sliced per tile, or passed whole (broadcast)."""

    name: str
    sliced: bool


class Segment(Frozen):
    """Nodes ``[first, stop)`` of the node order with one grid; its outputs are materialised.

    ``tiled``: forward keeps nothing but its inputs, backward recomputes tile by tile; reductions
    over the image run inside it by sweeps (``levels``), and its small outputs are their results.
    ``stored``: runs untiled through autograd, keeping activations (grid 1x1, no recompute).
    """

    index: int
    first: int
    stop: int
    grid: tuple[int, int]
    mode: SegmentMode
    inputs: tuple[SegmentInput, ...]
    outputs: tuple[str, ...]
    predicted_peak_bytes: int = Field(description="step peak while this segment runs (see Plan)")
    flop_overhead: float = Field(description="tiled forward FLOPs / untiled forward FLOPs - 1")
    estimated_seconds: float = Field(description="estimated time of this segment in one step")
    rows: tuple[AxisTile, ...]
    cols: tuple[AxisTile, ...]
    rolled: tuple[str, ...] = Field(
        default=(), description="sliced inputs whose gradient the tiled backward rolls into the input's own storage, "
                                "row of tiles by row of tiles, holding one band of rows instead of a full gradient "
                                "(tilec.cost.Estimator.rollable)")
    levels: tuple[Level, ...] = Field(
        default=(), description="a tiled segment's reductions and small ops by level (tilec.sweeps)")
    shares: tuple[tuple[int, ...], ...] = Field(
        default=(), description="with Plan.ranks, per rank the tiles it runs (row-major indices); else empty")
    rank_seconds: float | None = Field(
        default=None, description="with Plan.ranks, estimated time of this segment on its busiest rank")
    reused: int = Field(
        default=0, ge=0, description="tiles per pass that estimated_seconds counts as computed once for their "
                                     "identical ones (tilec.runtime.reuse): those whose cone reads only background the "
                                     "compile knew of (Plan.backgrounds), all but one per shape class")
    period: tuple[int, int] | None = Field(
        default=None, description="a tiled segment cut with one period over the model's first image input: its "
                                  "tiles' length in that input's pixels (rows, columns), a tensor at stride s in "
                                  "tiles of period / s pixels, the last taking the rest (tilec.regions.Period); "
                                  "null: each tensor split into grid parts (tilec.regions.split)")
    batch: int = Field(
        default=1, ge=1, le=MAX_COUNT, description="a tiled segment's tiles run this many at a time, as one "
                                                   "call on their slices stacked along the batch axis: consecutive "
                                                   "tiles of one shape class (tilec.runtime.batches); 1: one by one")

    @property
    def reductions(self) -> tuple[str, ...]:
        """The segment's reductions, level by level (the order of ``AxisTile.partials``)."""
        return tuple(name for level in self.levels for name in level.reductions)


def segments_text(segments) -> str:
    """A plan's segments (or ``SegmentChoice`` s) as ``--segments`` takes them
    (``tilec.config.parse_segments``): ``ROWSxCOLSpx`` for tiles of one period, ``/BATCH`` where
    more than one tile runs per call, ``:tiled`` after a tiled 1x1 segment."""
    return ",".join(f"{s.first}:{s.stop}@" + (f"{s.period[0]}x{s.period[1]}px" if s.period else
                                              f"{s.grid[0]}x{s.grid[1]}")
                    + (f"/{s.batch}" if s.batch > 1 else "")
                    + (":tiled" if s.mode == "tiled" and tuple(s.grid) == (1, 1) else "") for s in segments)


class Plan(Frozen):
    """A tiling plan for one model, its inputs' shapes and dtypes, and one segmentation."""

    schema_version: int = Field(default=SCHEMA_VERSION, strict=True)
    name: str
    inputs: tuple[InputSpec, ...] = Field(description="the tensor arguments of the model's forward, in order")
    dtype: FloatDtype
    autocast: str | None = Field(
        None, pattern=r"^(cpu|cuda):(bfloat16|float16)$",
        description="DEVICE:DTYPE of the torch.autocast the step runs under, which the memory prediction assumes "
                    "(compile --autocast); the other ops compute in dtype")
    conv_workspace: tuple[tuple[float, float], tuple[float, float]] | None = Field(
        None, description="with autocast: the (forward, backward) bytes a convolution allocates beyond its tensors, "
                          "in multiples of its input's bytes times its kernel taps, in tiles and in stored segments, "
                          "as measured on the autocast device and dtype (tilec.calibrate)")
    speed: tuple[float, float, float] | None = Field(
        None, description="with a memory budget: the rates of the time estimate the search ranked plans by, as "
                          "measured on the device it planned for (tilec.clock): FLOP/s, seconds per op call per tile, "
                          "bytes/s of copies; without one, estimated_seconds assume tilec.cost.REFERENCE_SPEED")
    rates: tuple[tuple[str, float], ...] = Field(
        default=(), description="with a memory budget: FLOP/s per kind of kernel and channel count ('conv@64'), "
                                "as measured on the device it planned for (tilec.clock.kind_rates); kinds not "
                                "listed take speed's FLOP rate")
    gemm_min_channels: int | None = Field(
        ge=1, description="from how many input channels a tile convolution (stride 1, no groups, a kernel larger "
                          "than 1x1, float32 or float64 on CPU) computes its weight gradient as the generated "
                          "module's matrix products instead of the library's; null: never. Raced on the device a "
                          "budget search planned for (tilec.clock.gemm_min_channels), else "
                          "tilec.cost.GEMM_MIN_CHANNELS")
    kernel_state: int = Field(
        description="bytes a process keeps per convolution call shape it runs for the first time (oneDNN's "
                    "primitive cache on CPU), as measured on the device a budget search planned for "
                    "(tilec.calibrate.kernel_state), else tilec.cost.KERNEL_STATE_BYTES")
    memory_budget: int | None = Field(description="bytes the plan was chosen to fit, if any")
    grid: tuple[int, int] | None = Field(
        default=None, description="the grid compile --grid asked for, if any: each tiled segment's grid is it "
                                  "clipped to the segment's outputs' sizes")
    predicted_peak_bytes: int = Field(
        description="peak bytes the first training step of a process allocates above the inputs, the parameters "
        "and the output gradient: boundary activations, outputs, gradients, one tile's working set, the "
        "staging_bytes of inputs read by region, and kernel_state_bytes"
    )
    staging_bytes: int = Field(
        default=0, description="of predicted_peak_bytes, what inputs read by region (arrays on disk, host tensors "
                               "of a device model) hold: per tiled segment, twice its largest tile's slices of "
                               "them (one read ahead while a tile computes), in their own dtypes; the most of any "
                               "segment")
    kernel_state_bytes: int = Field(
        description="of predicted_peak_bytes, the kernel state the first step creates and later steps find: "
                    "kernel_state times the distinct convolution call shapes of the plan; a later step's "
                    "peak above its start is predicted_peak_bytes - kernel_state_bytes")
    model: ModelFingerprint
    segments: tuple[Segment, ...]
    backgrounds: tuple[str, ...] = Field(
        default=(), description="model inputs whose background (where they hold one constant colour: a masked "
                                "slide's) was known when compiling: the estimate counts the tiles computed once "
                                "(Segment.reused), and a budget search chose the plan knowing it")
    ranks: int | None = Field(
        default=None, ge=1, le=MAX_COUNT, description="ranks of a process group sharing each tiled segment's "
        "tiles (compile --ranks); every rank holds the full boundary tensors, so its peak is predicted_peak_bytes")

    mode: Literal["train", "eval"] | None = Field(
        default=None, description="null: the graph is the same in training and eval mode (up to the ops that follow "
                                  "a module's flag at run time), and the plan serves both; else the mode of the model "
                                  "(its root module's flag) it was traced in, which it runs only in")
    flipped: tuple[str, ...] = Field(
        default=(), description="with mode: the modules (paths) that were in the other mode than the root when the "
                                "plan was traced, BatchNorm and Dropout modules aside")
    other: Plan | None = Field(
        default=None, description="with mode: the plan of the other mode, whose graph differs (its own other null)")
    refused: str | None = Field(
        default=None, description="with mode and no other: why the other mode has no plan (a run in it is refused)")

    def node(self, name: str) -> NodeSpec:
        return next(n for n in self.model.nodes if n.name == name)

    def segment_of(self, position: int) -> Segment:
        return next(s for s in self.segments if s.first <= position < s.stop)

    def recomputed_cones(self) -> dict[str, list[str]]:
        """Per recomputed cone (keyed by its copies' suffix ``_recomputed<k>``), the nodes it copies,
        the recomputed node last."""
        cones: dict[str, list[str]] = {}
        for node in self.model.nodes:
            if node.recomputes is not None:
                cones.setdefault(node.name[len(node.recomputes):], []).append(node.recomputes)
        return cones

    def planned_as(self) -> tuple[str, tuple[str, ...]]:
        """What plans this segmentation again, at this or another input size: the segments as
        ``--segments`` takes them and the nodes whose late readers read a recomputed copy, as
        ``--recompute`` names them (``recomputed_cones``, in their copies' order)."""
        return segments_text(self.segments), tuple(cone[-1] for cone in self.recomputed_cones().values())
