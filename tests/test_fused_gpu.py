"""The fused method on a GPU (marked gpu; benchmarks/gpu_check.sh runs world size 1; larger worlds
need PYFUSED_TEST_BACKEND=nccl and one GPU per rank -- on one GPU, tests/test_virtual_ranks.py): the
public ops with method="fused" against the unfused method, forward and backward; the CUDA
all-reduce's one-shot == two-shot bit for bit on every rank; torch.compile over the fused ops. The
CPU models of the same kernels and schedules are in tests/test_fused.py.
"""
import os

import pytest
import torch

from tests.test_fused import ONE_SHOT, TWO_SHOT, _expected_h
from tests.utils import rank_tensors


def _need_nccl_pool(world):
    if world > 1 and "nccl" not in os.environ.get("PYFUSED_TEST_BACKEND", "gloo"):
        pytest.skip("multi-rank GPU runs need PYFUSED_TEST_BACKEND=nccl")


GPU_OPS = {  # op: (a shape per rank, n) -- odd K and N, and a size above the one-shot limit
    "all_gather_matmul": [((64, 96), 80), ((1024, 4096), 4096)],
    "matmul_reduce_scatter": [((128, 96), 80), ((4096, 1024), 4096)],
    "matmul_all_reduce": [((64, 96), 80), ((2048, 1024), 4096)],
}


def _gpu_op_body(rank, world, op, dtype, iters):
    """``iters`` calls of the fused op (epochs advance; a race between calls would show as a wrong
    result in some iteration) against the unfused method, forward and backward."""
    import pyfused.ops as ops

    dev = torch.device("cuda", torch.cuda.current_device())
    fn = getattr(ops, op)
    tol = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}[dtype]
    for shape, n in GPU_OPS[op]:
        for it in range(iters):
            a_all = rank_tensors(it, world, shape, dtype)
            b_all = rank_tensors(it + 50, world, (shape[-1], n), dtype, scale=shape[-1] ** -0.5)
            a = a_all[rank].to(dev).requires_grad_()
            b = b_all[rank].to(dev).requires_grad_()
            a2, b2 = a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
            y, ref = fn(a, b, method="fused"), fn(a2, b2, method="unfused")
            g = torch.randn_like(ref)
            y.backward(g)
            ref.backward(g)
            pairs = ((y, ref, "out"), (a.grad, a2.grad, "grad a"), (b.grad, b2.grad, "grad b"))
            for got, want, what in pairs:
                scale = max(want.double().abs().max().item(), 1e-30)
                err = (got.double() - want.double()).abs().max().item() / scale
                assert err <= tol, f"{op} {shape}x{n} {dtype} iter {it} rank {rank}: {what} rel err {err:.3g}"
    from pyfused.fused.gemm_collectives import TIMEOUTS

    TIMEOUTS.check(sync=True)  # no bounded wait in a Triton kernel gave up
    return True


@pytest.mark.gpu
@pytest.mark.parametrize("op", sorted(GPU_OPS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("world", [1, 2, 4], ids=lambda w: f"w{w}")
def test_fused_ops_gpu(ranks, world, dtype, op):
    _need_nccl_pool(world)
    if world == 1:
        assert _gpu_op_body(0, 1, op, dtype, iters=3)
    else:
        assert all(ranks.run(world, _gpu_op_body, op, dtype, 3, timeout=600))


def _compiled_mlp_step(rank, world, backend, method="fused"):
    """A sequence-parallel Column -> GELU -> Row MLP, eager vs torch.compile: the same output and
    gradients (with method="fused", on the GPU: all_gather_matmul + matmul_reduce_scatter fused
    forward, their fused duals backward). Other methods run on CPU, which checks this body."""
    import torch.nn as nn
    import torch.nn.functional as F

    from pyfused.layers import ColumnParallelLinear, RowParallelLinear

    dev = torch.device("cuda", torch.cuda.current_device()) if method == "fused" else torch.device("cpu")
    torch.manual_seed(0)
    fc1, fc2 = nn.Linear(96, 80 * world).to(dev), nn.Linear(80 * world, 96).to(dev)
    group = _default_group()
    col = ColumnParallelLinear.from_linear(fc1, group, sequence_parallel=True, overlap=method)
    row = RowParallelLinear.from_linear(fc2, group, sequence_parallel=True, overlap=method)

    def step(x):
        y = row(F.gelu(col(x)))
        y.square().sum().backward()
        return y

    x = torch.randn(64 * world, 96, generator=torch.Generator().manual_seed(1)).to(dev)
    shard = x[rank * 64:(rank + 1) * 64]
    results = []
    for fn in (step, torch.compile(step, backend=backend)):
        for p_ in (*col.parameters(), *row.parameters()):
            p_.grad = None
        xs = shard.clone().requires_grad_()
        y = fn(xs)
        results.append([y, xs.grad, col.weight.grad, row.weight.grad, row.bias.grad])
    for got, want, what in zip(results[1], results[0], ("out", "grad x", "grad w1", "grad w2", "grad b2")):
        err = (got.double() - want.double()).abs().max().item() / max(want.double().abs().max().item(), 1e-30)
        assert err <= 1e-4, f"{backend} rank {rank}: {what} rel err {err:.3g}"
    return True


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("world", [1, 2], ids=lambda w: f"w{w}")
def test_torch_compile_fused_gpu(ranks, world, backend):
    """The ops work under torch.compile on GPU with the fused method (the CPU test with the
    decomposed method is tests/test_ops_properties.py::test_torch_compile_decomposed)."""
    _need_nccl_pool(world)
    if world == 1:
        assert _compiled_mlp_step(0, 1, backend)
    else:
        assert all(ranks.run(world, _compiled_mlp_step, backend, timeout=600))


def test_torch_compile_step_body_on_cpu(ranks):
    """The GPU test's body, run on CPU with the decomposed method (aot_eager), so that the body
    itself is known to work before a GPU runs it."""
    assert all(ranks.run(2, _compiled_mlp_step, "aot_eager", "decomposed", timeout=300))

def _gpu_algos_agree(rank, world):
    """CUDA one-shot == two-shot bit for bit, the same bits on every rank, h exact, and many calls
    in a row (epochs) stay right."""
    from pyfused.fused.all_reduce import all_reduce_rows

    dev = torch.device("cuda", torch.cuda.current_device())
    outs = []
    for rows, cols in [(1, 1), (7, 17), (130, 33), (257, 8192)]:
        for it in range(10):
            xs = rank_tensors(it, world, (rows, cols), torch.bfloat16)
            res = rank_tensors(it + 99, 1, (rows, cols), torch.bfloat16)[0]
            w = rank_tensors(it + 7, 1, (cols,), torch.float32)[0]
            h = _expected_h(xs, res, torch.bfloat16)
            got = []
            for algo in (ONE_SHOT, TWO_SHOT):
                res_out = torch.empty(rows, cols, dtype=torch.bfloat16, device=dev)
                out = all_reduce_rows(xs[rank].to(dev), None if world == 1 else _default_group(),
                                      residual=res.to(dev), residual_out=res_out, weight=w.to(dev),
                                      eps=1e-6, algo=algo)
                assert torch.equal(res_out.cpu(), h), f"{rows}x{cols} algo {algo} iter {it}: h not exact"
                got.append(out.cpu())
            assert torch.equal(got[0], got[1]), f"{rows}x{cols} iter {it}: one-shot != two-shot"
            outs.append(got[0])
    return outs


def _default_group():
    import torch.distributed as dist

    return dist.group.WORLD if dist.is_initialized() else None


@pytest.mark.gpu
@pytest.mark.parametrize("world", [1, 2, 4], ids=lambda w: f"w{w}")
def test_all_reduce_rows_gpu_exact_and_replicated(ranks, world):
    _need_nccl_pool(world)
    per_rank = [_gpu_algos_agree(0, 1)] if world == 1 else ranks.run(world, _gpu_algos_agree, timeout=600)
    for r in range(1, world):
        assert all(torch.equal(a, b) for a, b in zip(per_rank[0], per_rank[r])), f"rank {r} differs"
