"""``Target``: the device a plan is for, and what was measured on it.

The planner and the cost model read everything device-dependent from one frozen ``Target``:
the rates of the time estimate (``Speed``), which weight gradient tiles compute, the bytes a
process keeps per convolution kernel, the convolution workspace under autocast, and whether
ranks share the tiles. ``tilec.calibrate`` and ``tilec.clock`` measure them once per machine;
without measurements the references below stand in (a 2-core x86 CPU in float32).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

#: Fixed cost of a segment (autograd node, Python), so that equal plans prefer fewer segments.
SEGMENT_SECONDS = 1e-3


@dataclass(frozen=True)
class Speed:
    """The time estimate's rates: FLOP/s of the step's kernels, seconds per op call per tile
    (Python, autograd, kernel launch), and bytes/s of copies (a tiled segment assembling its
    outputs and input gradients, a tile's weight copies); ``rates``: FLOP/s per kind of op,
    channel count and tensor size, ``("conv@64@262144", 2.1e11)`` (a key without the size holds
    at every size), measured as tiles run them (``tilec.clock``), which ``rate`` looks up
    (``flop_rate`` for kinds not measured). A segment takes ``SEGMENT_SECONDS`` + each node's
    FLOPs over its rate + calls * ``call_seconds`` + bytes copied / ``copy_rate``."""

    flop_rate: float
    call_seconds: float
    copy_rate: float
    rates: tuple[tuple[str, float], ...] = ()

    def rate(self, kind: str, channels: int, elements: float | None = None) -> float:
        """FLOP/s of an op of ``kind`` with ``channels`` on tensors of ``elements`` (``None``: the
        largest size measured): the measurements of that kind at the nearest channel count (on a
        log scale), interpolated linearly in the logarithm of the size between the sizes measured
        (and held beyond them), else ``flop_rate``."""
        points = self.points(kind, channels)
        if not points:
            return self.flop_rate
        if elements is None or len(points) == 1:
            return points[-1][1]
        (small, slow), (large, fast) = points[0], points[-1]
        share = min(max((math.log(max(elements, 1)) - math.log(small)) / (math.log(large) - math.log(small)), 0.0), 1.0)
        return slow + (fast - slow) * share

    def points(self, kind: str, channels: int) -> list[tuple[float, float]]:
        """The (size, FLOP/s) measured of ``kind`` at the channel count nearest ``channels``, by
        size (a size not given counts as 1)."""
        measured = []
        for key, rate in self.rates:
            parts = key.split("@")
            if parts[0] == kind:
                measured.append((int(parts[1]), float(parts[2]) if len(parts) > 2 else 1.0, rate))
        if not measured:
            return []
        nearest = min({count for count, _, _ in measured},
                      key=lambda count: (abs(math.log2(max(channels, 1) / count)), count))
        return sorted((size, rate) for count, size, rate in measured if count == nearest)

    def seconds(self, flop_seconds: float, calls: int, copied: float) -> float:
        return SEGMENT_SECONDS + flop_seconds + calls * self.call_seconds + copied / self.copy_rate


#: The rates of a device not timed (``tilec.clock``): a 2-core x86 CPU in float32.
REFERENCE_SPEED = Speed(flop_rate=1e11, call_seconds=3e-5, copy_rate=5e9)
#: From this many input channels, a tile convolution with stride 1, no groups and a kernel
#: larger than 1x1 gets its weight gradient from the runtime's matrix products
#: (``tilec.runtime.kernels.weight_grad``) unless a budget search raced the two on its device
#: (``tilec.clock.gemm_min_channels``; ``None``: never). The reference is a 2-core AVX2 CPU's,
#: where oneDNN's channels-last weight gradient took 1.5-3x as long (on an AVX-512 one it took
#: half as long).
GEMM_MIN_CHANNELS = 32
#: Bytes a process keeps from then on for each convolution kernel it runs for the first time: on
#: CPU, oneDNN's primitive cache holds one compiled kernel per pass (forward, input gradient,
#: weight gradient unless the matrix products compute it) and call shape, and a tile's
#: convolution runs one shape per distinct tile class. Measured per machine for a budget search
#: (``tilec.calibrate.kernel_state``; 0 on CUDA, whose kernels keep host memory); this reference
#: is a 2-core AVX-512 CPU's, float32 (70-95 KiB from 3 to 1024 channels, 1x1 and 3x3).
KERNEL_STATE_BYTES = 84 << 10


@dataclass(frozen=True)
class Target:
    """What a plan depends on about its device.

    ``device``: the torch device type the plan's tiles run on (``tilec.runtime.device``).
    ``speed``: the measured rates (``None``: not measured; the estimate uses ``REFERENCE_SPEED``
    and the plan records none). ``gemm_min_channels``: from how many input channels tiles compute
    a weight gradient as matrix products (``None``: never). ``kernel_state``: bytes kept per
    convolution kernel. ``conv_workspace``: with autocast, a convolution's ``(forward, backward)``
    workspace in tiles and in stored segments (``tilec.calibrate``). ``shared_tiles``: ranks of a
    process group share the tiles (no segment rolls an input gradient).
    """

    device: str = "cpu"
    speed: Speed | None = None
    gemm_min_channels: int | None = GEMM_MIN_CHANNELS
    kernel_state: int = KERNEL_STATE_BYTES
    conv_workspace: tuple[tuple[float, float], tuple[float, float]] | None = None
    shared_tiles: bool = False

    @property
    def rates(self) -> Speed:
        """The rates the time estimate uses."""
        return self.speed or REFERENCE_SPEED


#: A target with nothing measured: the references above.
REFERENCE = Target()
