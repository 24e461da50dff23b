"""``PlanSpec``, what a generated module knows of its plan, and the checks a ``TiledModel`` makes
of what it is given: the model, its modes, the inputs, autocast, a process group and a plan file.
Each raises one ``ValueError`` line naming what differs (or warns, for autocast)."""

import hashlib
import json
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tilec.runtime.sources import DTYPES, dtype_name


@dataclass(frozen=True)
class PlanSpec:
    """The plan a generated module runs.

    ``name``, ``digest`` (of the model), ``schema_version``, ``inputs``: per tensor argument of the
    model's forward ``(name, shape, dtype name)``; ``ranks``: the process
    group size it shares its tiles among (``None``: any); ``autocast``: ``"DEVICE:DTYPE"`` of the
    ``torch.autocast`` it budgets the step under, or ``None``; ``gemm_min_channels``: the weight
    gradient race's choice (``tilec.runtime.device``); ``tensors``: every parameter and buffer
    ``(dotted name, shape, is buffer)``; ``modules``: ``(path, class name)`` of the modules the
    ops came from; ``eval_only``: modules inside tiled segments that must be in eval mode;
    ``train_paths``: modules whose training flag untiled segments follow; ``batch_norm_paths``:
    BatchNorm modules (mode, momentum, batch counter); ``segments``: per segment ``(first node,
    stop node, grid)``; ``planned_as``: ``(segments, recomputed)``, the segments as ``--segments``
    takes them and the nodes recomputed for their late readers (``tilec.compile(..., like=)``
    plans another input size so); ``mode``: ``None`` where the plan serves both modes, else the mode
    (``"train"`` or ``"eval"``) it was traced in, with the modules ``flipped`` in the other
    (``follows_mode`` modules aside); ``refused``: why the other mode has no plan, if it has none.
    """

    name: str
    digest: str
    schema_version: int
    inputs: tuple
    ranks: object
    autocast: object
    gemm_min_channels: object
    tensors: tuple
    modules: tuple
    eval_only: tuple
    train_paths: tuple
    batch_norm_paths: tuple
    segments: tuple
    planned_as: tuple
    mode: object = None
    flipped: tuple = ()
    refused: object = None


def follows_mode(module):
    """Whether ``module``'s ops follow its training flag at run time (BatchNorm's statistics,
    Dropout's mask), so that its mode does not change the traced graph."""
    return isinstance(module, (torch.nn.modules.batchnorm._BatchNorm, torch.nn.modules.dropout._DropoutNd))


def mode_name(training):
    """``"training"`` or ``"eval"``, as a message names a module's mode."""
    return "training" if training else "eval"


def choose_mode(plan, other, model):
    """Which of ``plan`` and ``other`` (the other mode's ``PlanSpec``, or ``None``) runs ``model``
    in the mode its modules are in: ``plan`` where it serves both modes, else the one traced in
    the model's (its root module's) mode, whose modules must all be in the modes they were traced
    in; raise ValueError naming the model's mode or the first module in another."""
    if plan.mode is None:
        return plan
    training = model.training
    chosen = plan if (plan.mode == "train") == training else other
    if chosen is None:
        raise ValueError(f"the model is in {mode_name(training)} mode, but plan {plan.name!r} has a "
                         f"{mode_name(not training)}-mode graph only: {plan.refused}")
    for path, module in model.named_modules():
        traced = training != (path in chosen.flipped)
        if module.training != traced and not follows_mode(module):
            raise ValueError(f"module {path or '(the model)'} ({type(module).__name__}) is in "
                             f"{mode_name(module.training)} mode, but the {mode_name(training)}-mode plan "
                             f"{plan.name!r} was traced with it in {mode_name(traced)} mode, and the model's forward "
                             f"takes another path in each: put the model's modules in one mode (.train() or .eval())")
    return chosen


def named_tensors(model):
    """The model's parameters and buffers by dotted name, duplicates and non-persistent buffers included."""
    found = dict(model.named_parameters(remove_duplicate=False))
    found.update(model.named_buffers(remove_duplicate=False))
    return found


def check_model(plan, model):
    """Raise ValueError naming what differs from the plan; else return nothing."""
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"plan {plan.name!r} needs a torch.nn.Module, got {type(model).__name__}")
    found = named_tensors(model)
    for name, shape, _ in plan.tensors:
        if name not in found:
            raise ValueError(f"the model has no parameter or buffer {name!r}, which plan {plan.name!r} uses")
        if tuple(found[name].shape) != shape:
            raise ValueError(f"{name} has shape {tuple(found[name].shape)}, plan {plan.name!r} has {shape}")
    modules = dict(model.named_modules())
    for path, kind in plan.modules:
        module = modules.get(path)
        if module is None:
            raise ValueError(f"the model has no module {path!r} ({kind}), which plan {plan.name!r} uses")
        if path and type(module).__name__ != kind:
            raise ValueError(f"module {path} is a {type(module).__name__}, plan {plan.name!r} has a {kind}")


def model_tensors(plan, model):
    """The model's tensors in the plan's ``tensors`` order."""
    found = named_tensors(model)
    return [found[name] for name, _, _ in plan.tensors]


def check_modes(plan, modules):
    """Raise ValueError if a module the plan tiles as compiled in eval mode is in training mode."""
    for path in plan.eval_only:
        module = modules[path]
        if module.training and getattr(module, "p", 1) != 0:
            raise ValueError(
                f"module {path} ({type(module).__name__}) is in training mode, but plan {plan.name!r} tiles it as "
                f"compiled in eval mode: compile the plan with the module in training mode, or call .eval() on it"
            )


def batch_norm_mode(module):
    """``(batch statistics?, momentum)`` as ``nn.BatchNorm`` passes them to ``batch_norm`` in this
    step; counts the batch in ``num_batches_tracked`` when it trains with running statistics."""
    batch_stats = module.training or module.running_mean is None
    momentum = 0.0 if module.momentum is None else module.momentum
    if module.training and module.track_running_stats:
        module.num_batches_tracked.add_(1)
        if module.momentum is None:
            momentum = 1.0 / float(module.num_batches_tracked)
    return batch_stats, momentum


def check_inputs(plan, inputs, tensors):
    """Raise ValueError naming the first of ``inputs`` this plan cannot serve with these tensors:
    a tensor or an array-like (``shape``, ``dtype``, slicing) of the plan's shape and dtype; a
    floating input in the model's floating dtype (the plan's, or the one it was moved to)."""
    if len(inputs) != len(plan.inputs):
        names = ", ".join(name for name, _, _ in plan.inputs)
        raise ValueError(f"plan {plan.name!r} takes {len(plan.inputs)} input(s) ({names}), got {len(inputs)}")
    model = next((t.dtype for t in tensors if t.is_floating_point()), None)
    for (name, shape, dtype), x in zip(plan.inputs, inputs, strict=True):
        if not isinstance(x, torch.Tensor) and not all(hasattr(x, a) for a in ("shape", "dtype", "__getitem__")):
            raise ValueError(f"input {name!r} must be a torch.Tensor or an array with shape, dtype and slicing, "
                             f"got {type(x).__name__}")
        if tuple(x.shape) != shape:
            raise ValueError(f"input {name!r} has shape {tuple(x.shape)}, plan {plan.name!r} needs {shape}")
        found = dtype_name(x)
        floating = found in DTYPES and DTYPES[found].is_floating_point
        if not DTYPES[dtype].is_floating_point and found != dtype or DTYPES[dtype].is_floating_point and not floating:
            raise ValueError(f"input {name!r} is {found}, plan {plan.name!r} needs {dtype} (the model's own first "
                             f"ops convert it)")
        if DTYPES[dtype].is_floating_point and model is not None and DTYPES[found] != model:
            raise ValueError(f"input {name!r} is {found} but the model's tensors are "
                             f"{str(model).removeprefix('torch.')}; move one to match the other")


def check_devices(inputs, tensors, device):
    """Raise ValueError if a tensor input is on another device than ``device`` (the model's),
    other than the host: host inputs of a device model are read by region."""
    for name, x in inputs:
        if isinstance(x, torch.Tensor) and x.device != device and x.device.type != "cpu":
            raise ValueError(f"input {name!r} is on {x.device} but the model's tensors are on {device}; move one "
                             f"to match the other")


def check_autocast(plan, place):
    """Warn when a plan budgeted for autocast trains without it on device ``place``: its
    activations then take up to twice the bytes the plan counts."""
    if plan.autocast is None or not torch.is_grad_enabled():
        return
    device, dtype = plan.autocast.split(":")
    if (place.type != device or not torch.is_autocast_enabled(device)
            or torch.get_autocast_dtype(device) != getattr(torch, dtype)):
        warnings.warn(f"plan {plan.name!r} budgets the step under torch.autocast({device!r}, dtype=torch.{dtype}) "
                      f"(compile --autocast {plan.autocast}); without it the step may exceed the budget", stacklevel=3)


def agree(group, values, what):
    """Raise ValueError unless every rank of ``group`` holds these float64 ``values``."""
    mine = torch.tensor(values, dtype=torch.float64)
    found = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(found, mine, group=group)
    for rank, theirs in enumerate(found):
        if not torch.allclose(theirs, mine, rtol=1e-9, atol=0.0):
            raise ValueError(f"rank {dist.get_rank(group)} and rank {rank} of the process group hold different {what}")


def check_group(plan, group):
    """Raise ValueError unless ``group`` has the plan's number of ranks (if it names one) and
    every rank of it runs this plan (model digest, inputs, segments)."""
    size = dist.get_world_size(group)
    if plan.ranks is not None and size != plan.ranks:
        raise ValueError(f"the process group has {size} ranks, but plan {plan.name!r} was compiled for "
                         f"--ranks {plan.ranks}")
    digest = hashlib.sha256(repr((plan.digest, plan.inputs, plan.segments)).encode()).hexdigest()
    # 13 hex digits are 52 bits: exact in the float64 the ranks compare
    agree(group, [float(int(digest[:13], 16))], "plans (compile the same model with the same options on every rank)")


def check_same_tensors(group, tensors):
    """Raise ValueError unless every rank of ``group`` holds the same parameters (a checksum)."""
    with torch.no_grad():
        checksum = sum(float(t.double().sum()) for t in tensors if t.is_floating_point())
    agree(group, [checksum], "parameters (load the same weights on every rank)")


def check_same_input(group, x, chunk=1 << 22):
    """Raise ValueError unless every rank of ``group`` was given the same tensor input: its sum and its
    sum weighted by position (1 at the first element to 2 at the last), in float64, computed
    ``chunk`` elements at a time so that no full-size copy of the image is made."""
    flat = x.detach().reshape(-1)
    scale = 1.0 / max(1, flat.numel() - 1)
    total = weighted = 0.0
    with torch.no_grad():
        for start in range(0, flat.numel(), chunk):
            part = flat[start:start + chunk].double()
            weights = torch.arange(start, start + len(part), dtype=torch.float64, device=part.device) * scale + 1
            total += float(part.sum())
            weighted += float((part * weights).sum())
    agree(group, [total, weighted], "inputs (every rank of a tile group must be given the same image)")


def check_plan_file(plan, path):
    """Raise ValueError unless the plan JSON file at ``path`` is ``plan``: compares
    schema_version, model digest, inputs and each segment's nodes and grid, using only
    the standard library."""
    try:
        with open(path, encoding="utf-8") as stream:
            data = json.load(stream)
    except (OSError, ValueError, RecursionError) as error:
        raise ValueError(f"cannot read plan {path}: {error}") from None

    def field(mapping, key):
        if not isinstance(mapping, dict) or key not in mapping:
            raise ValueError(f"plan {path} has no {key!r} field")
        return mapping[key]

    version = field(data, "schema_version")
    if version != plan.schema_version:
        raise ValueError(f"plan {path} has schema_version {version!r}, this module has {plan.schema_version}")
    digest = field(field(data, "model"), "digest")
    if digest != plan.digest:
        raise ValueError(f"plan {path} is for model digest {digest!r}, this module for {plan.digest!r}")
    inputs = field(data, "inputs")
    try:
        found = tuple((i["name"], tuple(i["shape"]), i["dtype"]) for i in inputs)
    except (TypeError, KeyError) as error:
        raise ValueError(f"plan {path} has malformed inputs: {error!r}") from None
    if found != plan.inputs:
        raise ValueError(f"plan {path} has inputs {found}, this module {plan.inputs}")
    segments = field(data, "segments")
    try:
        found = tuple((s["first"], s["stop"], tuple(s["grid"])) for s in segments)
    except (TypeError, KeyError) as error:
        raise ValueError(f"plan {path} has malformed segments: {error!r}") from None
    if found != plan.segments:
        raise ValueError(f"plan {path} has segments (first, stop, grid) {found}, this module {plan.segments}")
