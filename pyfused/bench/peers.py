"""Baselines on the fused method's own transport: torch symmetric memory (async-TP) rows.

The fused method moves data through symmetric memory (peers' buffers mapped into every rank), the
unfused and decomposed methods through the process group's backend. Where that backend is slower
than symmetric memory -- NCCL over sockets between ranks that share one GPU, the project's testbed
(docs/TESTBED.md) -- "fused vs unfused" would credit the kernel with the transport's difference. So
for every shape, where torch symmetric memory runs, the op suites also time, on symmetric memory:

  * the op's collective alone, by torch's symm-mem op (``<collective> alone``; for the all-reduce the
    faster of torch's one-shot and two-shot kernels): the ``T_comm`` of the fused row's overlap
    efficiency;
  * ``unfused (torch symm-mem)``: the GEMM, then that collective, back to back: the fused row's
    speedup baseline (same transport);
  * torch's own fused ops where torch has one (``torch fused_all_gather_matmul``,
    ``torch fused_matmul_reduce_scatter``: PyTorch async-TP), the peer to beat.

Which parts an op has is up to the builder its registry entry names (``OpSpec.peers``: one of the
``<op>_peers`` functions below); an op without one has no symmetric-memory rows.

Every part's output is checked against the unfused method's before it is timed, and a part that
fails on any rank is dropped on every rank (with its reason in an "unavailable" row), so the ranks
stay in step. None of this runs off CUDA: there the rows are absent and the fused row says why it
cannot run.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Dict, Optional

import torch

from .. import comm
from ..ops.registry import OPS
from .harness import BenchContext, relative_error

TRANSPORT = "symm-mem"

# row labels
ALONE = "{collective} alone"
UNFUSED = "unfused (torch symm-mem)"
TORCH_FUSED = "torch {name}"


@dataclass
class SymmParts:
    """What the suite times on symmetric memory for one shape. ``parts`` maps a label to
    (callable, note); ``outputs`` maps a label to a callable producing the op's output (for the
    correctness check), where the part computes one."""
    parts: Dict[str, tuple] = field(default_factory=dict)
    outputs: Dict[str, Callable[[], torch.Tensor]] = field(default_factory=dict)
    unavailable: Dict[str, str] = field(default_factory=dict)


def status(ctx: BenchContext) -> Optional[str]:
    """Why torch symmetric-memory baselines cannot run here (None: they can be tried). The same on
    every rank: it depends on the device type, the world size and the torch build only."""
    if ctx.world == 1:
        return "one rank: nothing to communicate"
    if ctx.device.type != "cuda":
        return f"torch symmetric memory needs CUDA tensors (here: {ctx.device.type})"
    try:
        import torch.distributed._symmetric_memory  # noqa: F401  (registers torch.ops.symm_mem)
    except ImportError as e:
        return f"this torch has no symmetric memory ({e})"
    needed = ("fused_all_gather_matmul", "fused_matmul_reduce_scatter", "one_shot_all_reduce",
              "two_shot_all_reduce_", "_low_contention_all_gather", "_low_contention_reduce_scatter")
    missing = [n for n in needed if not hasattr(symm_ops(), n)]
    if missing:
        return f"this torch's torch.ops.symm_mem lacks {', '.join(missing)}"
    return None


def symm_ops():
    """torch's symmetric-memory op namespace (a function, so tests can stand gloo ops in for it)."""
    return torch.ops.symm_mem


def _symm_tensor(shape, dtype, device, group) -> torch.Tensor:
    """A tensor in torch symmetric memory, rendezvoused over ``group`` (a collective)."""
    from torch.distributed import _symmetric_memory as symm_mem

    t = symm_mem.empty(shape, dtype=dtype, device=device)
    t.zero_()  # zeros: the in-place two-shot all-reduce, repeated, then stays finite
    symm_mem.rendezvous(t, group.group_name)
    return t


def build(op: str, ctx: BenchContext, a: torch.Tensor, b: torch.Tensor, m_full: int,
          collective: str) -> SymmParts:
    """The symmetric-memory parts of ``op`` for inputs ``a``, ``b`` (collective: every rank calls it
    with the same shapes), by the builder its registry entry names (``OpSpec.peers``; none: no
    parts). Call only where ``status(ctx)`` is None."""
    out = SymmParts()
    builder = OPS[op].peers_function()
    if builder is not None:
        builder(out, symm_ops(), ctx, a, b, m_full, ALONE.format(collective=collective))
    return out


def _torch_fused(out: SymmParts, name: str, fn: Callable[[], torch.Tensor]) -> None:
    label = TORCH_FUSED.format(name=name)
    out.parts[label] = (fn, "PyTorch async-TP")
    out.outputs[label] = fn


def all_gather_matmul_peers(out: SymmParts, sm, ctx: BenchContext, a, b, m_full: int,
                            alone: str) -> None:
    """The copy-engine all-gather alone, then with the GEMM; torch's fused_all_gather_matmul."""
    gn = ctx.group.group_name
    shard = _symm_tensor(tuple(a.shape), a.dtype, a.device, ctx.group)
    shard.copy_(a)
    out.parts[alone] = (lambda: sm._low_contention_all_gather(shard, gn),
                        "torch symm_mem._low_contention_all_gather (copy engine)")
    out.parts[UNFUSED] = (lambda: sm._low_contention_all_gather(shard, gn) @ b,
                          "_low_contention_all_gather, then the GEMM")
    out.outputs[UNFUSED] = out.parts[UNFUSED][0]
    _torch_fused(out, "fused_all_gather_matmul",
                 lambda: sm.fused_all_gather_matmul(a, [b], 0, gn, return_A=False)[1][0])


def matmul_reduce_scatter_peers(out: SymmParts, sm, ctx: BenchContext, a, b, m_full: int,
                                alone: str) -> None:
    """The reduce-scatter alone, the GEMM then it; torch's fused_matmul_reduce_scatter."""
    gn = ctx.group.group_name
    full = _symm_tensor((m_full, b.shape[1]), a.dtype, a.device, ctx.group)

    def unfused():
        torch.matmul(a, b, out=full)
        return sm._low_contention_reduce_scatter(full, "sum", gn)

    out.parts[alone] = (lambda: sm._low_contention_reduce_scatter(full, "sum", gn),
                        "torch symm_mem._low_contention_reduce_scatter")
    out.parts[UNFUSED] = (unfused, "the GEMM, then _low_contention_reduce_scatter")
    out.outputs[UNFUSED] = unfused
    _torch_fused(out, "fused_matmul_reduce_scatter",
                 lambda: sm.fused_matmul_reduce_scatter(a, b, "sum", 0, gn))


def matmul_all_reduce_peers(out: SymmParts, sm, ctx: BenchContext, a, b, m_full: int,
                            alone: str) -> None:
    """torch's one-shot and two-shot all-reduce kernels alone and after the GEMM (torch has no
    fused GEMM + all-reduce)."""
    gn = ctx.group.group_name
    buf = _symm_tensor((m_full, b.shape[1]), a.dtype, a.device, ctx.group)

    def one_shot():
        torch.matmul(a, b, out=buf)
        return sm.one_shot_all_reduce(buf, "sum", gn)

    def two_shot():
        torch.matmul(a, b, out=buf)
        return sm.two_shot_all_reduce_(buf, "sum", gn)

    out.parts[alone + " [one-shot]"] = (lambda: sm.one_shot_all_reduce(buf, "sum", gn),
                                        "torch symm_mem.one_shot_all_reduce")
    out.parts[alone + " [two-shot]"] = (lambda: sm.two_shot_all_reduce_(buf, "sum", gn),
                                        "torch symm_mem.two_shot_all_reduce_ (in place)")
    out.parts[UNFUSED + " [one-shot]"] = (one_shot, "the GEMM, then one_shot_all_reduce")
    out.parts[UNFUSED + " [two-shot]"] = (two_shot, "the GEMM, then two_shot_all_reduce_")
    out.outputs[UNFUSED + " [one-shot]"] = one_shot
    out.outputs[UNFUSED + " [two-shot]"] = lambda: two_shot().clone()


def check(parts: SymmParts, ref: torch.Tensor, ctx: BenchContext, tol: float) -> None:
    """Run every part once; drop (on every rank) any part that raised or whose output differs from
    ``ref`` (the unfused method's) by more than ``tol`` relative to max|ref| on any rank. The
    verdicts travel in one fixed-size ``agree_on`` after all parts ran."""
    labels = list(parts.parts)
    whys = []
    for label in labels:
        why = ""
        try:
            if label in parts.outputs:
                err = relative_error(parts.outputs[label](), ref)
                if not (math.isfinite(err) and err <= tol):
                    why = f"output differs from method='unfused' by {err:.3g} (allowed {tol:g})"
            else:
                parts.parts[label][0]()
            if ctx.device.type == "cuda":
                torch.cuda.synchronize(ctx.device)
        except Exception as e:  # noqa: BLE001 -- any failure drops the row, with its reason
            why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        whys.append(why)
    rows = comm.agree_on(ctx.group, "bench peers check", [int(bool(why)) for why in whys],
                         width=len(labels), detail="which parts failed on some rank")
    for i, (label, why) in enumerate(zip(labels, whys)):
        if any(row[i] for row in rows):
            parts.unavailable[label] = f"unavailable: {why or 'failed on another rank'}"
            del parts.parts[label]


def best(times: Dict[str, float], prefix: str) -> Optional[tuple]:
    """(label, ms) of the fastest timed part whose label starts with ``prefix``."""
    cands = [(ms, label) for label, ms in times.items() if label.startswith(prefix)]
    if not cands:
        return None
    ms, label = min(cands)
    return label, ms
