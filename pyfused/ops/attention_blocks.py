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

Partial results are merged in fp32 (``merge_into``): with L = logaddexp(L1, L2),
out = out1 * exp(L1 - L) + out2 * exp(L2 - L). The backward of a rectangle takes the *final* out
and log-sum-exp of its query rows, so the probabilities it recomputes, exp(s - L), are the global
ones and the per-rectangle gradients add up to the exact gradient (as FlashAttention's backward).
Grouped-query attention: keys and values are expanded to the query heads for the compute
(``expand_heads``) and their gradients summed back over each group (``sum_heads``).
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


def plan_blocks(q_chunks: Sequence[Chunk], k_chunks: Sequence[Chunk], mask: Mask) -> List[Block]:
    """The rectangles of (queries x keys) to compute, few and large: one CAUSAL rectangle when the
    queries are the keys in increasing position order, stored contiguously; else per query chunk,
    the FULL key chunks adjacent in storage joined into one rectangle; then query chunks with the
    same key rectangles joined where they are adjacent in storage. Other kinds stay one chunk by
    one chunk, which bounds the explicit masks to a chunk's square."""
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
    return _join_query_runs(per_query)


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
    return t[:, :, offset:offset + length]


def block_forward(q: Tensor, k: Tensor, v: Tensor, block: Block, mask: Mask) -> Tuple[Tensor, Tensor]:
    """(out [B, H, q_len, D] in the math dtype, lse [B, H, q_len]) of one rectangle; ``k``/``v``
    already have q's heads. A row that sees no key has lse -inf and out 0."""
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


def _scores(qt: Tensor, kb: Tensor, block: Block, rows: slice, mask: Mask) -> Tuple[Tensor, Optional[Tensor]]:
    """(scores of query tile ``rows`` in the math dtype, masked to -inf; tanh of the softcap)."""
    s = torch.matmul(qt, kb.transpose(-1, -2)) * mask.scale
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
    dt = math_dtype(qb.dtype)
    kb, vb = kb.to(dt), vb.to(dt)
    outs, lses = [], []
    for rows in _tiles(block.q_len):
        s, _ = _scores(qb[:, :, rows].to(dt), kb, block, rows, mask)
        lse = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - lse.unsqueeze(-1)).nan_to_num_(0.0)  # rows seeing no key: -inf - -inf
        outs.append(torch.matmul(p, vb))
        lses.append(lse.to(torch.float32))
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2)


def block_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                   block: Block, mask: Mask) -> Tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of one rectangle, in the math dtype, given the final ``out`` and ``lse`` of the
    query rows (module docstring); ``k``/``v`` already have q's heads."""
    rows_q = (block.q_offset, block.q_len)
    rows_k = (block.k_offset, block.k_len)
    qb, kb, vb = _rows(q, *rows_q), _rows(k, *rows_k), _rows(v, *rows_k)
    dob, ob, lb = _rows(dout, *rows_q), _rows(out, *rows_q), _rows(lse, *rows_q).contiguous()
    if _use_flash(q, mask):
        bias, _ = _flash_mask(block, mask, q.dtype, q.device)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dob.contiguous(), qb, kb, vb, ob.contiguous(), lb, 0.0, block.kind == CAUSAL,
            attn_mask=bias, scale=mask.scale)
        dt = math_dtype(q.dtype)
        return dq.to(dt), dk.to(dt), dv.to(dt)
    return _math_backward(dob, qb, kb, vb, ob, lb, block, mask)


def _math_backward(dob, qb, kb, vb, ob, lb, block: Block, mask: Mask):
    dt = math_dtype(qb.dtype)
    kb, vb = kb.to(dt), vb.to(dt)
    dk, dv = torch.zeros_like(kb), torch.zeros_like(vb)
    dqs = []
    for rows in _tiles(block.q_len):
        qt, do = qb[:, :, rows].to(dt), dob[:, :, rows].to(dt)
        s, tanh = _scores(qt, kb, block, rows, mask)
        p = torch.exp(s - lb[:, :, rows].to(dt).unsqueeze(-1))
        dv += torch.matmul(p.transpose(-1, -2), do)
        dp = torch.matmul(do, vb.transpose(-1, -2))
        delta = (do * ob[:, :, rows].to(dt)).sum(dim=-1, keepdim=True)
        ds = p * (dp - delta)
        if tanh is not None:
            ds = ds * (1 - tanh * tanh)
        ds = ds * mask.scale
        dqs.append(torch.matmul(ds, kb))
        dk += torch.matmul(ds.transpose(-1, -2), qt)
    return torch.cat(dqs, dim=2), dk, dv


def merge_into(out: Tensor, lse: Tensor, part_out: Tensor, part_lse: Tensor) -> None:
    """out, lse (the running result of some query rows, math dtype / fp32) <- merged with a
    partial result over other keys, in place."""
    new = torch.logaddexp(lse, part_lse)
    old_w = torch.exp(lse - new).nan_to_num_(0.0).unsqueeze(-1)  # -inf - -inf: no keys yet
    part_w = torch.exp(part_lse - new).nan_to_num_(0.0).unsqueeze(-1)
    out.mul_(old_w.to(out.dtype)).add_(part_out * part_w.to(out.dtype))
    lse.copy_(new)


def expand_heads(t: Tensor, heads: int) -> Tensor:
    """[B, Hkv, S, D] -> [B, heads, S, D], each key/value head repeated for its group of queries."""
    groups = heads // t.shape[1]
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)


def sum_heads(t: Tensor, kv_heads: int) -> Tensor:
    """The gradient of ``expand_heads``: [B, H, S, D] -> [B, kv_heads, S, D]."""
    b, h, s, d = t.shape
    return t if h == kv_heads else t.view(b, kv_heads, h // kv_heads, s, d).sum(dim=2)


def attend(q: Tensor, k: Tensor, v: Tensor, q_chunks: Sequence[Chunk], k_chunks: Sequence[Chunk],
           mask: Mask, out: Tensor, lse: Tensor) -> None:
    """Merge into (out, lse) the attention of ``q`` over these keys (k/v with kv heads)."""
    heads = q.shape[1]
    k, v = expand_heads(k, heads), expand_heads(v, heads)
    for block in plan_blocks(q_chunks, k_chunks, mask):
        part_out, part_lse = block_forward(q, k, v, block, mask)
        rows = slice(block.q_offset, block.q_offset + block.q_len)
        merge_into(out[:, :, rows], lse[:, :, rows], part_out, part_lse)


def attend_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                    q_chunks: Sequence[Chunk], k_chunks: Sequence[Chunk], mask: Mask,
                    dq: Tensor, dkv: Tensor) -> None:
    """Add into dq [B, H, Sq, D] and dkv [2, B, Hkv, Sk, D] (math dtype) the gradients of the
    attention of ``q`` over these keys."""
    heads, kv_heads = q.shape[1], k.shape[1]
    k, v = expand_heads(k, heads), expand_heads(v, heads)
    blocks = plan_blocks(q_chunks, k_chunks, mask)
    if not blocks:
        return
    dk = torch.zeros(k.shape, dtype=dq.dtype, device=dq.device)
    dv = torch.zeros_like(dk)
    for block in blocks:
        bq, bk, bv = block_backward(dout, q, k, v, out, lse, block, mask)
        dq[:, :, block.q_offset:block.q_offset + block.q_len] += bq
        dk[:, :, block.k_offset:block.k_offset + block.k_len] += bk
        dv[:, :, block.k_offset:block.k_offset + block.k_len] += bv
    dkv[0] += sum_heads(dk, kv_heads)
    dkv[1] += sum_heads(dv, kv_heads)
