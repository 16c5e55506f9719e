"""Per-call host time of the fused methods' Python path, on CPU, by component.

Runs each fused implementation (pyfused/fused/gemm_collectives.py) on CPU tensors over a gloo group
(world 1 by default; ``torchrun --nproc-per-node 2`` for world 2, backend "host-shm") with the
Triton launches replaced by a stub that returns at once, so the time measured is the host work
around the kernels: argument checks, plan lookup, symmetric-buffer views, flag writes, status
words, stream helpers and the launchers' own bookkeeping. No interpreter runs and nothing is
computed; the outputs are not checked (the tests do that).

Figures per op:
  * us per call: the median over ``--rounds`` rounds of ``--calls`` back-to-back calls, timed
    with ``time.perf_counter`` and no profiler attached, in a shuffled order per round; beside it
    the same in this thread's CPU time (``time.thread_time``), which time spent descheduled on a
    loaded machine does not inflate.
  * ``--profile``: one more pass under cProfile; per component (``COMPONENTS``: the functions that
    make it up), the cumulative time per call. cProfile slows Python calls, so these figures are
    larger than ``us_per_call``; they say where the time goes, not what it is.

What a CPU run cannot show: the CUDA-only branches (events, pinned copies, side streams, the relay
of GEMM + reduce-scatter) and the driver's own launch. ``--jit-launch`` times the Python part of
Triton's compiled launch instead (``JITFunction.run``: binding and specializing the arguments, the
cache key, the lookup), for the persistent GEMM with the all-gather GEMM's arguments, against a
stand-in driver (an sm_90 target, stream 0) and a stand-in compiled kernel whose launch does
nothing: a lower bound of what ``kernel[grid](...)`` costs a GPU host per call.

    PYTHONPATH=$PWD python benchmarks/profile_fused_host.py --profile
    PYTHONPATH=$PWD python benchmarks/profile_fused_host.py --jit-launch
"""
from __future__ import annotations

import os
import sys

if "--jit-launch" not in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # CPU tensors run only in the interpreter

import argparse  # noqa: E402
import contextlib  # noqa: E402
import cProfile  # noqa: E402
import pstats  # noqa: E402
import random  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from typing import Callable, Dict, Iterator, List, Tuple  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

# Component -> the functions (file name ending, function name) whose cumulative time makes it up.
# None of them calls another of the list, so the components do not overlap.
COMPONENTS = {
    "argument checks": [("gemm_launch.py", "_check_inputs"), ("gemm_launch.py", "_check_options"),
                        ("reduce_launch.py", "check_backend"), ("reduce_launch.py", "check_flags"),
                        ("reduce_launch.py", "_check_reduce_tensors"),
                        ("config.py", "check_not_capturing")],
    "plans and configs": [("gemm_launch.py", "plan_gemm"), ("reduce_configs.py", "choose_reduce_config"),
                          ("reduce_launch.py", "chunk_rows_of"), ("gemm_configs.py", "arch_of"),
                          ("reduce_launch.py", "chunk_order_tensor"), ("config.py", "grid_budget")],
    "timeout settings": [("config.py", "timeout_ms"), ("reduce_launch.py", "timeout_ns")],
    "status words": [("reduce_launch.py", "new_status"), ("reduce_launch.py", "raise_on_timeout"),
                     ("gemm_collectives.py", "watch"), ("gemm_collectives.py", "check")],
    "symmetric buffer": [("symmetric.py", "get"), ("symmetric.py", "next_epoch"),
                         ("symmetric.py", "peer"), ("symmetric.py", "flags"),
                         ("gemm_collectives.py", "_table"), ("gemm_collectives.py", "_element_size")],
    "flags and barriers": [("flags.py", "signal_flag"), ("gemm_collectives.py", "_barrier")],
    "streams": [("streams.py", "push_streams"), ("streams.py", "join_comm_stream"),
                ("streams.py", "comm_stream")],
    "group queries": [("group.py", "resolve_group"), ("group.py", "world_size"), ("group.py", "rank")],
    "launch (stub)": [("profile_fused_host.py", "launch")],
}


class _Launch:
    """What ``stub[grid]`` returns: a launch that does nothing."""

    def __call__(self, *args, **kwargs) -> None:
        return launch(*args, **kwargs)


LAUNCHES = [0]  # stubbed launches so far


def launch(*args, **kwargs) -> None:
    """The stub's launch (a function of its own, so cProfile names it)."""
    LAUNCHES[0] += 1


@contextlib.contextmanager
def stubbed_launches() -> Iterator[None]:
    """Replace the persistent GEMM and the multi-source reduce by interpreted-function objects whose
    ``kernel[grid](...)`` does nothing: the launchers still see an interpreted kernel (CPU)."""
    from triton.runtime.interpreter import InterpretedFunction

    from pyfused.kernels import gemm, reduce

    class StubKernel(InterpretedFunction):
        def __getitem__(self, grid):
            return _Launch()

    saved = {}
    for module, name in ((gemm, "persistent_gemm_kernel"), (reduce, "multi_source_reduce_kernel")):
        real = getattr(module, name)
        stub = StubKernel.__new__(StubKernel)
        stub.__dict__.update(real.__dict__)
        saved[(module, name)] = real
        setattr(module, name, stub)
    try:
        yield
    finally:
        for (module, name), real in saved.items():
            setattr(module, name, real)


def _ops(pg, world: int, rank: int) -> Dict[str, Callable[[], object]]:
    from pyfused.fused.gemm_collectives import fused_all_gather_matmul, fused_matmul_reduce_scatter

    gen = torch.Generator().manual_seed(rank)
    m, k, n = 16, 256, 256  # the overhead suite's first CPU shape
    a = torch.randn(m, k, generator=gen)
    a_rs = torch.randn(m * world, k, generator=gen)
    b = torch.randn(k, n, generator=gen)
    kw = dict(backend="host-shm")
    return {
        f"all_gather_matmul {m}x{k}x{n}": lambda: fused_all_gather_matmul(a, b, pg, False, **kw),
        f"matmul_reduce_scatter {m * world}x{k}x{n}": lambda: fused_matmul_reduce_scatter(a_rs, b, pg, **kw),
    }


def _timed(ops: Dict[str, Callable[[], object]], pg, world: int, rounds: int,
           calls: int) -> Tuple[Dict[str, List[float]], Dict[str, List[float]]]:
    """Per op and round, us per call in wall-clock time and in this thread's CPU time."""
    names = list(ops)
    times: Dict[str, List[float]] = {name: [] for name in names}
    cpu: Dict[str, List[float]] = {name: [] for name in names}
    order = random.Random(rounds)
    for _ in range(rounds):
        for name in order.sample(names, len(names)):
            if world > 1:
                dist.barrier(group=pg)
            fn = ops[name]
            t0, c0 = time.perf_counter(), time.thread_time()
            for _ in range(calls):
                fn()
            times[name].append((time.perf_counter() - t0) * 1e6 / calls)
            cpu[name].append((time.thread_time() - c0) * 1e6 / calls)
    return times, cpu


def _profiled(fn: Callable[[], object], calls: int) -> Dict[str, float]:
    """us per call per component under cProfile, and the total."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    stats = pstats.Stats(prof).stats
    out = {}
    for component, funcs in COMPONENTS.items():
        cum = 0.0
        for (path, _line, func), (_cc, _nc, _tt, ct, _callers) in stats.items():
            if any(path.endswith(f) and func == name for f, name in funcs):
                cum += ct
        out[component] = cum * 1e6 / calls
    out["total (profiled)"] = sum(tt for (_cc, _nc, tt, _ct, _c) in stats.values()) * 1e6 / calls
    return out


def _top(fn: Callable[[], object], calls: int, limit: int) -> None:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    if limit:
        pstats.Stats(prof).sort_stats("tottime").print_stats(limit)


def jit_launch_us(rounds: int, calls: int) -> List[float]:
    """Per round, us per ``persistent_gemm_kernel[grid](...)`` through ``JITFunction.run`` with a
    stand-in driver and compiled kernel (module docstring); needs TRITON_INTERPRET unset."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver

    from pyfused.kernels import gemm

    class StandInDriver:
        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

    class StandInKernel:
        function = packed_metadata = None

        def launch_metadata(self, grid, stream, *args):
            return None

        def run(self, *args):
            return None

    kernel = gemm.persistent_gemm_kernel
    if not hasattr(kernel, "device_caches"):
        raise RuntimeError("--jit-launch needs the compiled kernel: unset TRITON_INTERPRET")
    driver.set_active(StandInDriver())

    def compile_nothing(key, signature, device, constexprs, options, attrs, warmup):
        compiled = kernel.device_caches[device][0][key] = StandInKernel()
        return compiled

    kernel._do_compile = compile_nothing
    m, k, n = 16, 256, 256  # the arguments fused_all_gather_matmul passes at world 1
    a, b, c = torch.randn(m, k), torch.randn(k, n), torch.empty(m, n)
    word = torch.zeros(1, dtype=torch.int32)
    args = (a, b, c, word, word, word, word, word, word, m, n, k, m, 1, k, 1, n, 1, n, 1, 1,
            1 << 26, 60 * 10**9)
    options = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, GROUP_M=8, EVEN_K=True, WAIT=True,
                   SIGNAL=False, SCATTER=False, HAS_BIAS=False, HAS_ORDER=True, ALIGNED_OUT=False,
                   INPUT_PRECISION="tf32", FLAG_SCOPE="sys", SIGNAL_SCOPE="gpu", WALL_CLOCK=True,
                   num_warps=4, num_stages=3)
    kernel[(4,)](*args, **options)  # the stand-in "compile"
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            kernel[(4,)](*args, **options)
        times.append((time.perf_counter() - t0) * 1e6 / calls)
    return times


def _init_group() -> None:
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group("gloo")
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=200, help="calls per timed round")
    p.add_argument("--rounds", type=int, default=31, help="timed rounds (the median is reported)")
    p.add_argument("--profile", action="store_true", help="also the per-component split (cProfile)")
    p.add_argument("--top", type=int, default=0, help="also print cProfile's top N functions per op")
    p.add_argument("--jit-launch", action="store_true",
                   help="time Triton's compiled launch path instead (module docstring)")
    args = p.parse_args()
    if args.jit_launch:
        t = jit_launch_us(args.rounds, args.calls)
        print(f"persistent_gemm_kernel[grid](...) through JITFunction.run: {statistics.median(t):.1f} "
              f"us per launch (median of {args.rounds} rounds of {args.calls}; best {min(t):.1f})")
        return
    _init_group()
    pg = dist.group.WORLD
    world, rank = dist.get_world_size(), dist.get_rank()
    from pyfused.comm.symmetric import free_all

    try:
        with stubbed_launches():
            ops = _ops(pg, world, rank)
            launches = {}
            for name, fn in ops.items():  # buffers, tables and caches are made on the first call
                before = LAUNCHES[0]
                fn()
                launches[name] = LAUNCHES[0] - before
            times, cpu = _timed(ops, pg, world, args.rounds, args.calls)
            split = {name: _profiled(fn, args.calls) for name, fn in ops.items()} if args.profile else {}
            if rank == 0:
                for name, t in times.items():
                    print(f"{name}, world {world}: {statistics.median(t):.1f} us per call, "
                          f"{statistics.median(cpu[name]):.1f} us of thread CPU time (medians of "
                          f"{args.rounds} rounds of {args.calls} calls; best {min(t):.1f} / "
                          f"{min(cpu[name]):.1f}; {launches[name]} stubbed launches per call)")
                    for component, us in split.get(name, {}).items():
                        print(f"    {component:<20} {us:8.1f} us")
            for name, fn in ops.items() if args.top else ():  # every rank calls: they are collective
                if rank == 0:
                    print(f"--- {name}")
                _top(fn, args.calls, args.top if rank == 0 else 0)
        if world > 1:
            dist.barrier()
    finally:
        free_all()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
