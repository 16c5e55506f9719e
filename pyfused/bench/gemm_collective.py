"""The body of the GEMM op suites (benchmarks/bench_<op>.py): one GEMM+collective op over shapes.

For each shape, in one run and on the same inputs:
  * the op's whole GEMM alone (``T_gemm``) and its collective alone (``T_comm``), as rows
    "gemm alone" and "<collective> alone" -- the parts the overlap efficiency is measured against;
  * every method: unfused (the baseline), decomposed, fused (a row "unavailable: <reason>" where it
    cannot run, never a made-up number) and auto (its note says what it chose and why);
  * on CUDA with several ranks, the same op on torch symmetric memory (``peers.py``): the collective
    alone, GEMM-then-collective, and torch's own fused op (async-TP). The fused method's speedup and
    overlap efficiency are then computed against those -- its own transport -- not against the
    process group's backend, which on the one-GPU testbed is NCCL over sockets.
Each method's output is first checked against the unfused one (the same check on every rank, so a
wrong result fails the suite everywhere instead of being timed). The parts and the methods are then
timed round-robin (``time_interleaved``), so none of them is favoured by when it ran.
"""
from __future__ import annotations

from typing import Callable, Dict, List

import torch
import torch.distributed as dist

from .. import comm
from ..ops import _common
from ..ops.registry import OPS
from . import peers
from .harness import BenchContext, op_row, relative_error, tensor_bytes, time_interleaved

METHODS = ("unfused", "decomposed", "fused", "auto")

# Agreement of a method's output with the unfused one, relative to max|unfused|. Loose: the
# decomposed schedules sum partial products in another order, in the input dtype.
CHECK_TOL = {torch.float64: 1e-9, torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}


def method_transport(method: str, ctx: BenchContext) -> str:
    if ctx.world == 1:
        return "none"
    return "symm-mem" if method == "fused" else ctx.transport


def agree_close(out: torch.Tensor, ref: torch.Tensor, what: str, ctx: BenchContext) -> None:
    """Raise the same error on every rank if ``out`` differs from ``ref`` on any rank."""
    tol = CHECK_TOL.get(ref.dtype, 5e-2)
    err = relative_error(out, ref)
    wrong = None
    if not err <= tol:  # NaN too
        wrong = (f"output differs from method='unfused' by {err:.3g} (relative to max|unfused|; "
                 f"allowed {tol:g}); not timing a wrong result")
    comm.agree_on(ctx.group, what, error=wrong, width=0)


def comm_alone(op: str, ctx: BenchContext, a: torch.Tensor, m_full: int, n: int
               ) -> Callable[[], None]:
    """The op's collective on buffers of the sizes the op communicates."""
    w, g, collective = ctx.world, ctx.group, OPS[op].collective
    if collective == "all_gather":
        gathered = a.new_empty((w * a.shape[0], a.shape[1]))
        return lambda: comm.all_gather_single(gathered, a, group=g)
    if collective == "reduce_scatter":
        full = torch.randn((m_full, n), device=a.device).to(a.dtype)
        out = full.new_empty((m_full // w, n))
        return lambda: comm.reduce_scatter_single(out, full, group=g)
    buf = torch.zeros((m_full, n), device=a.device, dtype=a.dtype)  # zeros: repeated sums stay finite
    return lambda: dist.all_reduce(buf, group=g)


def bench_shape(ctx: BenchContext, shape) -> List[Dict]:
    """All rows of one ``pyfused.bench.shapes.OpShape``."""
    op, dtype, w = shape.op, ctx.dtype, ctx.world
    spec = OPS[op]
    fn = spec.function
    gathers = spec.gathers_dim0
    gen = torch.Generator().manual_seed(1000 + ctx.rank)
    a = torch.randn(shape.a, generator=gen).to(ctx.device, dtype)
    b = (torch.randn(shape.b, generator=gen) * shape.b[0] ** -0.5).to(ctx.device, dtype)
    m_full = w * shape.a[0] if gathers else shape.a[0]
    k, n = shape.a[1], shape.b[1]
    flop = 2.0 * m_full * n * k
    collective = spec.collective
    # nccl-tests' S: the gathered input (all-gather) or the unreduced product (the other two)
    nbytes = tensor_bytes((m_full, k) if gathers else (m_full, n), dtype)
    label = f"{shape.label} a={shape.a[0]}x{shape.a[1]} b={shape.b[0]}x{shape.b[1]}"
    common = dict(shape=label, dtype=dtype, flop=flop, collective=collective, nbytes=nbytes,
                  m=m_full, n=n, k=k, op=op)

    # First every method once: is it available here, is its result right, what does auto pick.
    ref = fn(a, b, ctx.group, method="unfused")
    unavailable: Dict[str, str] = {}
    notes: Dict[str, str] = {}
    transports = {m: method_transport(m, ctx) for m in METHODS}
    for method in METHODS:
        try:
            out = fn(a, b, ctx.group, method=method)
        except _common.MethodUnavailable as e:  # raised on every rank alike
            unavailable[method] = f"unavailable: {e}"
            continue
        agree_close(out, ref, f"{op}[{method}] at {shape.label}", ctx)
        if method == "auto":
            choice = _common.prepare_matmul(op, a, b, ctx.group, "auto")[1]
            transports[method] = method_transport(choice.method, ctx)
            chunks = f", {choice.chunks} chunks" if choice.chunks else ""
            notes[method] = f"chose {choice.method}{chunks}: {choice.reason}"

    # Then the parts alone and the methods, timed round-robin in one run.
    a_full = torch.randn((m_full, k), generator=gen).to(ctx.device, dtype)
    timed: Dict[str, Callable[[], object]] = {"gemm": lambda: a_full @ b}
    if w > 1:
        timed["comm"] = comm_alone(op, ctx, a, m_full, n)
    for method in METHODS:
        if method not in unavailable:
            timed[method] = (lambda m=method: fn(a, b, ctx.group, method=m))
    symm = None
    if peers.status(ctx) is None:
        symm = peers.build(op, ctx, a, b, m_full, collective)
        peers.check(symm, ref, ctx, CHECK_TOL.get(dtype, 5e-2))
        timed.update({f"symm:{label}": part[0] for label, part in symm.parts.items()})
    t = time_interleaved(timed, ctx)

    t_gemm, t_comm, t_unfused = t["gemm"], t.get("comm"), t["unfused"]
    rows = [op_row(ctx, **{**common, "collective": None}, method="gemm alone", transport="none",
                   ms=t_gemm)]
    if t_comm is not None:
        rows.append(op_row(ctx, **{**common, "flop": 0.0}, method=f"{collective} alone",
                           transport=ctx.transport, ms=t_comm))
    symm_comm = symm_base = None
    if symm is not None:
        t_symm = {label: t[f"symm:{label}"] for label in symm.parts}
        symm_comm = peers.best(t_symm, peers.ALONE.format(collective=collective))
        symm_base = peers.best(t_symm, peers.UNFUSED)
    for method in METHODS:
        if method in unavailable:
            rows.append(op_row(ctx, **common, method=method, transport=transports[method],
                               ms=None, status=unavailable[method]))
            continue
        base, comm_ms, note = t_unfused, t_comm, notes.get(method, "")
        if transports[method] == peers.TRANSPORT and transports[method] != ctx.transport:
            # Compare with the same transport: torch's symm-mem collective, where it ran.
            base = symm_base[1] if symm_base else None
            comm_ms = symm_comm[1] if symm_comm else None
            same = (f"speedup vs '{symm_base[0]}', overlap vs '{symm_comm[0]}' (same transport)"
                    if symm_base and symm_comm else
                    f"no {peers.TRANSPORT} baseline ran here, so no speedup against "
                    f"{ctx.transport} is reported")
            note = f"{note}; {same}" if note else same
        rows.append(op_row(ctx, **common, method=method, transport=transports[method],
                           ms=t[method], t_baseline=base, t_gemm=t_gemm, t_comm=comm_ms, note=note))
    if symm is not None:
        rows += symm_rows(ctx, common, symm, t_symm, symm_base, symm_comm, t_gemm, collective)
    return rows


def symm_rows(ctx, common, symm, t_symm, symm_base, symm_comm, t_gemm, collective) -> List[Dict]:
    """The torch symmetric-memory rows of one shape (peers.py): speedups against the faster
    GEMM-then-collective on symmetric memory, overlap against the faster collective alone."""
    rows = []
    alone = peers.ALONE.format(collective=collective)
    for label, (_, note) in symm.parts.items():
        if label.startswith(alone):
            rows.append(op_row(ctx, **{**common, "flop": 0.0}, method=label,
                               transport=peers.TRANSPORT, ms=t_symm[label], note=note))
        else:
            rows.append(op_row(ctx, **common, method=label, transport=peers.TRANSPORT,
                               ms=t_symm[label], t_baseline=symm_base[1] if symm_base else None,
                               t_gemm=t_gemm, t_comm=symm_comm[1] if symm_comm else None,
                               note=note))
    for label, why in symm.unavailable.items():
        rows.append(op_row(ctx, **common, method=label, transport=peers.TRANSPORT, ms=None,
                           status=why))
    return rows


def run_op_suite(ctx: BenchContext, op: str, shape_list) -> List[Dict]:
    rows: List[Dict] = []
    for shape in shape_list:
        rows += bench_shape(ctx, shape)
    return rows
