"""The GPU busy share that ``benchmarks/step.py --busy`` reports: the union of the device's
activity intervals (``benchmarks.common.covered``) against a brute force over integer points, and
on CUDA (skipped without a device) a step of matrix products against a step that sleeps."""

from __future__ import annotations

import time

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from benchmarks.common import covered
from benchmarks.step import gpu_busy

intervals = st.lists(st.tuples(st.integers(0, 60), st.integers(0, 20)).map(lambda t: (t[0], t[0] + t[1])),
                     max_size=12)


@given(intervals)
def test_covered_is_the_length_of_the_union(spans):
    points = {point for start, stop in spans for point in range(start, stop)}
    assert covered(spans) == len(points)


def test_covered_counts_a_nested_interval_once():
    assert covered([(0, 10), (2, 3), (9, 12)]) == 12


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_busy_is_high_for_kernels_back_to_back_and_low_for_a_sleep():
    a = torch.randn(4096, 4096, device="cuda")
    a @ a
    busy, wall = gpu_busy(lambda: [a @ a for _ in range(50)])
    assert busy > 0.8 and wall > 0
    idle, _ = gpu_busy(lambda: (a @ a, time.sleep(0.2)))
    assert idle < 0.2
