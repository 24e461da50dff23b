"""``TiledModule``: the ``nn.Module`` a generated ``TiledModel`` is, run by its plan's steps."""

from dataclasses import dataclass, replace

import torch

from tilec.runtime.checks import (
    batch_norm_mode,
    check_autocast,
    check_group,
    check_input,
    check_model,
    check_modes,
    check_same_input,
    check_same_tensors,
    model_tensors,
)
from tilec.runtime.memory import return_freed_memory
from tilec.runtime.sweeps import Tiled
from tilec.runtime.tiles import Run, TiledSegment

#: ``TiledModel(..., kernels=...)``: the device's own kernels, or the generic ones everywhere.
KERNEL_CHOICES = ("auto", "generic")


@dataclass(frozen=True)
class Step:
    """One segment of the plan in execution order: ``run`` (a ``TiledSegment``, or a stored
    segment's function ``(xs, bs, p, train) -> outputs``), the names of the tensors it slices and
    of those it reads whole, the indices of its model tensors in ``PlanSpec.tensors``, and the
    names of its outputs."""

    run: object
    sliced: tuple
    broadcast: tuple
    tensors: tuple
    outputs: tuple


class TiledModule(torch.nn.Module):
    """Drop-in replacement for ``model`` that trains tile by tile; shares its parameters.

    A generated ``TiledModel`` sets ``plan`` (a ``PlanSpec``), ``steps`` (its ``Step`` s) and
    ``output`` (builds the model's return value from the tensors by name).
    ``progress=True`` reports per-tile progress on standard error during each pass.
    ``process_group``: a torch.distributed group whose ranks call this model on the same input
    together and share the tiles; ``None`` runs every tile here.
    ``return_freed_memory``: on the first forward on a CPU input, pin glibc's mmap threshold for
    the process (``tilec.runtime.memory``), so that resident memory stays within the plan's
    budget; ``False`` leaves the allocator as it is (faster, but resident memory may reach about
    twice the budget).
    ``kernels``: ``"auto"``, each device's own tile kernels, or ``"generic"``, aten's kernels on
    fresh tensors everywhere, as CUDA runs (``tilec.runtime.device``).
    """

    plan = None
    steps = ()

    def __init__(self, model, progress=False, process_group=None, return_freed_memory=True, kernels="auto"):
        super().__init__()
        if kernels not in KERNEL_CHOICES:
            raise ValueError(f"kernels must be one of {KERNEL_CHOICES}, got {kernels!r}")
        check_model(self.plan, model)
        self.model = model
        self.progress = progress
        self.process_group = process_group
        self.return_freed_memory = return_freed_memory
        self.kernels = kernels
        self._checked_tensors = False
        if process_group is not None:
            check_group(self.plan, process_group)

    def output(self, values):
        raise NotImplementedError

    def forward(self, x):
        plan = self.plan
        modules = dict(self.model.named_modules())
        check_modes(plan, modules)
        tensors = model_tensors(plan, self.model)
        check_input(plan, x, tensors)
        check_autocast(plan, x)
        run = Run(plan.name, self.progress, self.process_group, self.kernels == "generic", plan.gemm_min_channels)
        if self.return_freed_memory and run.kernels(x.device.type).pin_allocator:
            return_freed_memory()
        group = self.process_group
        if group is not None:
            if not self._checked_tensors:
                check_same_tensors(group, tensors)
                self._checked_tensors = True
            check_same_input(group, x)
        train = {path: modules[path].training for path in plan.train_paths}
        train.update({path: batch_norm_mode(modules[path]) for path in plan.batch_norm_paths})
        run = replace(run, train=train)
        values = {"input": x}
        for step in self.steps:
            xs, bs = [values[name] for name in step.sliced], [values[name] for name in step.broadcast]
            p = [tensors[index] for index in step.tensors]
            if isinstance(step.run, TiledSegment):
                outs = Tiled.apply(step.run, run, *xs, *bs, *p)
            else:
                outs = step.run(xs, bs, p, train)
            values.update(zip(step.outputs, outs, strict=True))
        return self.output(values)
