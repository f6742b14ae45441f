"""CUDA-event timing shared by the GPU benchmark scripts (`bench-kernels.py`, `peer-prefill.py`)."""
import torch


def bench(fn, warm=3, rep=20):
    """Median milliseconds of `fn` over `rep` runs, CUDA events around each (warm-ups first)."""
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(rep):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]
