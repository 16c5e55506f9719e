"""Driver for compute-sanitizer over the fused kernels (benchmarks/gpu_check.sh, steps memcheck_*,
racecheck).

    compute-sanitizer --tool memcheck  --target-processes all --error-exitcode 9 \
        python benchmarks/sanitize_fused.py --world 2
    compute-sanitizer --tool racecheck --target-processes all --error-exitcode 9 \
        python benchmarks/sanitize_fused.py --world 1

Spawns ``--world`` ranks on this host's GPU(s) (rank r on cuda:r % count), joined by a gloo group:
the fused implementations (pyfused/fused) need a group only for the symmetric-buffer exchange and
their buffers' barriers, and gloo keeps NCCL's own kernels out of the sanitizer's report. Each rank
runs every fused kernel on small odd shapes -- the custom all-reduce (one-shot and two-shot, every
epilogue), then every case of every fused op (pyfused/testing/virtual_cases.py, from the op
registry: GEMM + all-reduce, all-gather + GEMM, GEMM + reduce-scatter, their backwards, ...) --
``--iters`` times, checks the results against fp64 references on the CPU, frees its buffers and
exits 0; any mismatch or error exits 1 (and the sanitizer exits 9 on a memory or race error it
found).

``--virtual`` runs the ranks as virtual ranks of this one process instead
(pyfused/testing/virtual_ranks.py: one stream and an SM share per rank, truly concurrent on one
GPU), every case of pyfused/testing/virtual_cases.py in bf16: what the sanitizer sees is then one
process whose ranks' kernels run at the same time, as on a node, rather than time-sliced processes
-- where the tool lets them: a tool that serializes a process's kernel launches deadlocks virtual
ranks (their kernels wait on each other) until the fused timeout, so benchmarks/gpu_check.sh runs
the sanitizer over one process per rank.

``--cpu`` runs the same driver on CPU (host-shm buffers, CPU kernels, Triton interpreter): a check
of the driver itself where there is no GPU (tests/test_fused.py runs it).
"""
from __future__ import annotations

import argparse
import datetime
import os
import socket
import sys
import traceback


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _close(got, want, tol, what):
    scale = max(want.double().abs().max().item(), 1e-30)
    err = (got.double().cpu() - want.double()).abs().max().item() / scale
    if not err <= tol:
        raise AssertionError(f"{what}: relative error {err:.3g} > {tol}")


def _cases():
    """Every virtual-rank case of the registered ops (pyfused/testing/virtual_cases.py): each fused
    op's inputs, fused call and fp64 reference."""
    from pyfused.ops.registry import OPS
    from pyfused.testing.virtual_cases import cases

    return cases(OPS.values())


def _body(rank: int, world: int, iters: int, cpu: bool) -> None:
    import torch
    import torch.distributed as dist

    from pyfused.comm.symmetric import free_all
    from pyfused.fused.all_reduce import all_reduce_rows
    from pyfused.fused.config import ONE_SHOT, TWO_SHOT
    from pyfused.testing.virtual_cases import max_rel_error

    if cpu:
        dev, kw = torch.device("cpu"), {"backend": "host-shm"}
    else:
        dev, kw = torch.device("cuda", rank % torch.cuda.device_count()), {}
        torch.cuda.set_device(dev)
    pg = dist.group.WORLD
    tol = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}
    # The Triton interpreter computes bf16 dots wrongly on CPU (tests/test_gemm.py checks bf16 on GPUs
    # only), so the CPU check of this driver uses float16.
    dtypes = (torch.float32, torch.float16) if cpu else (torch.float32, torch.bfloat16)
    cases = _cases()

    def per_rank(seed, shape, dtype):
        g = torch.Generator().manual_seed(seed)
        return [torch.randn(*shape, generator=g).to(dtype) for _ in range(world)]

    for it in range(iters):
        for dtype in dtypes:
            # the all-reduce kernel with every epilogue
            for rows, cols in ((1, 1), (7, 17), (130, 40)):
                xs = per_rank(it + rows, (rows, cols), dtype)
                res = per_rank(it + 1000, (rows, cols), dtype)[0]
                w = per_rank(it + 2000, (cols,), torch.float32)[0]
                h = sum(x.double() for x in xs) + res.double()
                ref = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
                for algo in (ONE_SHOT, TWO_SHOT):
                    res_out = torch.empty(rows, cols, dtype=dtype, device=dev)
                    out = all_reduce_rows(xs[rank].to(dev), pg, residual=res.to(dev), residual_out=res_out,
                                          weight=w.to(dev), eps=1e-6, algo=algo, **kw)
                    _close(res_out, h, tol[dtype], f"all_reduce_rows h {rows}x{cols} algo {algo}")
                    _close(out, ref, tol[dtype], f"all_reduce_rows norm {rows}x{cols} algo {algo}")
            # every fused op, as its cases say (rows 3: a rank's own rows, odd; n 40, k 48)
            for name, case in cases.items():
                inputs = case.make(world, 3, 40, 48, dtype, torch.device("cpu"), it)
                out = case.fused(pg, *(t.to(dev) for t in inputs[rank]), **kw)
                err = max_rel_error([out], case.reference(inputs)[rank:rank + 1])
                if not err <= tol[dtype]:
                    raise AssertionError(f"{name}: relative error {err:.3g} > {tol[dtype]}")
    if not cpu:
        from pyfused.fused.gemm_collectives import TIMEOUTS

        torch.cuda.synchronize()
        TIMEOUTS.check(sync=True)  # no bounded wait in a Triton kernel gave up
    free_all()


def _virtual_main(world: int, iters: int, cpu: bool) -> int:
    if cpu:
        os.environ["TRITON_INTERPRET"] = "1"  # before pyfused.kernels is imported
    import torch

    from pyfused.testing.virtual_cases import max_rel_error
    from pyfused.testing.virtual_ranks import VirtualGroup

    dtype, (rows, n, k) = (torch.float32, (6, 20, 12)) if cpu else (torch.bfloat16, (40, 72, 96))
    tol = 1e-4 if cpu else 3e-2
    group = VirtualGroup(world, "cpu" if cpu else "cuda")
    failed = 0
    for it in range(iters):
        for name, case in _cases().items():
            inputs = case.make(world, rows, n, k, dtype, group.device, it)
            err = max_rel_error(group.run(case.fused, inputs), case.reference(inputs))
            if not err <= tol:
                print(f"--- {name} (virtual W={world}, iteration {it}): relative error {err:.3g} > {tol}",
                      file=sys.stderr)
                failed += 1
    group.free()
    print(f"sanitize_fused: virtual world {world}, {iters} iterations: "
          f"{'FAILED' if failed else 'all kernels ran and matched'}")
    return 1 if failed else 0


def _rank_main(rank: int, world: int, port: int, iters: int, cpu: bool, results) -> None:
    if cpu:
        os.environ["TRITON_INTERPRET"] = "1"  # before pyfused.kernels is imported
    import torch.distributed as dist

    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=600))
        _body(rank, world, iters, cpu)
        dist.destroy_process_group()
        results.put((rank, None))
    except BaseException:  # report everything; the parent decides
        results.put((rank, traceback.format_exc()))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--iters", type=int, default=2)
    p.add_argument("--cpu", action="store_true", help="check the driver on CPU (no GPU needed)")
    p.add_argument("--virtual", action="store_true", help="the ranks as virtual ranks of one process")
    args = p.parse_args(argv)
    if args.virtual:
        return _virtual_main(args.world, args.iters, args.cpu)
    os.environ.setdefault("TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES", "1")
    if args.world == 1:
        import multiprocessing as mp

        q = mp.get_context("spawn").SimpleQueue()
        _rank_main(0, 1, _free_port(), args.iters, args.cpu, q)
        errors = [q.get()]
    else:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        q = ctx.SimpleQueue()
        port = _free_port()
        procs = [ctx.Process(target=_rank_main, args=(r, args.world, port, args.iters, args.cpu, q))
                 for r in range(args.world)]
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join()
        errors = [q.get() for _ in procs if not q.empty()]
        if len(errors) < args.world:
            errors.append((-1, f"only {len(errors)} of {args.world} ranks reported (a crash?)"))
    failed = [(r, e) for r, e in errors if e]
    for r, e in failed:
        print(f"--- rank {r} failed:\n{e}", file=sys.stderr)
    print(f"sanitize_fused: world {args.world}, {args.iters} iterations: "
          f"{'FAILED' if failed else 'all kernels ran and matched'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
