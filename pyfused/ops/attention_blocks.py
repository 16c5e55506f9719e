"""Attention of query rows against key rows that sit at known global positions, with the
log-sum-exp that lets partial results over different keys be merged exactly. Every
context-parallel method (pyfused/ops/ring_attention.py) computes with these functions.

A rank's rows are a list of ``Chunk``s: runs of consecutive global positions stored one after the
other. ``plan_blocks`` cuts (queries x keys) into rectangles of one kind each -- every pair allowed
(``FULL``), the top-left causal triangle of two aligned runs (``CAUSAL``), anything else
(``MASKED``, with an explicit mask built from the positions) -- and leaves out rectangles the mask
forbids entirely. The mask of a ``Mask``: with ``causal``, key k is visible from query q iff
k <= q, and with a ``window`` w also q - w < k (Mistral's and Gemma's sliding window).

Each rectangle runs on one of two paths:
  * torch's CPU flash-attention kernel (``aten._scaled_dot_product_flash_attention_for_cpu``),
    the kernel behind ``scaled_dot_product_attention`` on CPU, which returns the log-sum-exp
    (public SDPA does not), and its backward; used for CPU tensors without softcapping;
  * an explicit fp32 (fp64 for fp64) path in torch ops, in tiles of ``MATH_TILE`` query rows: for
    softcapping (``cap * tanh(score / cap)``, Gemma 2), which no torch kernel applies, and for other
    devices.

Partial results are merged in place, in fp32 (``merge_into``): with L = logaddexp(L1, L2),
out = out1 * exp(L1 - L) + out2 * exp(L2 - L). The backward of a rectangle takes the *final* out
and log-sum-exp of its query rows, so the probabilities it recomputes, exp(s - L), are the global
ones and the per-rectangle gradients add up to the exact gradient (as FlashAttention's backward).

Memory: keys and values keep their Hkv heads (grouped-query attention). The CPU kernel maps each
query head to its key/value head itself and returns dK/dV with Hkv heads; the explicit path views
the queries as [B, Hkv, Hq / Hkv, rows, D] and broadcasts the keys over the group. The first
rectangle that covers every query row (every key row) becomes the result (the dK/dV) as the
kernel returned it, so a rank holds no zero-filled accumulator beside the kernel's output.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor

FULL, CAUSAL, MASKED = "full", "causal", "masked"
MATH_TILE = 512  # query rows per tile of the explicit path: bounds its [rows, keys] score matrix


@dataclass(frozen=True)
class Chunk:
    offset: int  # first local row
    start: int   # its global position
    length: int

    @property
    def end(self) -> int:
        return self.start + self.length


@dataclass(frozen=True)
class Mask:
    causal: bool
    window: int = 0        # 0: none; else keys with q - window < k <= q
    softcap: float = 0.0   # 0: none; else scores become softcap * tanh(score / softcap)
    scale: float = 1.0     # scores are q . k * scale


@dataclass(frozen=True)
class Block:
    q_offset: int
    q_len: int
    k_offset: int
    k_len: int
    kind: str
    q_start: int  # global position of the first query row
    k_start: int


def _kind(q: Chunk, k: Chunk, mask: Mask) -> Optional[str]:
    """The kind of (q x k), or None when the mask forbids every pair."""
    if not mask.causal:
        return FULL
    if k.start > q.end - 1 or (mask.window and k.end - 1 <= q.start - mask.window):
        return None
    if k.end - 1 <= q.start and (not mask.window or k.start > q.end - 1 - mask.window):
        return FULL
    if not mask.window and q.start == k.start and q.length == k.length:
        return CAUSAL
    return MASKED


def plan_blocks(q_chunks: Sequence[Chunk], k_chunks: Sequence[Chunk], mask: Mask,
                join_queries: bool = True) -> List[Block]:
    """The rectangles of (queries x keys) to compute, few and large: one CAUSAL rectangle when the
    queries are the keys in increasing position order, stored contiguously; else per query chunk,
    the FULL key chunks adjacent in storage joined into one rectangle; then (``join_queries``)
    query chunks with the same key rectangles joined where they are adjacent in storage. Other
    kinds stay one chunk by one chunk, which bounds the explicit masks to a chunk's square."""
    if (mask.causal and not mask.window and list(q_chunks) == list(k_chunks)
            and all(a.end <= b.start for a, b in zip(q_chunks, q_chunks[1:]))):
        total = sum(c.length for c in q_chunks)
        first = q_chunks[0]
        if all(c.offset == first.offset + sum(x.length for x in q_chunks[:i])
               for i, c in enumerate(q_chunks)):
            return [Block(first.offset, total, first.offset, total, CAUSAL, first.start, first.start)]
    per_query = []
    for q in q_chunks:
        blocks: List[Block] = []
        for k in k_chunks:
            kind = _kind(q, k, mask)
            if kind is None:
                continue
            last = blocks[-1] if blocks else None
            if (kind == FULL and last is not None and last.kind == FULL
                    and last.k_offset + last.k_len == k.offset):
                blocks[-1] = Block(q.offset, q.length, last.k_offset, last.k_len + k.length, FULL,
                                   q.start, last.k_start)
            else:
                blocks.append(Block(q.offset, q.length, k.offset, k.length, kind, q.start, k.start))
        per_query.append(blocks)
    return _join_query_runs(per_query) if join_queries else [b for bs in per_query for b in bs]


def _join_query_runs(per_query: List[List[Block]]) -> List[Block]:
    out: List[Block] = []
    previous: List[Block] = []
    for blocks in per_query:
        joinable = (previous and len(previous) == len(blocks)
                    and all(p.kind == b.kind == FULL and p.k_offset == b.k_offset
                            and p.k_len == b.k_len and p.q_offset + p.q_len == b.q_offset
                            for p, b in zip(previous, blocks)))
        if joinable:
            merged = [Block(p.q_offset, p.q_len + b.q_len, p.k_offset, p.k_len, FULL, p.q_start,
                            p.k_start) for p, b in zip(previous, blocks)]
            out[len(out) - len(previous):] = merged
            previous = merged
        else:
            out.extend(blocks)
            previous = blocks
    return out


def visible(q_pos: Tensor, k_pos: Tensor, mask: Mask) -> Tensor:
    """Boolean [q, k]: which keys each query sees."""
    allowed = k_pos[None, :] <= q_pos[:, None]
    if mask.window:
        allowed &= k_pos[None, :] > q_pos[:, None] - mask.window
    return allowed


def _positions(block: Block, device) -> Tuple[Tensor, Tensor]:
    return (torch.arange(block.q_start, block.q_start + block.q_len, device=device),
            torch.arange(block.k_start, block.k_start + block.k_len, device=device))


def math_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _use_flash(q: Tensor, mask: Mask) -> bool:
    return q.device.type == "cpu" and not mask.softcap


def _flash_mask(block: Block, mask: Mask, dtype, device) -> Tuple[Optional[Tensor], Optional[Tensor]]:
    """(additive mask of a MASKED block, which query rows see at least one key), else (None, None)."""
    if block.kind != MASKED:
        return None, None
    allowed = visible(*_positions(block, device), mask)
    bias = torch.zeros(allowed.shape, dtype=dtype, device=device)
    bias.masked_fill_(~allowed, float("-inf"))
    return bias, allowed.any(dim=-1)


def _rows(t: Tensor, offset: int, length: int) -> Tensor:
    return t if offset == 0 and length == t.shape[2] else t[:, :, offset:offset + length]


def block_forward(q: Tensor, k: Tensor, v: Tensor, block: Block, mask: Mask) -> Tuple[Tensor, Tensor]:
    """(out [B, Hq, q_len, D] in the math dtype, lse [B, Hq, q_len]) of one rectangle; ``k``/``v``
    have Hkv heads. A row that sees no key has lse -inf and out 0."""
    qb, kb, vb = (_rows(q, block.q_offset, block.q_len), _rows(k, block.k_offset, block.k_len),
                  _rows(v, block.k_offset, block.k_len))
    if _use_flash(q, mask):
        bias, seen = _flash_mask(block, mask, q.dtype, q.device)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            qb, kb, vb, 0.0, block.kind == CAUSAL, attn_mask=bias, scale=mask.scale)
        if seen is not None:
            lse = lse.masked_fill(~seen, float("-inf"))
        return out.to(math_dtype(q.dtype)), lse
    return _math_forward(qb, kb, vb, block, mask)


def _grouped(t: Tensor, kv_heads: int) -> Tensor:
    """[B, Hq, rows, ...] -> the view [B, Hkv, Hq / Hkv, rows, ...]: query head h uses key/value
    head h // (Hq / Hkv), as a key/value head repeated for its group would."""
    return t.view(t.shape[0], kv_heads, t.shape[1] // kv_heads, *t.shape[2:])


def _ungrouped(t: Tensor) -> Tensor:
    return t.reshape(t.shape[0], t.shape[1] * t.shape[2], *t.shape[3:])


def _scores(qt: Tensor, kb: Tensor, block: Block, rows: slice, mask: Mask) -> Tuple[Tensor, Optional[Tensor]]:
    """(scores [B, Hkv, G, rows, keys] of the grouped query tile ``qt`` [B, Hkv, G, rows, D] in
    the math dtype, masked to -inf; tanh of the softcap)."""
    s = torch.matmul(qt, kb.unsqueeze(2).transpose(-1, -2)) * mask.scale
    tanh = None
    if mask.softcap:
        tanh = torch.tanh(s / mask.softcap)
        s = tanh * mask.softcap
    if block.kind != FULL:
        q_pos, k_pos = _positions(block, qt.device)
        allowed = visible(q_pos[rows], k_pos, mask)
        s = s.masked_fill(~allowed, float("-inf"))
    return s, tanh


def _tiles(n: int):
    for lo in range(0, n, MATH_TILE):
        yield slice(lo, min(n, lo + MATH_TILE))


def _math_forward(qb, kb, vb, block: Block, mask: Mask) -> Tuple[Tensor, Tensor]:
    dt, kv_heads = math_dtype(qb.dtype), kb.shape[1]
    kb, vb = kb.to(dt), vb.to(dt)
    outs, lses = [], []
    for rows in _tiles(block.q_len):
        s, _ = _scores(_grouped(qb[:, :, rows].to(dt), kv_heads), kb, block, rows, mask)
        lse = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - lse.unsqueeze(-1)).nan_to_num_(0.0)  # rows seeing no key: -inf - -inf
        outs.append(_ungrouped(torch.matmul(p, vb.unsqueeze(2))))
        lses.append(_ungrouped(lse.to(torch.float32)))
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2)


def block_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                   block: Block, mask: Mask) -> Tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of one rectangle, in the math dtype, given the final ``out`` and ``lse`` of the
    query rows (module docstring); ``k``/``v`` (and dk/dv) have Hkv heads."""
    rows_q = (block.q_offset, block.q_len)
    rows_k = (block.k_offset, block.k_len)
    qb, kb, vb = _rows(q, *rows_q), _rows(k, *rows_k), _rows(v, *rows_k)
    dob, ob, lb = _rows(dout, *rows_q), _rows(out, *rows_q), _rows(lse, *rows_q).contiguous()
    if _use_flash(q, mask):
        bias, _ = _flash_mask(block, mask, q.dtype, q.device)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dob, qb, kb, vb, ob, lb, 0.0, block.kind == CAUSAL,  # row views: the kernel takes strides
            attn_mask=bias, scale=mask.scale)
        dt = math_dtype(q.dtype)
        return dq.to(dt), dk.to(dt), dv.to(dt)
    return _math_backward(dob, qb, kb, vb, ob, lb, block, mask)


def _math_backward(dob, qb, kb, vb, ob, lb, block: Block, mask: Mask):
    dt, kv_heads = math_dtype(qb.dtype), kb.shape[1]
    kb, vb = kb.to(dt), vb.to(dt)
    dk, dv = torch.zeros_like(kb), torch.zeros_like(vb)
    dqs = []
    for rows in _tiles(block.q_len):
        qt = _grouped(qb[:, :, rows].to(dt), kv_heads)
        do = _grouped(dob[:, :, rows].to(dt), kv_heads)
        s, tanh = _scores(qt, kb, block, rows, mask)
        p = torch.exp(s - _grouped(lb[:, :, rows].to(dt), kv_heads).unsqueeze(-1))
        dv += torch.matmul(p.flatten(2, 3).transpose(-1, -2), do.flatten(2, 3))  # sum over the group
        dp = torch.matmul(do, vb.unsqueeze(2).transpose(-1, -2))
        delta = (do * _grouped(ob[:, :, rows].to(dt), kv_heads)).sum(dim=-1, keepdim=True)
        ds = p * (dp - delta)
        if tanh is not None:
            ds = ds * (1 - tanh * tanh)
        ds = ds * mask.scale
        dqs.append(_ungrouped(torch.matmul(ds, kb.unsqueeze(2))))
        dk += torch.matmul(ds.flatten(2, 3).transpose(-1, -2), qt.flatten(2, 3))
    return torch.cat(dqs, dim=2), dk, dv


def merge_into(out: Tensor, lse: Tensor, part_out: Tensor, part_lse: Tensor) -> None:
    """out, lse (the running result of some query rows, math dtype / fp32) <- merged with a
    partial result over other keys, in place (``part_out`` is scaled in place too)."""
    new = torch.logaddexp(lse, part_lse)
    old_w = torch.exp(lse - new).nan_to_num_(0.0).unsqueeze(-1)  # -inf - -inf: no keys yet
    part_w = torch.exp(part_lse - new).nan_to_num_(0.0).unsqueeze(-1)
    out.mul_(old_w.to(out.dtype)).add_(part_out.mul_(part_w.to(out.dtype)))
    lse.copy_(new)


def _covers(offset: int, length: int, total: int) -> bool:
    return offset == 0 and length == total


def attend(q: Tensor, k: Tensor, v: Tensor, q_chunks: Sequence[Chunk], k_chunks: Sequence[Chunk],
           mask: Mask, out: Optional[Tensor] = None, lse: Optional[Tensor] = None
           ) -> Tuple[Optional[Tensor], Optional[Tensor]]:
    """(out, lse) merged with the attention of ``q`` over these keys (k/v with Hkv heads). With
    ``out`` None the first rectangle covering every query row becomes the result; (None, None)
    while no key is visible."""
    for block in plan_blocks(q_chunks, k_chunks, mask):
        part_out, part_lse = block_forward(q, k, v, block, mask)
        if out is None and _covers(block.q_offset, block.q_len, q.shape[2]):
            out, lse = part_out, part_lse
            continue
        if out is None:
            out, lse = empty_result(q)
        rows = slice(block.q_offset, block.q_offset + block.q_len)
        merge_into(out[:, :, rows], lse[:, :, rows], part_out, part_lse)
    return out, lse


def empty_result(q: Tensor) -> Tuple[Tensor, Tensor]:
    """(out, lse) of query rows that have seen no key yet."""
    out = torch.zeros(q.shape, dtype=math_dtype(q.dtype), device=q.device)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
    return out, lse


def _add_rows(total: Optional[Tensor], part: Tensor, offset: int, like: Tensor) -> Tensor:
    """``total`` (None: not allocated yet) + ``part`` at rows offset.. of dim 2; ``part`` itself
    when it covers every row of ``like``."""
    if total is None and _covers(offset, part.shape[2], like.shape[2]):
        return part
    if total is None:
        total = torch.zeros(like.shape, dtype=part.dtype, device=part.device)
    total[:, :, offset:offset + part.shape[2]] += part
    return total


def attend_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                    q_chunks: Sequence[Chunk], k_chunks: Sequence[Chunk], mask: Mask,
                    dq: Optional[Tensor] = None, dkv: Optional[Tuple[Tensor, Tensor]] = None
                    ) -> Tuple[Optional[Tensor], Optional[Tuple[Tensor, Tensor]]]:
    """(dq, (dk, dv)) with the gradients of the attention of ``q`` over these keys added: with
    respect to q into ``dq`` and to the keys (Hkv heads) into ``dkv``, in place, in the math dtype.
    None stands for a gradient not allocated yet (it stays None while no key is visible). With
    ``dq`` allocated, each query chunk is a kernel call of its own, so the kernel's dq of one call
    (a temporary) is one chunk's rows, not the rank's."""
    dk, dv = (None, None) if dkv is None else dkv
    for block in plan_blocks(q_chunks, k_chunks, mask, join_queries=dq is None):
        bq, bk, bv = block_backward(dout, q, k, v, out, lse, block, mask)
        dq = _add_rows(dq, bq, block.q_offset, q)
        dk = _add_rows(dk, bk, block.k_offset, k)
        dv = _add_rows(dv, bv, block.k_offset, v)
        del bq, bk, bv
    return dq, (None if dk is None else (dk, dv))
