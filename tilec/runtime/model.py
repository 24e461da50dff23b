"""``TiledModule``: the ``nn.Module`` a generated ``TiledModel`` is, run by its plan's steps."""

import importlib
from dataclasses import dataclass, replace

import torch

from tilec.runtime.checks import (
    batch_norm_mode,
    check_autocast,
    check_devices,
    check_group,
    check_inputs,
    check_model,
    check_modes,
    check_same_input,
    check_same_tensors,
    choose_mode,
    model_tensors,
)
from tilec.runtime.device import KERNEL_CHOICES
from tilec.runtime.memory import expand_cuda_segments, return_freed_memory
from tilec.runtime.reuse import Reuse
from tilec.runtime.sources import Reading, Source, whole
from tilec.runtime.sweeps import Tiled
from tilec.runtime.tiles import Run, TiledSegment


@dataclass(frozen=True)
class Step:
    """One segment of the plan in execution order: ``run`` (a ``TiledSegment``, or a stored
    segment's function ``(xs, bs, p, train, like) -> outputs``), the names of the tensors it slices and
    of those it reads whole, the indices of its model tensors in ``PlanSpec.tensors``, and the
    names of its outputs."""

    run: object
    sliced: tuple
    broadcast: tuple
    tensors: tuple
    outputs: tuple


@dataclass(frozen=True)
class Program:
    """The plan of the other mode than ``TiledModule.plan``'s, as the module runs it: its
    ``PlanSpec``, its ``Step`` s, and ``output`` (builds the model's return value from ``values``)."""

    plan: object
    steps: tuple
    output: object


class TiledModule(torch.nn.Module):
    """Drop-in replacement for ``model`` that trains tile by tile; shares its parameters.

    A generated ``TiledModel`` sets ``plan`` (a ``PlanSpec``), ``steps`` (its ``Step`` s) and
    ``output`` (builds the model's return value from the tensors by name), and ``other``: ``None``,
    or the ``Program`` of the other mode where the model's forward takes another path in each
    (``tilec.runtime.checks.choose_mode`` picks the one of the modules' modes).
    ``progress=True`` reports per-tile progress on standard error during each pass.
    ``process_group``: a torch.distributed group whose ranks call this model on the same input
    together and share the tiles; ``None`` runs every tile here.
    ``return_freed_memory``: on the first forward on a CPU input of a plan with a tiled segment, pin
    glibc's mmap threshold for the process (``tilec.runtime.memory``), so that resident memory
    stays within the plan's budget; ``False`` leaves the allocator as it is (faster, but resident
    memory may reach about twice the budget). A plan of stored segments only runs as plain
    PyTorch does and leaves the allocator alone: its blocks are not tile-sized, and a pinned
    threshold would fault every block of 128 KiB or more in afresh (5x plain's page faults).
    On CUDA, put the caching allocator on expandable segments (unless ``PYTORCH_CUDA_ALLOC_CONF``
    is set), so that what it reserves stays near what tiles allocate.
    ``kernels``: ``"auto"``, each device's own tile kernels; ``"generic"``, aten's kernels on
    fresh tensors everywhere, as CUDA runs; ``"compiled"``, those with every tile function compiled
    by ``torch.compile`` (inductor) at its first call; ``"cudagraphs"``, aten's kernels captured and
    replayed as CUDA graphs (torch.compile's backend "cudagraphs"); ``"reduce-overhead"``,
    inductor's kernels replayed so (``tilec.runtime.device``, ``tilec.runtime.compiled``).

    Its inputs are ``forward``'s tensor arguments, in order: tensors on the model's device, host
    tensors of a model on CUDA, or array-likes (a ``np.load(path, mmap_mode="r")`` array or a
    view of one, a zarr array, an h5py dataset) in the model's layout. Inputs that are not on the
    model's device are read by region (``tilec.runtime.sources``): each tile reads its slice,
    ahead of time where ``read_ahead``; ``reading`` says what the last step's reads cost.
    ``reuse`` counts the tiles the last step ran and those it reused, computed once for several
    identical ones (``tilec.runtime.reuse``), per pass, its backward included once it has run.
    """

    plan = None
    steps = ()
    other = None

    def __init__(self, model, progress=False, process_group=None, return_freed_memory=True, kernels="auto",
                 read_ahead=True):
        super().__init__()
        if kernels not in KERNEL_CHOICES:
            raise ValueError(f"kernels must be one of {KERNEL_CHOICES}, got {kernels!r}")
        check_model(self.plan, model)
        if self.other is not None:
            check_model(self.other.plan, model)
        self.model = model
        self.progress = progress
        self.process_group = process_group
        self.return_freed_memory = return_freed_memory
        self.kernels = kernels
        self.read_ahead = read_ahead
        self.reading = Reading()
        self.reuse = Reuse()
        self._checked_tensors = False
        if process_group is not None:
            check_group(self.plan, process_group)

    def output(self, values):
        raise NotImplementedError

    @property
    def tiled(self):
        """Whether the plan has a tiled segment."""
        return any(isinstance(step.run, TiledSegment) for step in self.steps)

    def forward(self, *inputs):
        plan = choose_mode(self.plan, self.other and self.other.plan, self.model)
        steps, output = (self.steps, self.output) if plan is self.plan else (self.other.steps, self.other.output)
        modules = dict(self.model.named_modules())
        check_modes(plan, modules)
        tensors = model_tensors(plan, self.model)
        check_inputs(plan, inputs, tensors)
        device, dtype = place(tensors, inputs)
        named = [(name, x) for (name, _, _), x in zip(plan.inputs, inputs, strict=True)]
        check_devices(named, tensors, device)
        check_autocast(plan, device)
        run = Run(plan.name, self.progress, self.process_group, self.kernels, plan.gemm_min_channels,
                  device=device, dtype=dtype)
        kernels = run.kernels(device.type)
        if self.return_freed_memory and kernels.pin_allocator and self.tiled:
            return_freed_memory()
        if self.return_freed_memory and kernels.expand_segments:
            expand_cuda_segments()
        group = self.process_group
        if group is not None:
            if not self._checked_tensors:
                check_same_tensors(group, tensors)
                self._checked_tensors = True
            for _, x in named:
                if isinstance(x, torch.Tensor):
                    check_same_input(group, x)
        train = {path: modules[path].training for path in plan.train_paths}
        train.update({path: batch_norm_mode(modules[path]) for path in plan.batch_norm_paths})
        run = replace(run, train=train)
        self.reading, self.reuse = Reading(), Reuse()
        run = replace(run, reuse=self.reuse)
        values = {name: self.source(name, x, device, len(shape)) for (name, shape, _), x in zip(
            plan.inputs, inputs, strict=True)}
        for step in steps:
            tiled = isinstance(step.run, TiledSegment)
            for name in (step.broadcast if tiled else (*step.sliced, *step.broadcast)):
                values[name] = whole(values[name])  # read whole once, and kept for the later segments
            xs, bs = [values[name] for name in step.sliced], [values[name] for name in step.broadcast]
            p = [tensors[index] for index in step.tensors]
            if tiled:
                outs = Tiled.apply(step.run, run, *xs, *bs, *p)
            else:
                outs = step.run(xs, bs, p, train, run.like())
            values.update(zip(step.outputs, outs, strict=True))
        return output(values)

    def source(self, name, x, device, dims):
        """Input ``x`` as the steps take it: a tensor on the model's device itself; an image (3 or 4
        dims) elsewhere as a ``Source`` the tiles read by region; anything else moved whole."""
        if isinstance(x, torch.Tensor) and x.device == device:
            return x
        if dims in (3, 4):
            return Source(name, x, device, self.reading, ahead=self.read_ahead)
        return x.to(device) if isinstance(x, torch.Tensor) else torch.as_tensor(x[...]).to(device)


def mapping(path, pairs):
    """The model's own mapping type (``path``: module.qualname, e.g. collections.OrderedDict) built
    from ``pairs``, a dict of its keys and values in order."""
    module, name = path.rsplit(".", 1)
    return getattr(importlib.import_module(module), name)(pairs)


def place(tensors, inputs):
    """The device and floating dtype the model computes in: its floating tensors' (else its
    first tensor input's device and floating input's dtype; else the CPU and float32)."""
    floating = next((t for t in tensors if t.is_floating_point()), None)
    if floating is not None:
        return floating.device, floating.dtype
    given = [x for x in inputs if isinstance(x, torch.Tensor)]
    device = given[0].device if given else torch.device("cpu")
    return device, next((x.dtype for x in given if x.is_floating_point()), torch.float32)
