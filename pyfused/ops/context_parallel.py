"""The three context-parallel schedules of ``ring_attention`` (pyfused/ops/ring_attention.py):
forward and backward, on this rank's rows of q, k, v [B, H, S_local, D] in a sequence layout of
pyfused/ops/sequence_shards.py. Each returns exactly what one device computes over the whole
sequence, restricted to this rank's rows: the forward (out, lse) with lse [B, H, S_local] fp32,
the backward (dq, dk, dv).

  * ``ring``: K and V (one packed [2, B, Hkv, S_local, D] buffer) travel around the ring, one
    ``batch_isend_irecv`` per step posted before the step's attention, so the transfer overlaps the
    compute (gloo's own threads move it on CPU); partial results are merged by their log-sum-exp.
    The backward sends K/V around again and, behind them, an fp32 accumulator of dK/dV for the block
    held: after W steps each accumulator has visited every rank and arrives at its owner.
  * ``allgather``: K/V of every rank gathered (one asynchronous all-gather, overlapped with the
    attention over this rank's own block), as Llama 3's context parallelism; the backward gathers
    again, and reduce-scatters dK/dV to their owners. Memory: the whole sequence's K/V per rank.
  * ``ulysses``: all-to-all from sequence shards to head shards (every rank then holds the whole
    sequence for H / W heads), attention over the whole sequence in global order, all-to-all back.
    Needs both head counts divisible by W.

Communication is bounded by the group's timeout (``transfer_timeout`` for the p2p waits), and a
failure of a peer is raised as ``PeerFailure`` by the caller's ``names_failures``.
"""
from __future__ import annotations

from typing import List, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from .. import comm
from ..comm.faults import fault_point, transfer_timeout
from .attention_blocks import Chunk, Mask, attend, attend_backward, math_dtype
from .sequence_shards import local_chunks, shard_positions

KV_TAG, DKV_TAG = 71, 72  # the p2p tags of K/V blocks and of their gradient accumulators


def _empty_result(q: Tensor) -> Tuple[Tensor, Tensor]:
    out = torch.zeros(q.shape, dtype=math_dtype(q.dtype), device=q.device)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
    return out, lse


def _ring_exchange(send: Tensor, recv: Tensor, pg, tag: int) -> List[dist.Work]:
    """Post: ``send`` to the next rank, ``recv`` from the previous one."""
    r, w = comm.rank(pg), comm.world_size(pg)
    return dist.batch_isend_irecv([
        dist.P2POp(dist.isend, send, comm.global_rank(pg, (r + 1) % w), pg, tag),
        dist.P2POp(dist.irecv, recv, comm.global_rank(pg, (r - 1) % w), pg, tag),
    ])


def _wait(works: List[dist.Work], pg, device) -> None:
    timeout = transfer_timeout(pg, device)
    for work in works:
        work.wait(timeout)


# ---- ring ----------------------------------------------------------------------------------------

def ring_forward(q: Tensor, k: Tensor, v: Tensor, pg, layout: str, mask: Mask) -> Tuple[Tensor, Tensor]:
    w, r, s = comm.world_size(pg), comm.rank(pg), q.shape[2]
    q_chunks = local_chunks(r, w, s, layout)
    out, lse = _empty_result(q)
    held = torch.stack([k, v])
    spare = torch.empty_like(held) if w > 1 else None
    for step in range(w):
        pending = _ring_exchange(held, spare, pg, KV_TAG) if step < w - 1 else []
        fault_point("ring_attention.ring:step")
        attend(q, held[0], held[1], q_chunks, local_chunks((r - step) % w, w, s, layout), mask,
               out, lse)
        _wait(pending, pg, q.device)
        if pending:
            held, spare = spare, held
    return out.to(q.dtype), lse


def ring_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, pg,
                  layout: str, mask: Mask) -> Tuple[Tensor, Tensor, Tensor]:
    w, r, s = comm.world_size(pg), comm.rank(pg), q.shape[2]
    q_chunks = local_chunks(r, w, s, layout)
    dt = math_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=dt, device=q.device)
    held = torch.stack([k, v])
    spare = torch.empty_like(held) if w > 1 else None
    incoming, pending_dkv = None, []
    for step in range(w):
        pending_kv = _ring_exchange(held, spare, pg, KV_TAG) if step < w - 1 else []
        fault_point("ring_attention.ring:step")
        part = torch.zeros((2, *k.shape), dtype=dt, device=q.device)
        attend_backward(dout, q, held[0], held[1], out, lse, q_chunks,
                        local_chunks((r - step) % w, w, s, layout), mask, dq, part)
        _wait(pending_dkv, pg, q.device)  # the accumulator of the block held, from the previous rank
        acc = part if incoming is None else incoming.add_(part)
        if w > 1:
            incoming = torch.empty_like(acc)
            pending_dkv = _ring_exchange(acc, incoming, pg, DKV_TAG)
        else:
            incoming = acc
        _wait(pending_kv, pg, q.device)
        if pending_kv:
            held, spare = spare, held
    _wait(pending_dkv, pg, q.device)  # this rank's own block, with every rank's contribution
    return dq.to(q.dtype), incoming[0].to(k.dtype), incoming[1].to(v.dtype)


# ---- allgather ------------------------------------------------------------------------------------

def _gather_kv(k: Tensor, v: Tensor, pg) -> Tuple[Tensor, dist.Work]:
    held = torch.stack([k, v]).unsqueeze(0)
    gathered = held.new_empty((comm.world_size(pg), *held.shape[1:]))
    return gathered, comm.all_gather_single(gathered, held, group=pg, async_op=True)


def allgather_forward(q: Tensor, k: Tensor, v: Tensor, pg, layout: str, mask: Mask
                      ) -> Tuple[Tensor, Tensor]:
    w, r, s = comm.world_size(pg), comm.rank(pg), q.shape[2]
    q_chunks = local_chunks(r, w, s, layout)
    out, lse = _empty_result(q)
    gathered, work = _gather_kv(k, v, pg)
    attend(q, k, v, q_chunks, q_chunks, mask, out, lse)  # own block while the others arrive
    fault_point("ring_attention.allgather:wait")
    work.wait()
    for src in range(w):
        if src != r:
            attend(q, gathered[src, 0], gathered[src, 1], q_chunks, local_chunks(src, w, s, layout),
                   mask, out, lse)
    return out.to(q.dtype), lse


def allgather_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, pg,
                       layout: str, mask: Mask) -> Tuple[Tensor, Tensor, Tensor]:
    w, r, s = comm.world_size(pg), comm.rank(pg), q.shape[2]
    q_chunks = local_chunks(r, w, s, layout)
    dt = math_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=dt, device=q.device)
    dkv_all = torch.zeros((w, 2, *k.shape), dtype=dt, device=q.device)
    gathered, work = _gather_kv(k, v, pg)
    attend_backward(dout, q, k, v, out, lse, q_chunks, q_chunks, mask, dq, dkv_all[r])
    work.wait()
    for src in range(w):
        if src != r:
            attend_backward(dout, q, gathered[src, 0], gathered[src, 1], out, lse, q_chunks,
                            local_chunks(src, w, s, layout), mask, dq, dkv_all[src])
    dkv = torch.empty_like(dkv_all[:1])
    comm.reduce_scatter_single(dkv, dkv_all, group=pg)
    return dq.to(q.dtype), dkv[0, 0].to(k.dtype), dkv[0, 1].to(v.dtype)


# ---- ulysses --------------------------------------------------------------------------------------

def _to_heads(x: Tensor, pg) -> Tensor:
    """[B, H, S_local, ...] sequence shard -> [B, H / W, W * S_local, ...] head shard, the sequence
    in rank order (every rank's rows one after the other)."""
    w = comm.world_size(pg)
    b, h, s = x.shape[:3]
    send = x.reshape(b, w, h // w, s, *x.shape[3:]).transpose(0, 1).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=pg)
    return recv.transpose(0, 1).transpose(1, 2).reshape(b, h // w, w * s, *x.shape[3:])


def _to_sequence(y: Tensor, pg) -> Tensor:
    """The inverse of ``_to_heads``."""
    w = comm.world_size(pg)
    b, hl, ws = y.shape[:3]
    s = ws // w
    send = y.reshape(b, hl, w, s, *y.shape[3:]).transpose(1, 2).transpose(0, 1).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=pg)
    return recv.transpose(0, 1).reshape(b, w * hl, s, *y.shape[3:])


def _global_order(pg, s: int, layout: str, device) -> Tuple[Tensor, Tensor, List[Chunk]]:
    """(rank order -> global order index, its inverse, the global sequence as 2W chunks, or W
    when S_local is odd: chunks bound the explicit masks of a sliding window)."""
    w = comm.world_size(pg)
    stored = torch.cat([shard_positions(j, w, s, layout, device) for j in range(w)])
    to_global = torch.argsort(stored)
    pieces = 2 * w if s % 2 == 0 else w
    c = w * s // pieces
    return to_global, stored, [Chunk(i * c, i * c, c) for i in range(pieces)]


def _heads_in_order(tensors, pg, to_global):
    return [_to_heads(t, pg).index_select(2, to_global) for t in tensors]


def ulysses_forward(q: Tensor, k: Tensor, v: Tensor, pg, layout: str, mask: Mask
                    ) -> Tuple[Tensor, Tensor]:
    to_global, stored, chunks = _global_order(pg, q.shape[2], layout, q.device)
    qh, kh, vh = _heads_in_order((q, k, v), pg, to_global)
    fault_point("ring_attention.ulysses:attend")
    out, lse = _empty_result(qh)
    attend(qh, kh, vh, chunks, chunks, mask, out, lse)
    out = _to_sequence(out.to(q.dtype).index_select(2, stored), pg)
    lse = _to_sequence(lse.index_select(2, stored).unsqueeze(-1), pg).squeeze(-1)
    return out, lse


def ulysses_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, pg,
                     layout: str, mask: Mask) -> Tuple[Tensor, Tensor, Tensor]:
    to_global, stored, chunks = _global_order(pg, q.shape[2], layout, q.device)
    qh, kh, vh, oh, doh = _heads_in_order((q, k, v, out, dout), pg, to_global)
    lh = _heads_in_order((lse.unsqueeze(-1),), pg, to_global)[0].squeeze(-1)
    dt = math_dtype(q.dtype)
    dq = torch.zeros(qh.shape, dtype=dt, device=q.device)
    dkv = torch.zeros((2, *kh.shape), dtype=dt, device=q.device)
    attend_backward(doh, qh, kh, vh, oh, lh, chunks, chunks, mask, dq, dkv)
    back = [_to_sequence(g.to(t.dtype).index_select(2, stored), pg)
            for g, t in ((dq, q), (dkv[0], k), (dkv[1], v))]
    return back[0], back[1], back[2]


FORWARD = {"ring": ring_forward, "allgather": allgather_forward, "ulysses": ulysses_forward}
BACKWARD = {"ring": ring_backward, "allgather": allgather_backward, "ulysses": ulysses_backward}
