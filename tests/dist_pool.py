"""Reusable pools of spawned ranks for multi-rank tests.

``RankPool(world_size)`` spawns ``world_size`` processes that join one process group (gloo on CPU;
``PYFUSED_TEST_BACKEND=nccl`` for GPU runs, rank r on cuda:r % device_count) and then serve test
bodies: ``pool.run(fn, *args)`` sends ``fn`` (a module-level function, pickled by name) to every rank,
calls ``fn(rank, world_size, *args)`` there and returns the per-rank results in rank order.

Spawning and joining a group costs seconds, so a pool is kept for the whole test run and reused by
every test of its world size. Every gloo group a test body creates (a DeviceMesh makes one per dim)
lives on in its ranks with a socket thread that wakes every 10 ms; hundreds of them make idle ranks
take a core of the machine. So between tests (``Pools.recycle_crowded``) a pool whose ranks hold
more than ``MAX_GLOO_LOOPS`` such threads is closed, and the next test of its size starts a new one.

A test body that raises on some rank, or a rank that does not answer within ``timeout`` (a hang),
fails the test with every rank's traceback and the pool is torn down -- the group may be
inconsistent -- and rebuilt for the next test.
"""
from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from typing import Any, Callable, List

# How long a rank blocked in a collective waits before gloo itself gives up (the pool's own timeout
# is per test and usually shorter).
GROUP_TIMEOUT_S = 90
# Once one rank has failed, how long to wait for the others to report before calling them stuck.
GRACE_S = 10
# gloo's socket threads (one per group, polling every 10 ms) a rank may hold before its pool is
# replaced between tests: about 3% of a core per rank at this count.
MAX_GLOO_LOOPS = 64


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(rank: int, world_size: int, port: int, backend: str, tasks, results) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # several ranks share a small machine; oversubscription only adds noise
    device_id = None
    if "nccl" in backend:  # "nccl", or "cpu:gloo,cuda:nccl" (validation over gloo)
        if world_size > torch.cuda.device_count():
            # Several ranks on one GPU (docs/TESTBED.md): NCCL refuses two ranks of one host on one
            # device, so each rank claims its own host id and talks over sockets -- correct, slow.
            os.environ.setdefault("NCCL_HOSTID", f"pyfused-test-rank{rank}")
            os.environ.setdefault("NCCL_NET", "Socket")
        torch.cuda.set_device(rank % torch.cuda.device_count())
        device_id = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, device_id=device_id,
                            timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
    results.put((rank, "ready", None))
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args, kwargs = task
        try:
            value = fn(rank, world_size, *args, **kwargs)
            results.put((rank, "ok", value))
        except BaseException:  # report everything; the parent decides
            results.put((rank, "error", traceback.format_exc()))
    dist.destroy_process_group()


class RankFailure(AssertionError):
    pass


class RankPool:
    def __init__(self, world_size: int, backend: str = "gloo", start_timeout: float = 120.0):
        self.world_size = world_size
        self.backend = backend
        ctx = mp.get_context("spawn")
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        port = _free_port()
        self._procs = [
            ctx.Process(target=_serve, args=(r, world_size, port, backend, self._tasks[r], self._results),
                        daemon=True, name=f"pyfused-rank{r}of{world_size}")
            for r in range(world_size)
        ]
        for p in self._procs:
            p.start()
        self.healthy = True
        ready = self._collect(start_timeout, "start and join the process group")
        if any(kind != "ready" for kind, _ in ready):
            self.close()
            raise RankFailure("ranks failed to start:\n" + "\n".join(str(v) for _, v in ready))

    def _collect(self, timeout: float, what: str) -> List[Any]:
        got = {}
        deadline = time.monotonic() + timeout
        while len(got) < self.world_size:
            if any(kind == "error" for kind, _ in got.values()):
                deadline = min(deadline, time.monotonic() + GRACE_S)
            left = deadline - time.monotonic()
            try:
                rank, kind, value = self._results.get(timeout=max(0.01, min(left, 1.0)))
                got[rank] = (kind, value)
                continue
            except queue.Empty:
                pass
            dead = [r for r, p in enumerate(self._procs) if not p.is_alive() and r not in got]
            if dead or time.monotonic() >= deadline:
                missing = [r for r in range(self.world_size) if r not in got]
                errors = "".join(f"\n--- rank {r} raised:\n{v}" for r, (k, v) in sorted(got.items())
                                 if k == "error")
                self.close()
                cause = (f"rank(s) {dead} died" if dead else
                         f"rank(s) {missing} did not finish within {timeout:.0f}s (a hang?)")
                raise RankFailure(f"{self.world_size}-rank run failed to {what}: {cause}{errors}")
        return [got[r] for r in range(self.world_size)]

    def run(self, fn: Callable, *args, timeout: float = 120.0, **kwargs) -> List[Any]:
        """``[fn(rank, world_size, *args, **kwargs) for each rank]``, run concurrently on the ranks."""
        if not self.healthy:
            raise RankFailure("this pool was torn down after an earlier failure")
        for q in self._tasks:
            q.put((fn, args, kwargs))
        got = self._collect(timeout, f"run {getattr(fn, '__name__', fn)}")
        errors = [(r, v) for r, (k, v) in enumerate(got) if k == "error"]
        if errors:
            self.close()
            raise RankFailure("".join(f"\n--- rank {r} raised:\n{v}" for r, v in errors))
        return [v for _, v in got]

    def gloo_loops(self) -> int:
        """The most gloo socket threads (``gloo_tcp_loop``) any rank holds; 0 where /proc is not
        readable."""
        most = 0
        for p in self._procs:
            try:
                tasks = os.listdir(f"/proc/{p.pid}/task")
            except OSError:
                continue
            count = 0
            for t in tasks:
                try:
                    with open(f"/proc/{p.pid}/task/{t}/comm") as f:
                        count += f.read().strip() == "gloo_tcp_loop"
                except OSError:
                    pass
            most = max(most, count)
        return most

    def stop(self) -> None:
        """Ask every rank to leave (it destroys its group and exits); ``close`` waits for them."""
        self.healthy = False
        for q, p in zip(self._tasks, self._procs):
            if p.is_alive():
                try:
                    q.put(None)
                except (OSError, ValueError):
                    pass

    def close(self) -> None:
        self.stop()
        deadline = time.monotonic() + 5
        for p in self._procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(timeout=5)


class Pools:
    """One pool per world size, created on first use, rebuilt after a failure."""

    def __init__(self, backend: str | None = None):
        self.backend = backend or os.environ.get("PYFUSED_TEST_BACKEND", "gloo")
        self._pools: dict[int, RankPool] = {}

    def run(self, world_size: int, fn: Callable, *args, timeout: float = 120.0, **kwargs) -> List[Any]:
        pool = self._pools.get(world_size)
        if pool is None or not pool.healthy:
            pool = self._pools[world_size] = RankPool(world_size, self.backend)
        return pool.run(fn, *args, timeout=timeout, **kwargs)

    def recycle_crowded(self, limit: int = MAX_GLOO_LOOPS) -> None:
        """Close the pools whose ranks hold more than ``limit`` gloo socket threads (module
        docstring); call it between tests only."""
        for world_size, pool in list(self._pools.items()):
            if pool.healthy and pool.gloo_loops() > limit:
                pool.close()
                del self._pools[world_size]

    def close(self) -> None:
        for pool in self._pools.values():  # every pool's ranks exit at once, then each is joined
            pool.stop()
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()

