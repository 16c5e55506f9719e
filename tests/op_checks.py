"""Rank bodies shared by the tests of the GEMM + collective ops (any GEMM op of the registry).

Every rank builds all ranks' inputs from one seed, so it can compute the single-device fp64
reference of the whole group with autograd (the op's ``reference_per_rank`` hook), then compares
its own output and gradients with it. Losses: where each rank's output is a different tensor
(all_gather_matmul, matmul_reduce_scatter) the reference loss is sum_q <Y_q, G_q>; where the output
is replicated (``OpSpec.replicated``: matmul_all_reduce) the loss is counted once, <Y, G> with the
same G on every rank (the tensor-parallel convention).
"""
from __future__ import annotations

import torch

from pyfused.comm import InputError
from pyfused.ops.registry import OPS
from tests.utils import assert_close, rank_tensors, test_device


def reference(op: str, a64, b64):
    """Every rank's reference output (the registry's ``reference_per_rank``); one for all ranks
    where the output is replicated, so that a loss counts it once."""
    spec = OPS[op]
    outs = spec.reference_per_rank(list(zip(a64, b64)))
    return outs[:1] if spec.replicated else outs


def check_against_reference(rank, world, op, method, dtype, a_shape, n, seed, backward=True):
    """Forward (and backward) of ``op`` on this rank == the fp64 single-device reference."""
    k = a_shape[-1]
    a_all = rank_tensors(seed, world, a_shape, dtype)
    b_all = rank_tensors(seed + 1, world, (k, n), dtype, scale=k ** -0.5)
    dev = test_device()
    a = a_all[rank].to(dev, copy=True).requires_grad_(backward)
    b = b_all[rank].to(dev, copy=True).requires_grad_(backward)
    y = OPS[op].function(a, b, method=method)

    a64 = [t.double().requires_grad_(backward) for t in a_all]
    b64 = [t.double().requires_grad_(backward) for t in b_all]
    ys = reference(op, a64, b64)
    mine = ys[rank] if len(ys) > 1 else ys[0]
    assert y.dtype == dtype
    assert_close(y, mine, dtype, f"{op}[{method}] output on rank {rank}")
    if not backward:
        return True
    grads = rank_tensors(seed + 2, len(ys), ys[0].shape, dtype)
    sum((yq * gq.double()).sum() for yq, gq in zip(ys, grads)).backward()
    y.backward((grads[rank] if len(ys) > 1 else grads[0]).to(dev))
    assert_close(a.grad, a64[rank].grad, dtype, f"{op}[{method}] grad a on rank {rank}")
    assert_close(b.grad, b64[rank].grad, dtype, f"{op}[{method}] grad b on rank {rank}")
    return True


def error_of(rank, world, op, method, a_shapes, b_shapes, a_dtypes, b_dtypes):
    """Call ``op`` with per-rank inputs; return (exception type, message) or None if it succeeded.

    Every rank first forgets the calls it has seen: in validation mode "first" a rank repeating a
    signature seen in an earlier test would skip the exchange that the bad rank enters (a case the
    mode documents as bounded by the group's timeout, not caught)."""
    from pyfused.comm import forget_seen

    forget_seen()
    a = torch.randn(*a_shapes[rank]).to(test_device(), a_dtypes[rank])
    b = torch.randn(*b_shapes[rank]).to(test_device(), b_dtypes[rank])
    try:
        OPS[op].function(a, b, method=method)
    except InputError as e:
        return ("InputError", str(e))
    except Exception as e:  # noqa: BLE001 - the test wants to see what else was raised
        return (type(e).__name__, str(e))
    return None
