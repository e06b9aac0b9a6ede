"""Timing a piece of GPU work with CUDA events: what the benchmarks and the demo report."""
from __future__ import annotations

import statistics
from typing import Callable


def cuda_time_ms(fn: Callable[[], None], warmup: int = 3, repeat: int = 20) -> float:
    """Median milliseconds of ``fn`` over ``repeat`` runs, timed with CUDA events."""
    import torch

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)
