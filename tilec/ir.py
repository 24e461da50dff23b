"""The plan IR: frozen pydantic models, serialised as the versioned plan JSON.

Conventions:

* Shapes are ``(N, C, H, W)``; rows are the H axis, columns the W axis.
* Every ``Interval`` is half-open ``[start, stop)`` in the coordinates of the full (untiled)
  tensor at that layer, serialised as ``[start, stop]``.
* A plan stores its tiles per axis: tile ``(i, j)`` of a segment is the product of
  ``rows[i]`` and ``cols[j]``. This keeps a 64x64 grid at 128 axis entries, not 4096 tiles.
* Layer indices count the flattened ``nn.Sequential`` from 0.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from tilec.regions import Interval, Window

SCHEMA_VERSION = 1

Shape = tuple[int, int, int, int]
AttrValue = bool | int | float | str | None | tuple[int, ...]
Op = Literal["conv2d", "max_pool2d", "avg_pool2d", "pointwise"]


class Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class TensorSpec(Frozen):
    """A parameter or buffer a layer computes with, named as in the model's ``state_dict``."""

    name: str
    shape: tuple[int, ...]
    buffer: bool = Field(description="a buffer (no gradient) rather than a parameter")


class LayerSpec(Frozen):
    """One layer: what the user wrote (``attrs``) and what it means per axis (``rows``/``cols``)."""

    index: int
    path: str = Field(description="dotted path of the layer inside the model")
    type: str = Field(description="torch.nn class name")
    op: Op
    fn: str | None = Field(None, description="pointwise function; None for window layers")
    rows: Window
    cols: Window
    options: dict[str, AttrValue] = Field(description="normalised op arguments")
    attrs: dict[str, AttrValue] = Field(description="module attributes, as the model reports them")
    tensors: tuple[TensorSpec, ...]
    in_shape: Shape
    out_shape: Shape


class ModelFingerprint(Frozen):
    """Everything about the model a plan depends on, and its SHA-256 digest."""

    digest: str
    layers: tuple[LayerSpec, ...]


class AxisStep(Frozen):
    """One layer of one axis tile.

    ``out`` is the layer output computed, ``read`` the (clipped) input slice it reads, ``pad``
    the border padding ``(before, after)`` the tile applies in place of the layer's own.
    ``grad_out`` is the output-gradient interval the tile's backward consumes and ``grad_in``
    the input-gradient interval it produces (scatter-added into the full gradient).
    """

    out: Interval
    read: Interval
    pad: tuple[int, int]
    grad_out: Interval
    grad_in: Interval


class AxisTile(Frozen):
    """Index ``index`` of the grid along one axis: the owned output interval and its cone."""

    index: int
    owned: Interval
    shape_class: int = Field(description="tiles with equal class share generated code")
    steps: tuple[AxisStep, ...]


class Segment(Frozen):
    """A run of layers ``[first, stop)`` with one grid; its output is materialised.

    ``tiled``: forward keeps nothing but its input, backward recomputes tile by tile.
    ``stored``: runs untiled through autograd, keeping activations (grid 1x1, no recompute).
    """

    index: int
    first: int
    stop: int
    grid: tuple[int, int]
    mode: Literal["tiled", "stored"]
    predicted_peak_bytes: int = Field(description="step peak while this segment runs (see Plan)")
    flop_overhead: float = Field(description="tiled forward FLOPs / untiled forward FLOPs - 1")
    estimated_seconds: float = Field(description="estimated time of this segment in one step")
    rows: tuple[AxisTile, ...]
    cols: tuple[AxisTile, ...]


class Plan(Frozen):
    """A tiling plan for one model, one input shape and one segmentation."""

    schema_version: int = SCHEMA_VERSION
    name: str
    input_shape: Shape
    output_shape: Shape
    dtype: Literal["float32", "float64", "bfloat16", "float16"]
    memory_budget: int | None = Field(description="bytes the plan was chosen to fit, if any")
    predicted_peak_bytes: int = Field(
        description="peak bytes the training step allocates above the input, the parameters and the "
        "output gradient: boundary activations, output, gradients, one tile's working set"
    )
    model: ModelFingerprint
    segments: tuple[Segment, ...]

    def segment_of(self, layer: int) -> Segment:
        return next(s for s in self.segments if s.first <= layer < s.stop)
