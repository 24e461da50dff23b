"""Instruments for generated modules: their runtime functions replaced by ones that record their use."""

from __future__ import annotations


def counting(module: dict, name: str, seen: list):
    """Replace the generated module's function ``name`` by one recording its calls in ``seen``."""
    real = module[name]

    def counted(*args, **kwargs):
        seen.append(args)
        return real(*args, **kwargs)

    module[name] = counted


class Recorded:
    """The generated module's ``Arena``, oneDNN convolution-into, ``weight_grad`` and
    ``return_freed_memory`` replaced by ones that record their use."""

    def __init__(self, module: dict):
        self.module, self.arenas = module, []
        self.calls = {name: [] for name in ("weight_grad", "return_freed_memory", "CONVOLVE_INTO")}
        self.saved = {name: module[name] for name in ("Arena", "CONVOLVE_INTO", "weight_grad", "return_freed_memory")}

    def __enter__(self):
        arenas, calls, real = self.arenas, self.calls, self.saved

        class Arena(real["Arena"]):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                arenas.append(self)

        class Into:
            @staticmethod
            def binary(*args):
                calls["CONVOLVE_INTO"].append(args)
                return real["CONVOLVE_INTO"].binary(*args)

        self.module["Arena"], self.module["CONVOLVE_INTO"] = Arena, Into
        for name in ("weight_grad", "return_freed_memory"):
            counting(self.module, name, calls[name])
        return self

    def __exit__(self, *exc):
        self.module.update(self.saved)

    def used(self) -> dict[str, bool]:
        found = {name: bool(calls) for name, calls in self.calls.items()}
        found["buffer"] = any(arena.buffer is not None for arena in self.arenas)
        return found
