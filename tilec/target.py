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
    channel count and tensor size, ``("conv@64@262144", 2.1e11)``, measured as tiles run them
    (``tilec.clock``), which ``points`` looks up (``flop_rate`` for kinds not measured). A
    segment takes ``SEGMENT_SECONDS`` + each node's FLOPs over its rate + calls * ``call_seconds``
    + bytes copied / ``copy_rate``."""

    flop_rate: float
    call_seconds: float
    copy_rate: float
    rates: tuple[tuple[str, float], ...] = ()

    def points(self, kind: str, channels: int) -> list[tuple[float, float]]:
        """The (size, FLOP/s) measured of ``kind`` at the channel count nearest ``channels`` (on a
        log scale), by size; ``[(1.0, flop_rate)]`` for a kind not measured. A node's rate lies
        between the smallest and the largest size's, log-linear in its tiles' size
        (``tilec.cost.facts.Facts.seconds_per_flop``)."""
        measured = [(int(count), float(size), rate) for key, rate in self.rates
                    for name, count, size in [key.split("@")] if name == kind]
        if not measured:
            return [(1.0, self.flop_rate)]
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
