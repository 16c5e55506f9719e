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

from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from .. import comm
from ..comm.faults import fault_point, transfer_timeout
from .attention_blocks import Chunk, Mask, attend, attend_backward, empty_result, math_dtype
from .sequence_shards import local_chunks, shard_positions

K_TAG, V_TAG, DK_TAG, DV_TAG = 71, 72, 73, 74  # the p2p tags of K/V blocks and of their gradients


def _ring_exchange(send: Sequence[Tensor], recv: Sequence[Tensor], pg, tags: Sequence[int]
                   ) -> List[dist.Work]:
    """Post: each of ``send`` to the next rank, each of ``recv`` from the previous one."""
    r, w = comm.rank(pg), comm.world_size(pg)
    nxt, prev = comm.global_rank(pg, (r + 1) % w), comm.global_rank(pg, (r - 1) % w)
    ops = [dist.P2POp(dist.isend, t, nxt, pg, tag) for t, tag in zip(send, tags)]
    ops += [dist.P2POp(dist.irecv, t, prev, pg, tag) for t, tag in zip(recv, tags)]
    return dist.batch_isend_irecv(ops)


def _wait(works: List[dist.Work], pg, device) -> None:
    """Wait for ``works`` and empty the list: a transfer holds its tensors until it is dropped."""
    timeout = transfer_timeout(pg, device)
    for work in works:
        work.wait(timeout)
    works.clear()


def _buffers(like: Sequence[Tensor]) -> Tuple[Tensor, ...]:
    """Contiguous tensors of the shapes and dtypes of ``like``: what a transfer receives into."""
    return tuple(torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in like)


def _result(out: Optional[Tensor], lse: Optional[Tensor], q: Tensor) -> Tuple[Tensor, Tensor]:
    if out is None:  # no key visible to any row (not reached under the supported masks)
        out, lse = empty_result(q)
    return out.to(q.dtype), lse


# ---- ring ----------------------------------------------------------------------------------------
# The block held at step i is rank (r - i)'s; rank r's own k, v are sent as they are (copied only
# when not contiguous), and a received block is dropped once passed on, so a rank holds at most two
# K/V blocks besides its own (one at W = 2).

def ring_forward(q: Tensor, k: Tensor, v: Tensor, pg, layout: str, mask: Mask) -> Tuple[Tensor, Tensor]:
    w, r, s = comm.world_size(pg), comm.rank(pg), q.shape[2]
    q_chunks = local_chunks(r, w, s, layout)
    out = lse = None
    held = (k.contiguous(), v.contiguous())  # what a transfer sends must be contiguous
    for step in range(w):
        incoming = _buffers(held) if step < w - 1 else ()
        pending = _ring_exchange(held, incoming, pg, (K_TAG, V_TAG)) if incoming else []
        fault_point("ring_attention.ring:step")
        out, lse = attend(q, *held, q_chunks, local_chunks((r - step) % w, w, s, layout), mask,
                          out, lse)
        _wait(pending, pg, q.device)
        held = incoming
    return _result(out, lse, q)


def ring_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, pg,
                  layout: str, mask: Mask) -> Tuple[Tensor, Tensor, Tensor]:
    """dK/dV of the block held travel one step behind it: the accumulator of rank j's block
    arrives from the previous rank, takes this rank's part in place and is passed on, so after W
    steps it reaches rank j with every rank's part. A step waits for its accumulator (and for the
    previous one to leave) before its attention, so a rank holds two accumulators at most; the
    K/V transfer still overlaps the attention."""
    w, r, s = comm.world_size(pg), comm.rank(pg), q.shape[2]
    q_chunks = local_chunks(r, w, s, layout)
    dt = math_dtype(q.dtype)
    dq = acc = None  # acc: the dK/dV accumulator of the block held
    held, pending_dkv = (k.contiguous(), v.contiguous()), []
    for step in range(w):
        incoming = _buffers(held) if step < w - 1 else ()
        pending_kv = _ring_exchange(held, incoming, pg, (K_TAG, V_TAG)) if incoming else []
        fault_point("ring_attention.ring:step")
        _wait(pending_dkv, pg, q.device)
        dq, acc = attend_backward(dout, q, *held, out, lse, q_chunks,
                                  local_chunks((r - step) % w, w, s, layout), mask, dq, acc)
        if acc is None:  # this rank sees no key of the block held, and is its first visitor
            acc = (torch.zeros(k.shape, dtype=dt, device=q.device),
                   torch.zeros(v.shape, dtype=dt, device=q.device))
        if w > 1:
            sending = tuple(t.contiguous() for t in acc)
            acc = _buffers(sending)
            pending_dkv = _ring_exchange(sending, acc, pg, (DK_TAG, DV_TAG))
            del sending  # held by its transfer until waited for
        _wait(pending_kv, pg, q.device)
        held = incoming
    _wait(pending_dkv, pg, q.device)  # this rank's own block, with every rank's part
    if dq is None:
        dq = torch.zeros(q.shape, dtype=dt, device=q.device)
    return dq.to(q.dtype), acc[0].to(k.dtype), acc[1].to(v.dtype)


# ---- allgather ------------------------------------------------------------------------------------

def _gather(t: Tensor, pg) -> Tuple[Tensor, dist.Work]:
    """[W, *t.shape]: every rank's ``t`` (asynchronous)."""
    gathered = t.new_empty((comm.world_size(pg), *t.shape))
    return gathered, comm.all_gather_single(gathered, t.contiguous().unsqueeze(0), group=pg,
                                            async_op=True)


def allgather_forward(q: Tensor, k: Tensor, v: Tensor, pg, layout: str, mask: Mask
                      ) -> Tuple[Tensor, Tensor]:
    w, r, s = comm.world_size(pg), comm.rank(pg), q.shape[2]
    q_chunks = local_chunks(r, w, s, layout)
    (ks, k_work), (vs, v_work) = _gather(k, pg), _gather(v, pg)
    out, lse = attend(q, k, v, q_chunks, q_chunks, mask)  # own block while the others arrive
    fault_point("ring_attention.allgather:wait")
    k_work.wait()
    v_work.wait()
    for src in range(w):
        if src != r:
            out, lse = attend(q, ks[src], vs[src], q_chunks, local_chunks(src, w, s, layout), mask,
                              out, lse)
    return _result(out, lse, q)


def allgather_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, pg,
                       layout: str, mask: Mask) -> Tuple[Tensor, Tensor, Tensor]:
    """dK/dV of every rank's block, reduce-scattered to their owners."""
    w, r, s = comm.world_size(pg), comm.rank(pg), q.shape[2]
    q_chunks = local_chunks(r, w, s, layout)
    dt = math_dtype(q.dtype)
    (ks, k_work), (vs, v_work) = _gather(k, pg), _gather(v, pg)
    dkv_all = torch.zeros((2, w, *k.shape), dtype=dt, device=q.device)

    def keep(src: int, part) -> None:
        if part is not None:
            dkv_all[0, src], dkv_all[1, src] = part

    dq, part = attend_backward(dout, q, k, v, out, lse, q_chunks, q_chunks, mask)
    keep(r, part)
    k_work.wait()
    v_work.wait()
    for src in range(w):
        if src != r:
            dq, part = attend_backward(dout, q, ks[src], vs[src], out, lse, q_chunks,
                                       local_chunks(src, w, s, layout), mask, dq)
            keep(src, part)
    del part, ks, vs
    dk, dv = torch.empty_like(dkv_all[0, :1]), torch.empty_like(dkv_all[1, :1])
    comm.reduce_scatter_single(dk, dkv_all[0], group=pg)
    comm.reduce_scatter_single(dv, dkv_all[1], group=pg)
    if dq is None:
        dq = torch.zeros(q.shape, dtype=dt, device=q.device)
    return dq.to(q.dtype), dk[0].to(k.dtype), dv[0].to(v.dtype)


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
    out, lse = _result(*attend(qh, kh, vh, chunks, chunks, mask), qh)
    del qh, kh, vh
    out = _to_sequence(out.index_select(2, stored), pg)
    lse = _to_sequence(lse.index_select(2, stored).unsqueeze(-1), pg).squeeze(-1)
    return out, lse


def ulysses_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, pg,
                     layout: str, mask: Mask) -> Tuple[Tensor, Tensor, Tensor]:
    to_global, stored, chunks = _global_order(pg, q.shape[2], layout, q.device)
    qh, kh, vh, oh, doh = _heads_in_order((q, k, v, out, dout), pg, to_global)
    lh = _heads_in_order((lse.unsqueeze(-1),), pg, to_global)[0].squeeze(-1)
    # every row sees itself under every supported mask, so dq and dK/dV are never None here
    dq, dkv = attend_backward(doh, qh, kh, vh, oh, lh, chunks, chunks, mask)
    del qh, kh, vh, oh, doh, lh
    back = [_to_sequence(g.to(t.dtype).index_select(2, stored), pg)
            for g, t in ((dq, q), (dkv[0], k), (dkv[1], v))]
    return back[0], back[1], back[2]


FORWARD = {"ring": ring_forward, "allgather": allgather_forward, "ulysses": ulysses_forward}
BACKWARD = {"ring": ring_backward, "allgather": allgather_backward, "ulysses": ulysses_backward}
