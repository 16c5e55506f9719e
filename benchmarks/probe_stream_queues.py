"""Which CUDA streams share a hardware queue: torch's pool streams against the virtual ranks' batch.

CUDA feeds the GPU through ``CUDA_DEVICE_MAX_CONNECTIONS`` hardware queues and processes each queue
in order. Two streams share a queue when work on one waits behind a dependency of the other: here
stream ``a`` gets a long sleep kernel and then a small kernel (which must wait for the sleep), and
stream ``b`` a small kernel. If ``b``'s kernel finishes only after the sleep, it was queued behind
``a``'s waiting one: the two streams share a queue. Virtual ranks deadlock on exactly that (a rank's
barrier kernel behind a wait of a peer's stream), so ``VirtualGroup`` takes its streams from a batch
created back to back (``pyfused.testing.virtual_ranks.queue_streams``); this probe measures, on the
device, how many distinct queues each way of taking streams reaches.

    CUDA_DEVICE_MAX_CONNECTIONS=1 python benchmarks/probe_stream_queues.py --expect-one-queue
    CUDA_DEVICE_MAX_CONNECTIONS=32 python benchmarks/probe_stream_queues.py [--streams 24]

Prints one line per stream set: the distinct queues found among its streams and the largest group
sharing one. Exit status 1 if the virtual ranks' batch has two streams sharing a queue, or, with
``--expect-one-queue`` (the positive control: with one connection every stream shares the one
queue), if the probe does not find every stream sharing: then it cannot see a shared queue at all.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch


def sleep_cycles_for(seconds: float) -> int:
    """Cycles of ``torch.cuda._sleep`` that take about ``seconds`` on this device (timed once)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = 1_000_000
    torch.cuda._sleep(cycles)  # warm-up
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    per_cycle = start.elapsed_time(end) / 1e3 / cycles
    return max(1000, int(seconds / per_cycle))


def shares_queue(a, b, cycles: int, sleep_s: float, cells) -> bool:
    """Whether ``b``'s kernel waits behind ``a``'s sleep (see the module docstring)."""
    torch.cuda.synchronize()
    with torch.cuda.stream(a):
        torch.cuda._sleep(cycles)
        cells[0].add_(1)  # ordered after the sleep on stream a
    with torch.cuda.stream(b):
        cells[1].add_(1)
        done = torch.cuda.Event()
        done.record(b)
    start = time.perf_counter()
    while not done.query():
        if time.perf_counter() - start > 20 * sleep_s:
            break
    waited = time.perf_counter() - start
    torch.cuda.synchronize()
    return waited > sleep_s / 2


def queue_classes(streams, cycles: int, sleep_s: float):
    """Streams grouped by shared queue (union of every pair found sharing, tested both ways)."""
    cells = torch.zeros(2, device="cuda")
    parent = list(range(len(streams)))

    def root(i):
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for i in range(len(streams)):
        for j in range(i + 1, len(streams)):
            if root(i) == root(j):
                continue
            if shares_queue(streams[i], streams[j], cycles, sleep_s, cells) or \
                    shares_queue(streams[j], streams[i], cycles, sleep_s, cells):
                parent[root(j)] = root(i)
    classes = {}
    for i in range(len(streams)):
        classes.setdefault(root(i), []).append(i)
    return sorted(classes.values(), key=len, reverse=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=24,
                        help="streams per set (a virtual group of 8 ranks uses 24)")
    parser.add_argument("--sleep-ms", type=float, default=3.0)
    parser.add_argument("--expect-one-queue", action="store_true",
                        help="the positive control, run with CUDA_DEVICE_MAX_CONNECTIONS=1: fail "
                             "unless every stream of every set is found on one queue")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device")
        return 2
    from pyfused.testing.virtual_ranks import device_connections, queue_streams

    torch.cuda.init()
    sleep_s = args.sleep_ms / 1e3
    cycles = sleep_cycles_for(sleep_s)
    print(f"CUDA_DEVICE_MAX_CONNECTIONS={os.environ.get('CUDA_DEVICE_MAX_CONNECTIONS', '(unset: 8)')}"
          f"; {args.streams} streams per set; a {args.sleep_ms} ms sleep = {cycles} cycles")
    sets = {
        "torch pool, priority -1 (torch.cuda.Stream)": [torch.cuda.Stream(priority=-1)
                                                        for _ in range(args.streams)],
        "torch pool, priority 0": [torch.cuda.Stream() for _ in range(args.streams)],
        "virtual ranks' batch (queue_streams)": queue_streams(torch.device("cuda", 0))[
            :args.streams],
    }
    bad = False
    for name, streams in sets.items():
        t0 = time.perf_counter()
        classes = queue_classes(streams, cycles, sleep_s)
        shared = [c for c in classes if len(c) > 1]
        print(f"{name}: {len(streams)} streams on {len(classes)} distinct queues, largest sharing "
              f"group {len(classes[0])}; sharing: {shared[:6]}{' ...' if len(shared) > 6 else ''}"
              f" ({time.perf_counter() - t0:.1f} s)")
        if args.expect_one_queue:
            bad = bad or len(classes) != 1
        elif name.startswith("virtual") and len(streams) <= device_connections() and shared:
            bad = True
    if args.expect_one_queue and bad:
        print("positive control failed: with one connection every stream shares the queue, and the "
              "probe did not find it so; its other results say nothing")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
