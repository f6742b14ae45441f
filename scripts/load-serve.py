#!/usr/bin/env python3
"""Load generator for `kiln-run serve` (standard library only): CONCURRENCY workers send streamed
/v1/completions requests of random token-id prompts (lengths uniform in --lengths) asking for
--max-tokens new tokens each (ignore_eos), until --requests have finished. The workers are
threads spread over --processes processes, so that no thread waits long for its interpreter's
lock to read a chunk that has arrived (one process of 64 threads adds its own milliseconds to the
inter-token latency it measures). Prints one JSON object: aggregate generated tokens/s over the
whole run and over its steady part (the middle 80% of token arrivals, leaving out the ramp-up and
the drain), time to first token and inter-token latency percentiles (from the arrival of each
streamed chunk), errors, the server's own view of the run (its inter-token latency
and engine step histograms from /metrics, the run's counts alone: p50 and p99 as the bounds of the
buckets that hold them, 25% apart), and, with --pid, the server's resident memory and the device
memory (nvidia-smi) before and after, and the server's resident memory after every tenth of the
requests.

    python3 scripts/load-serve.py http://127.0.0.1:8000 --model m --concurrency 64 \
        --requests 256 --lengths 100..4000 --max-tokens 512 --vocab 128256 --pid PID
"""
import argparse
import http.client
import json
import multiprocessing
import queue
import random
import statistics
import subprocess
import sys
import threading
import time
import urllib.parse


def rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return None


def gpu_used_mib():
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30).stdout
        return int(out.split()[0])
    except Exception:
        return None


def one(url, body):
    """One streamed request: (arrival, [chunk times], tokens, error)."""
    u = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=600)
    start = time.perf_counter()
    conn.request("POST", "/v1/completions", json.dumps(body), {"content-type": "application/json"})
    r = conn.getresponse()
    if r.status != 200:
        return start, [], 0, f"{r.status} {r.read()[:200]!r}"
    times, tokens = [], 0
    while True:
        line = r.readline()
        if not line:
            return start, times, tokens, "stream ended without [DONE]"
        line = line.strip()
        if not line.startswith(b"data: "):
            continue
        data = line[6:]
        if data == b"[DONE]":
            conn.close()
            return start, times, tokens, None
        event = json.loads(data)
        if "error" in event:
            return start, times, tokens, str(event["error"])
        for c in event.get("choices", []):
            n = len(c.get("token_ids") or [])
            if n:
                tokens += n
                times.append(time.perf_counter())


def histograms(url):
    """The server's histogram buckets from /metrics: {series: [(upper bound, cumulative count)]},
    a series being the name with its labels other than `le`, and each series' sum."""
    u = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    buckets, sums = {}, {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        series, value = line.rsplit(" ", 1)
        name, _, labels = series.partition("{")
        labels = labels.rstrip("}")
        if name.endswith("_bucket"):
            kept = ",".join(l for l in labels.split(",") if l and not l.startswith("le="))
            le = next(l for l in labels.split(",") if l.startswith("le=")).split('"')[1]
            key = name[: -len("_bucket")] + (f"{{{kept}}}" if kept else "")
            buckets.setdefault(key, []).append((float("inf") if le == "+Inf" else float(le), float(value)))
        elif name.endswith("_sum"):
            sums[name[: -len("_sum")] + (f"{{{labels}}}" if labels else "")] = float(value)
    return buckets, sums


def server_view(before, after):
    """p50 / p99 bucket bounds, count and mean (ms) of the run's observations of the server's
    inter-token latency and engine steps: `after` less `before`."""
    (b0, s0), (b1, s1) = before, after
    out = {}
    for key, rows in b1.items():
        if not key.startswith(("kiln_inter_token_latency_seconds", "kiln_engine_step_seconds")):
            continue
        old = dict(b0.get(key, []))
        run = [(le, c - old.get(le, 0.0)) for le, c in sorted(rows)]
        n = run[-1][1] if run else 0
        if n <= 0:
            continue
        bound = lambda q: next(le for le, c in run if c >= q * n)
        total = s1.get(key, 0.0) - s0.get(key, 0.0)
        ms = lambda v: None if v == float("inf") else round(v * 1e3, 3)
        out[key] = {"count": int(n), "p50_ms_at_most": ms(bound(0.5)), "p99_ms_at_most": ms(bound(0.99)),
                    "mean_ms": round(total / n * 1e3, 3)}
    return out


def split(total, parts):
    """`total` workers over `parts` processes, as evenly as they go."""
    return [total // parts + (i < total % parts) for i in range(parts)]


def client(args, threads, todo, done, finished):
    """One process of the load: `threads` workers taking prompts from `todo` until it is empty,
    counting each finished request in `finished`; every request's result goes to `done` in one
    list."""
    sys.setswitchinterval(0.0005)
    lock = threading.Lock()
    results = []

    def worker():
        while True:
            try:
                prompt = todo.get(timeout=1)
            except queue.Empty:
                return
            body = {"model": args.model, "prompt": prompt, "max_tokens": args.max_tokens,
                    "temperature": 0, "ignore_eos": True, "stream": True, "return_token_ids": True}
            r = one(args.url, body)
            with lock:
                results.append(r)
            with finished.get_lock():
                finished.value += 1

    workers = [threading.Thread(target=worker) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    done.put(results)


def steady_rate(arrivals):
    """Tokens per second between the 10th and 90th percentile of the token arrival times (each
    streamed chunk counted as the tokens it carries: one here)."""
    if len(arrivals) < 10:
        return None
    arrivals = sorted(arrivals)
    lo, hi = arrivals[len(arrivals) // 10], arrivals[len(arrivals) * 9 // 10]
    return round((len(arrivals) * 8 // 10) / (hi - lo), 1) if hi > lo else None


def pct(values, q):
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("--model", required=True)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--lengths", default="100..4000")
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--vocab", type=int, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pid", type=int)
    ap.add_argument("--processes", type=int, default=8)
    args = ap.parse_args()
    lo, hi = (int(x) for x in args.lengths.split(".."))
    rng = random.Random(args.seed)
    jobs = []
    for _ in range(args.requests):
        n = rng.randint(lo, hi)
        jobs.append([rng.randrange(args.vocab) for _ in range(n)])
    todo = multiprocessing.Queue()
    for prompt in reversed(jobs):  # the order the single-process client took them in
        todo.put(prompt)
    done = multiprocessing.Queue()
    before = {"rss_kib": rss_kib(args.pid) if args.pid else None, "gpu_mib": gpu_used_mib()}
    metrics_before = histograms(args.url)
    processes = max(1, min(args.processes, args.concurrency))
    t0 = time.perf_counter()
    finished = multiprocessing.Value("i", 0)
    procs = [multiprocessing.Process(target=client, args=(args, threads, todo, done, finished))
             for threads in split(args.concurrency, processes)]
    for p in procs:
        p.start()
    # Each process hands in one list; the server's memory is read as each tenth of the requests
    # has finished (a late reading stands for every tenth it passed).
    results, rss_by_requests, mark = [], [], args.requests // 10
    pending = len(procs)
    while pending:
        try:
            results.extend(done.get(timeout=0.5))
            pending -= 1
        except queue.Empty:
            if not any(p.is_alive() for p in procs):
                break  # a process died without its list
        while args.pid and mark and finished.value >= mark * (len(rss_by_requests) + 1):
            rss_by_requests.append([mark * (len(rss_by_requests) + 1), rss_kib(args.pid)])
    for p in procs:
        p.join()
    wall = time.perf_counter() - t0
    ttft = [times[0] - start for start, times, _, err in results if times and not err]
    itl = [b - a for _, times, _, err in results if not err for a, b in zip(times, times[1:])]
    tokens = sum(t for _, _, t, err in results if not err)
    steady = steady_rate([t for _, times, _, err in results if not err for t in times])
    errors = [err for _, _, _, err in results if err]
    after = {"rss_kib": rss_kib(args.pid) if args.pid else None, "gpu_mib": gpu_used_mib()}
    server = server_view(metrics_before, histograms(args.url))
    ms = lambda v: None if v is None else round(v * 1e3, 3)
    print(json.dumps({
        "requests": len(results), "errors": len(errors), "first_errors": errors[:3],
        "concurrency": args.concurrency, "lengths": args.lengths, "max_tokens": args.max_tokens,
        "wall_s": round(wall, 3), "generated_tokens": tokens, "tokens_per_s": round(tokens / wall, 1),
        "tokens_per_s_steady": steady,
        "ttft_ms": {"p50": ms(pct(ttft, 0.5)), "p99": ms(pct(ttft, 0.99))},
        "itl_ms": {"p50": ms(pct(itl, 0.5)), "p99": ms(pct(itl, 0.99)),
                   "mean": ms(statistics.mean(itl)) if itl else None},
        "server": server, "before": before, "after": after, "rss_kib_by_requests": rss_by_requests,
    }))


if __name__ == "__main__":
    main()
