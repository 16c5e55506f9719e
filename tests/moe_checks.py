"""Rank bodies shared by the tests of the MoE ops (moe_dispatch, moe_combine) and their layer.

Every rank builds every rank's inputs from one seed -- tokens (a different, odd count per rank),
routing, the experts' weights -- so it can compute the single-process result of the whole group
with autograd in fp64, and compares its own outputs and gradients with it.

Routing cases (``ROUTES``), each with its own top-k:
  topk        k = 2 distinct experts per token, uniformly;
  top1        k = 1;
  skewed      k = 2 among experts 0, 1 and the last only: the experts between get no token (with
              three or more ranks, a whole rank receives nothing);
  one_expert  k = 1, every token to expert 0;
  idle_rank   k = 2, and the last rank has no token at all (it still receives).
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from tests.utils import assert_close, test_device

ROUTES = ("topk", "top1", "skewed", "one_expert", "idle_rank")
# The MoE tests run a cut grid by default (each world size, method and routing case at least once);
# PYFUSED_FULL_MOE_MATRIX=1 runs every combination.
FULL_MATRIX = os.environ.get("PYFUSED_FULL_MOE_MATRIX") == "1"


def grid(full, default):
    """``full`` with PYFUSED_FULL_MOE_MATRIX=1, else ``default``."""
    return list(full) if FULL_MATRIX else list(default)
HIDDEN, FFN = 13, 10  # odd on purpose


def tokens_per_rank(world: int, route: str):
    counts = [7 + 4 * r for r in range(world)]  # 7, 11, 15, 19: not multiples of anything
    if route == "idle_rank":
        counts[-1] = 0
    return counts


def routing(world: int, experts: int, route: str, seed: int):
    """Every rank's (topk_idx [T, k], topk_weights [T, k] fp32, summing to 1 per token)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for tokens in tokens_per_rank(world, route):
        if route in ("top1", "one_expert"):
            k = 1
        else:
            k = 2
        scores = torch.rand(tokens, experts, generator=g)
        if route == "skewed":
            allowed = torch.zeros(experts, dtype=torch.bool)
            allowed[[0, 1, experts - 1]] = True
            scores = scores.masked_fill(~allowed, -1.0)
        idx = scores.topk(k, dim=1).indices
        if route == "one_expert":
            idx = torch.zeros_like(idx)
        weights = torch.rand(tokens, k, generator=g) + 0.2
        out.append((idx, weights / weights.sum(1, keepdim=True)))
    return out


def make_case(world: int, route: str, seed: int, experts_per_rank: int = 2):
    """(x per rank, routing per rank, full W1 [E, H, FFN], full W2 [E, FFN, H]) in fp32."""
    experts = experts_per_rank * world
    g = torch.Generator().manual_seed(seed + 1)
    xs = [torch.randn(t, HIDDEN, generator=g) for t in tokens_per_rank(world, route)]
    w1 = torch.randn(experts, HIDDEN, FFN, generator=g) * HIDDEN ** -0.5
    w2 = torch.randn(experts, FFN, HIDDEN, generator=g) * FFN ** -0.5
    return xs, routing(world, experts, route, seed + 2), w1, w2


def dense_moe(x, idx, weights, w1, w2):
    """The single-process MoE MLP, one token at a time: sum_j w_j * gelu(x @ W1[e_j]) @ W2[e_j]."""
    rows = []
    for t in range(x.shape[0]):
        acc = x.new_zeros(w2.shape[2])
        for j in range(idx.shape[1]):
            e = int(idx[t, j])
            acc = acc + weights[t, j] * (F.gelu(x[t] @ w1[e]) @ w2[e])
        rows.append(acc)
    return torch.stack(rows) if rows else x.new_zeros((0, w2.shape[2]))


def grad_of(t: torch.Tensor) -> torch.Tensor:
    """``t.grad``, or zeros where nothing reached ``t`` (a rank without tokens)."""
    return torch.zeros_like(t) if t.grad is None else t.grad


def backward(refs, grads, out, grad):
    """Backward of the reference loss sum_s <refs[s], grads[s]> and of <out, grad>; a side on which
    nothing needs a gradient (no token anywhere) is skipped."""
    loss = sum((r * g.double()).sum() for r, g in zip(refs, grads))
    if loss.requires_grad:
        loss.backward()
    if out.requires_grad:
        out.backward(grad)


def check_moe_mlp(rank, world, method, dtype, routes, seed):
    """dispatch -> gelu -> combine on this rank == the dense fp64 MoE MLP of the whole group:
    output, and the gradients of x, this rank's W1 / W2 shards and the routing weights."""
    from pyfused.ops import moe_combine, moe_dispatch

    dev = test_device()
    for i, route in enumerate(routes):
        xs, routed, w1, w2 = make_case(world, route, seed + 10 * i)
        el = w1.shape[0] // world
        mine = slice(rank * el, (rank + 1) * el)
        x = xs[rank].to(dev, dtype, copy=True).requires_grad_()
        idx = routed[rank][0].to(dev)
        gates = routed[rank][1].to(dev, copy=True).requires_grad_()
        a = w1[mine].to(dev, dtype, copy=True).requires_grad_()
        b = w2[mine].to(dev, dtype, copy=True).requires_grad_()
        h, layout = moe_dispatch(x, idx, a, method=method)
        out = moe_combine(F.gelu(h), gates, idx, layout, b, method=method)

        x64 = [t.to(dtype).double().requires_grad_() for t in xs]  # the inputs as rounded
        w1_64 = w1.to(dtype).double().requires_grad_()
        w2_64 = w2.to(dtype).double().requires_grad_()
        gates64 = [g.double().requires_grad_() for _, g in routed]
        refs = [dense_moe(x64[s], routed[s][0], gates64[s], w1_64, w2_64) for s in range(world)]
        what = f"moe mlp [{method}] {route} world {world} rank {rank}"
        assert out.dtype == dtype
        assert_close(out, refs[rank], dtype, f"{what} out")
        grads = [torch.randn(r.shape, generator=torch.Generator().manual_seed(seed + s))
                 for s, r in enumerate(refs)]
        backward(refs, grads, out, grads[rank].to(dev, dtype))
        assert_close(grad_of(x), grad_of(x64[rank]), dtype, f"{what} grad x")
        assert_close(grad_of(gates), grad_of(gates64[rank]), dtype, f"{what} grad topk_weights")
        assert_close(grad_of(a), grad_of(w1_64)[mine], dtype, f"{what} grad W1")
        assert_close(grad_of(b), grad_of(w2_64)[mine], dtype, f"{what} grad W2")
    return True


def check_dispatch(rank, world, method, dtype, routes, seed, with_weight):
    """moe_dispatch alone == moe_dispatch_ref: out (in expert-major order), layout, and the
    gradients of x (and of this rank's weight)."""
    from pyfused.ops import moe_dispatch, moe_dispatch_ref

    dev = test_device()
    for i, route in enumerate(routes):
        xs, routed, w1, _ = make_case(world, route, seed + 10 * i)
        el = w1.shape[0] // world
        shards = [w1[s * el:(s + 1) * el] for s in range(world)]
        x = xs[rank].to(dev, dtype, copy=True).requires_grad_()
        a = shards[rank].to(dev, dtype, copy=True).requires_grad_() if with_weight else None
        kw = {} if with_weight else {"num_experts": w1.shape[0]}
        out, layout = moe_dispatch(x, routed[rank][0].to(dev), a, method=method, **kw)

        x64 = [t.to(dtype).double().requires_grad_() for t in xs]
        s64 = [s.to(dtype).double().requires_grad_() for s in shards] if with_weight else None
        refs = moe_dispatch_ref(x64, [r[0] for r in routed], s64, w1.shape[0])
        what = f"moe_dispatch [{method}] {route} world {world} rank {rank} weight={with_weight}"
        assert torch.equal(layout.cpu(), refs[rank][1]), (what, layout, refs[rank][1])
        assert_close(out, refs[rank][0], dtype, f"{what} out")
        grads = [torch.randn(r.shape, generator=torch.Generator().manual_seed(seed + s))
                 for s, (r, _) in enumerate(refs)]
        backward([r for r, _ in refs], grads, out, grads[rank].to(dev, dtype))
        assert_close(grad_of(x), grad_of(x64[rank]), dtype, f"{what} grad x")
        if with_weight:
            assert_close(grad_of(a), grad_of(s64[rank]), dtype, f"{what} grad weight")
    return True


def check_combine(rank, world, method, dtype, routes, seed, with_weight, weighted=True):
    """moe_combine alone == moe_combine_ref: out, and the gradients of y, topk_weights and this
    rank's weight. The rows y are random, as many as each rank's dispatch receives."""
    from pyfused.ops import moe_combine, moe_combine_ref
    from pyfused.ops.moe_dispatch import expert_major_pairs

    dev = test_device()
    for i, route in enumerate(routes):
        _, routed, _, w2 = make_case(world, route, seed + 10 * i)
        experts = w2.shape[0]
        el = experts // world
        idx = [r[0] for r in routed]
        layouts = [layout for _, layout in expert_major_pairs(idx, experts)]
        g = torch.Generator().manual_seed(seed + 20 * i)
        ys = [torch.randn(int(layout.sum()), FFN, generator=g).to(dtype) for layout in layouts]
        shards = [w2[s * el:(s + 1) * el].to(dtype) for s in range(world)]
        y = ys[rank].to(dev, copy=True).requires_grad_()
        gates = routed[rank][1].to(dev, copy=True).requires_grad_() if weighted else None
        b = shards[rank].to(dev, copy=True).requires_grad_() if with_weight else None
        out = moe_combine(y, gates, idx[rank].to(dev), layouts[rank].to(dev), b, method=method)

        y64 = [t.double().requires_grad_() for t in ys]
        gates64 = [r[1].double().requires_grad_() if weighted else torch.ones_like(r[1]).double()
                   for r in routed]
        b64 = [s.double().requires_grad_() for s in shards] if with_weight else None
        refs = moe_combine_ref(y64, gates64, idx, b64, experts)
        what = (f"moe_combine [{method}] {route} world {world} rank {rank} weight={with_weight} "
                f"weighted={weighted}")
        assert out.dtype == dtype
        assert_close(out, refs[rank], dtype, f"{what} out")
        grads = [torch.randn(r.shape, generator=torch.Generator().manual_seed(seed + s))
                 for s, r in enumerate(refs)]
        backward(refs, grads, out, grads[rank].to(dev, dtype))
        assert_close(grad_of(y), grad_of(y64[rank]), dtype, f"{what} grad y")
        if weighted:
            assert_close(grad_of(gates), grad_of(gates64[rank]), dtype, f"{what} grad topk_weights")
        if with_weight:
            assert_close(grad_of(b), grad_of(b64[rank]), dtype, f"{what} grad weight")
    return True
