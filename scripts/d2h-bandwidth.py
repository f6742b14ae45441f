"""usage (on the GPU machine): python3 scripts/d2h-bandwidth.py

Device-to-host copy bandwidth into page-locked memory: one copy, pieces on one stream, and
pieces spread over 2 / 4 streams at once (do several copy engines beat one?)."""
import torch
N = 1 << 30
x = torch.empty(N, dtype=torch.uint8, device="cuda"); x.fill_(1)
h = torch.empty(N, dtype=torch.uint8, pin_memory=True)
streams = [torch.cuda.Stream() for _ in range(4)]
def run(parts, nstreams):
    size = N // parts
    main = torch.cuda.current_stream()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(main)
    for s in streams[:nstreams]:
        s.wait_stream(main)
    for i in range(parts):
        s = streams[i % nstreams]
        with torch.cuda.stream(s):
            h[i * size:(i + 1) * size].copy_(x[i * size:(i + 1) * size], non_blocking=True)
    for s in streams[:nstreams]:
        main.wait_stream(s)
    end.record(main); end.synchronize()
    return start.elapsed_time(end)
for parts, ns in [(1, 1), (16, 1), (2, 2), (16, 2), (4, 4), (16, 4), (1, 1)]:
    ms = sorted(run(parts, ns) for _ in range(7))[3]
    print(f"{parts:3d} pieces on {ns} streams: {ms:7.2f} ms  {N / ms / 1e6:6.1f} GB/s")
