"""What a torch user writes today for an expert-parallel MoE layer, the baseline of the ``moe``
suite: the per-expert counts by ``all_to_all_single``, the tokens by the differentiable
``torch.distributed.nn.functional.all_to_all_single`` with split sizes, one MLP per local expert
(a loop over its rows), the rows back the same way, the weighted sum."""
from __future__ import annotations

import statistics
import warnings
from typing import Dict, List, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from pyfused import comm
from pyfused.bench.harness import op_row, paired_speedup

REFERENCE_NOTE = "all_to_all_single + a loop over experts"
# The differentiable all_to_all_single is what torch users call today; its deprecation notice
# (pointing at a private module) would otherwise fill every benchmark log.
warnings.filterwarnings("ignore", message=r".*nn\.functional\.all_to_all_single is deprecated",
                        category=FutureWarning)


def swiglu(h: torch.Tensor, act=F.silu) -> torch.Tensor:
    gate, up = h.chunk(2, dim=-1)
    return act(gate) * up


def torch_user_moe(x, idx, gates, gate_up, down, pg, act=F.silu):
    """``sum_j gates[t, j] * down[e](act(gate) * up)`` with ``x @ gate_up[e]`` = [gate|up] for the
    experts ``e = idx[t, j]``; ``gate_up [E/W, H, 2F]`` and ``down [E/W, F, H]`` are this rank's
    experts (expert e on rank e // (E/W))."""
    from torch.distributed.nn.functional import all_to_all_single

    world, local = comm.world_size(pg), gate_up.shape[0]
    k = idx.shape[1]
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=world * local)
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts, group=pg)
    send = counts.view(world, local).sum(1).tolist()
    table = received.view(world, local).tolist()
    recv = [sum(row) for row in table]
    moved = all_to_all_single(x.new_empty((sum(recv), x.shape[1])), x[order // k], recv, send,
                              group=pg)
    blocks = moved.split([c for row in table for c in row])
    outs = [None] * (world * local)
    for j in range(local):
        rows = torch.cat([blocks[s * local + j] for s in range(world)])
        done = swiglu(rows @ gate_up[j], act) @ down[j]
        for s, piece in enumerate(done.split([table[s][j] for s in range(world)])):
            outs[s * local + j] = piece
    back = all_to_all_single(x.new_empty((len(flat), x.shape[1])), torch.cat(outs), send, recv,
                             group=pg)
    pairs = torch.empty_like(back).index_copy(0, order, back)
    return (pairs.view(-1, k, x.shape[1]) * gates.unsqueeze(-1)).sum(1)


class TorchUserExperts(nn.Module):
    """A transformers experts module (``gate_up_proj [E, 2F, H]``, ``down_proj [E, H, F]``, called
    as ``experts(hidden, top_k_index, top_k_weights)``) spread over ``pg`` by ``torch_user_moe``:
    this rank keeps its E/W experts' rows."""

    def __init__(self, experts: nn.Module, pg):
        super().__init__()
        world, rank = comm.world_size(pg), comm.rank(pg)
        local = experts.gate_up_proj.shape[0] // world
        rows = slice(rank * local, (rank + 1) * local)
        with torch.no_grad():
            self.gate_up_proj = nn.Parameter(experts.gate_up_proj[rows].clone())
            self.down_proj = nn.Parameter(experts.down_proj[rows].clone())
        self.act_fn, self.pg = experts.act_fn, pg

    def forward(self, hidden_states, top_k_index, top_k_weights):
        return torch_user_moe(hidden_states, top_k_index, top_k_weights,
                              self.gate_up_proj.transpose(1, 2), self.down_proj.transpose(1, 2),
                              self.pg, self.act_fn).to(hidden_states.dtype)


def rows_against_reference(ctx, samples: Dict[str, List[float]], methods: Sequence[str],
                           unavailable: Dict[str, str], tokens_total: int, **common) -> List[Dict]:
    """One row for this reference ("torch") and one per method: the median time, tokens/s over
    every rank's ``tokens_total``, and the method's per-round paired ratio against the reference."""
    rows = []
    for name in ("torch", *methods):
        if name in unavailable:
            rows.append(op_row(ctx, method=name, ms=None, status="unavailable",
                               note=unavailable[name], **common))
            continue
        ms = statistics.median(samples[name])
        ratio = paired_speedup(samples["torch"], samples[name])
        rows.append(op_row(ctx, method=name, ms=ms, tokens_per_s=tokens_total / (ms * 1e-3),
                           vs_torch=ratio, note=REFERENCE_NOTE if name == "torch"
                           else f"x{ratio:.2f} of torch (paired)", **common))
    return rows
