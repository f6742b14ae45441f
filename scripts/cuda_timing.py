"""CUDA-event timing shared by the GPU benchmark scripts (`bench-kernels.py`, `peer-prefill.py`)."""
import torch


def _median_ms(run, rep, per_run=1):
    """Median milliseconds of `run` over `rep` runs, CUDA events around each, divided by `per_run`."""
    times = []
    for _ in range(rep):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record(); run(); b.record(); torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / per_run)
    times.sort()
    return times[len(times) // 2]


def bench(fn, warm=3, rep=20):
    """Median milliseconds of `fn` over `rep` runs, CUDA events around each (warm-ups first)."""
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    return _median_ms(fn, rep)


def bench_kernel(fn, warm=3, rep=20, inner=10):
    """Median milliseconds of one launch of `fn` (a single kernel, or a library call of a few)
    over `rep` replays of a CUDA graph of `inner` launches back to back, CUDA events around each
    replay, and how it was timed: "graph". The GPU never waits for the host between launches, so
    neither side's launch overhead (a Python call into the driver, or PyTorch's dispatcher)
    counts, as neither does in a captured model; the graph's own launch, shared by the `inner`
    launches, does. Where capture fails, `inner` eager launches between the events, and "eager
    (why)": the caller must not compare that with a graph's time."""
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    mode = "graph"
    try:
        with torch.cuda.graph(graph):
            for _ in range(inner):
                fn()
        run = graph.replay
    except Exception as e:  # a library call that cannot be captured
        torch.cuda.synchronize()
        mode = f"eager ({str(e)[:80]})"

        def run():
            for _ in range(inner):
                fn()
    run()
    torch.cuda.synchronize()
    return _median_ms(run, rep, inner), mode
