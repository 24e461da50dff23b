"""The table of supported layers: how each ``torch.nn`` type becomes a ``LayerSpec``.

Each entry turns a module into its op, its two per-axis ``Window`` s (the halo rule: see
``Window.input_interval``), normalised options, and the module attributes that fingerprint it.
Pointwise layers use the identity window. Types are matched exactly, not by subclass, so a
user subclass with its own ``forward`` is refused rather than silently mis-compiled.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from tilec.errors import UnsupportedLayerError
from tilec.regions import Window


@dataclass(frozen=True)
class Semantics:
    """What a layer means, independent of where it sits."""

    op: str
    fn: str | None
    rows: Window
    cols: Window
    options: dict


@dataclass(frozen=True)
class Entry:
    attrs: tuple[str, ...]
    semantics: Callable[[nn.Module], Semantics]
    eval_only: bool = False


def _pair(value) -> tuple[int, int]:
    return (value, value) if isinstance(value, int) else (int(value[0]), int(value[1]))


def _identity(fn: str, **options) -> Callable[[nn.Module], Semantics]:
    def semantics(module: nn.Module) -> Semantics:
        values = {key: getattr(module, attr) for key, attr in options.items()}
        if getattr(module, "inplace", False):
            values["inplace"] = True  # untiled (stored), autograd then saves the result instead
        return Semantics("pointwise", fn, Window(), Window(), values)

    return semantics


def _conv(module: nn.Conv2d) -> Semantics:
    if module.padding_mode != "zeros":
        raise ValueError(f"padding_mode={module.padding_mode!r} is not supported (only 'zeros')")
    kernel, stride, dilation = (_pair(v) for v in (module.kernel_size, module.stride, module.dilation))
    windows = []
    for axis in range(2):
        if module.padding == "same":
            total = dilation[axis] * (kernel[axis] - 1)
            before, after = total // 2, total - total // 2
        elif module.padding == "valid":
            before = after = 0
        else:
            before = after = _pair(module.padding)[axis]
        windows.append(Window(kernel[axis], stride[axis], dilation[axis], before, after))
    options = {"groups": module.groups, "bias": module.bias is not None}
    return Semantics("conv2d", None, windows[0], windows[1], options)


def _pool_windows(module, dilation) -> tuple[Window, Window]:
    kernel = _pair(module.kernel_size)
    stride = _pair(module.stride if module.stride is not None else module.kernel_size)
    padding = _pair(module.padding)
    if any(2 * padding[a] > kernel[a] for a in range(2)):
        raise ValueError(f"padding {module.padding} exceeds half the kernel size {module.kernel_size}")
    return tuple(
        Window(kernel[a], stride[a], dilation[a], padding[a], padding[a], bool(module.ceil_mode))
        for a in range(2)
    )


def _max_pool(module: nn.MaxPool2d) -> Semantics:
    if module.return_indices:
        raise ValueError("return_indices=True is not supported (the layer returns a tuple)")
    rows, cols = _pool_windows(module, _pair(module.dilation))
    return Semantics("max_pool2d", None, rows, cols, {})


def _avg_pool(module: nn.AvgPool2d) -> Semantics:
    rows, cols = _pool_windows(module, (1, 1))
    options = {
        "count_include_pad": bool(module.count_include_pad),
        "divisor_override": module.divisor_override,
    }
    return Semantics("avg_pool2d", None, rows, cols, options)


def _batch_norm(module: nn.BatchNorm2d) -> Semantics:
    if module.running_mean is None:
        raise ValueError(
            "track_running_stats=False normalises with batch statistics, which need the whole image"
        )
    return Semantics("pointwise", "batch_norm", Window(), Window(), {"eps": module.eps})


TABLE: dict[type, Entry] = {
    nn.Conv2d: Entry(
        ("in_channels", "out_channels", "kernel_size", "stride", "padding", "dilation", "groups",
         "padding_mode"),
        _conv,
    ),
    nn.MaxPool2d: Entry(("kernel_size", "stride", "padding", "dilation", "ceil_mode"), _max_pool),
    nn.AvgPool2d: Entry(
        ("kernel_size", "stride", "padding", "ceil_mode", "count_include_pad", "divisor_override"),
        _avg_pool,
    ),
    nn.ReLU: Entry((), _identity("relu")),
    nn.ReLU6: Entry((), _identity("hardtanh", min_val="min_val", max_val="max_val")),
    nn.Hardtanh: Entry(("min_val", "max_val"), _identity("hardtanh", min_val="min_val", max_val="max_val")),
    nn.LeakyReLU: Entry(("negative_slope",), _identity("leaky_relu", negative_slope="negative_slope")),
    nn.ELU: Entry(("alpha",), _identity("elu", alpha="alpha")),
    nn.GELU: Entry(("approximate",), _identity("gelu", approximate="approximate")),
    nn.SiLU: Entry((), _identity("silu")),
    nn.Sigmoid: Entry((), _identity("sigmoid")),
    nn.Tanh: Entry((), _identity("tanh")),
    nn.Hardswish: Entry((), _identity("hardswish")),
    nn.Identity: Entry((), _identity("identity")),
    nn.Dropout: Entry((), _identity("identity"), eval_only=True),
    nn.Dropout2d: Entry((), _identity("identity"), eval_only=True),
    nn.BatchNorm2d: Entry(("num_features", "eps", "affine", "track_running_stats"), _batch_norm,
                          eval_only=True),
}

#: What each pointwise function's backward kernel needs: its input, its output, or nothing.
SAVES = {
    "relu": "output", "hardtanh": "output", "sigmoid": "output", "tanh": "output",
    "leaky_relu": "input", "elu": "input", "gelu": "input", "silu": "input",
    "hardswish": "input", "batch_norm": "input", "identity": "none",
}



def saves(layer) -> str:
    """What a pointwise layer's backward kernel reads: ``input``, ``output`` or ``none``.

    LeakyReLU with a slope >= 0 keeps the input's sign, so its backward can read the output
    (``leaky_relu_backward(..., self_is_result=True)``) and it can run in place.
    """
    if layer.fn == "leaky_relu" and layer.options["negative_slope"] >= 0:
        return "output"
    return SAVES[layer.fn]


def may_run_in_place(layer) -> bool:
    """May the tile run this pointwise layer in place? Every function whose backward reads its
    output has an in-place aten variant."""
    return layer.op == "pointwise" and saves(layer) == "output"

#: Why the common untileable layers are refused.
REFUSALS = {
    nn.Linear: "it mixes every spatial position; keep it in an untiled tail after the tiled model",
    nn.Flatten: "it mixes every spatial position; keep it in an untiled tail after the tiled model",
    nn.AdaptiveAvgPool2d: "global pooling reduces over the whole image",
    nn.AdaptiveMaxPool2d: "global pooling reduces over the whole image",
    nn.Upsample: "upsampling is not supported yet",
    nn.ConvTranspose2d: "transposed convolution is not supported yet",
}


def lookup(path: str, module: nn.Module) -> tuple[Entry, Semantics]:
    """Find the table entry for ``module`` and interpret it, or explain the refusal."""
    kind = type(module).__name__
    entry = TABLE.get(type(module))
    if entry is None:
        reason = REFUSALS.get(type(module), "tilec has no tiling rule for this layer type")
        raise UnsupportedLayerError(f"layer {path} ({kind}) is not supported: {reason}")
    if entry.eval_only and module.training and not (isinstance(module, nn.Dropout | nn.Dropout2d)
                                                     and module.p == 0):
        raise UnsupportedLayerError(
            f"layer {path} ({kind}) is in training mode: tilec tiles it only in eval mode "
            f"(its statistics or random mask span the whole image): call model.eval() before compiling"
        )
    try:
        return entry, entry.semantics(module)
    except ValueError as error:
        raise UnsupportedLayerError(f"layer {path} ({kind}) is not supported: {error}") from None
