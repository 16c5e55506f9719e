"""The one-shot / two-shot crossover of the fused all-reduce + residual + RMSNorm, W virtual ranks on
one GPU (pyfused/testing/virtual_ranks.py): the data for ``pyfused/fused/config.py``.

Per W = 2, 4, 8 and message size S (bytes of one rank's x, hidden 4096: 8 KiB to 64 MiB in bf16;
``--quick``: 8 KiB and 512 KiB), in one run on the same inputs: the fused kernel with the one-shot
algorithm forced, with the two-shot algorithm forced, and the unfused composition (torch's kernels,
rank by rank) as the baseline. ``algbw`` / ``busbw`` follow nccl-tests' all-reduce definitions over
S. The note of a W's last two-shot row says up to which size one-shot was faster at that W.

Times are device times (``pyfused.bench.harness.device_samples``): W ranks queued from one thread
take 0.2 to 1.3 ms of host time per call, far above the device time of the small sizes, so a
wall-clock timing would compare host paths. A sleep kernel holds the streams while the host queues
a few calls, and events around the calls time the device alone; ``host_queue_ms`` is the host time
to queue one call, and a row whose queueing outlasted the sleep says so in its note.

Every row's transport is ``virtual-ranks (1 GPU)``: the peers' buffers are memory of the same GPU,
read at its HBM bandwidth, so the crossover found here is that of the kernels' own costs (barrier
rounds, the number of passes over memory), not of an NVLink switch; a multi-GPU run of the
``all_reduce_add_rmsnorm`` suite (its ``fused.one_shot`` / ``fused.two_shot`` rows) gives that one.
On CPU the fused kernel would run in the interpreter: the suite emits ``skipped`` rows.
"""
from __future__ import annotations

import statistics
from typing import Dict, List

import torch

from pyfused.bench.harness import BenchContext, bandwidths, device_samples, op_row

MULTI_RANK = False

TRANSPORT = "virtual-ranks (1 GPU)"
WORLDS = (2, 4, 8)
HIDDEN = 4096
ROWS = (1, 8, 64, 256, 1024, 4096, 8192)  # 8 KiB .. 64 MiB of bf16 x per rank
QUICK_ROWS = (1, 64)
CASES = ("one_shot", "two_shot")
ROUNDS = 7  # rounds of each method (median), at most the context's iterations
CALLS = 8   # calls queued behind one sleep kernel per round
SKIP_STATUS = "skipped: needs a CUDA GPU (virtual ranks are CUDA streams of one context)"


def _label(world: int, rows: int, nbytes: int) -> str:
    return f"W={world} rows={rows} n={HIDDEN} S={nbytes >> 10} KiB"


def crossover_note(times: Dict[int, Dict[str, float]]) -> str:
    """Up to which S one-shot was faster, from {S: {"one_shot": ms, "two_shot": ms}}."""
    faster = [s for s in sorted(times) if times[s]["one_shot"] <= times[s]["two_shot"]]
    if not faster:
        return "two-shot faster at every size measured"
    last = max(faster)
    above = [s for s in sorted(times) if s > last]
    if not above:
        return "one-shot faster at every size measured"
    return f"one-shot faster up to S={last >> 10} KiB, two-shot from S={above[0] >> 10} KiB"


def run(ctx: BenchContext) -> List[dict]:
    rows_list = QUICK_ROWS if ctx.quick else ROWS
    elem = torch.empty((), dtype=ctx.dtype).element_size()
    if ctx.device.type != "cuda":
        return [op_row(ctx, shape=_label(w, r, r * HIDDEN * elem), dtype=ctx.dtype, method=m,
                       transport=TRANSPORT, ms=None, status=SKIP_STATUS, world=w)
                for w in WORLDS for r in rows_list
                for m in ("unfused", "fused.one_shot", "fused.two_shot")]
    from pyfused.ops.registry import OPS
    from pyfused.testing.virtual_cases import cases, run_unfused
    from pyfused.testing.virtual_ranks import VirtualGroup

    op = "all_reduce_add_rmsnorm"
    by_name = {name.split(".")[-1]: case for name, case in cases([OPS[op]]).items()}
    rounds = min(ctx.iters, ROUNDS)
    out = []
    for w in WORLDS:
        group = VirtualGroup(w, ctx.device)
        per_size: Dict[int, Dict[str, float]] = {}
        try:
            for rows in rows_list:
                nbytes = rows * HIDDEN * elem
                inputs = by_name["one_shot"].make(w, rows, HIDDEN, 0, ctx.dtype, group.device, 0)
                for name in CASES:  # first calls: kernels loaded, tables built, timeouts checked
                    group.run(by_name[name].fused, inputs)
                fns = {"unfused": lambda: run_unfused(group, by_name["one_shot"], inputs)}
                for name in CASES:
                    fns[name] = (lambda c=by_name[name]: group.launch(c.fused, inputs,
                                                                       threads=c.blocks_host))
                samples = device_samples(fns, rounds, CALLS)
                for name in CASES:  # the timed calls' wait timeouts, if any, raise here
                    group.run(by_name[name].fused, inputs)
                times = {k: statistics.median(s[0] for s in v) for k, v in samples.items()}
                per_size[nbytes] = times
                label = _label(w, rows, nbytes)
                for method, key in (("unfused", "unfused"), ("fused.one_shot", "one_shot"),
                                    ("fused.two_shot", "two_shot")):
                    bound = sum(s[2] for s in samples[key])
                    note = f"host-bound in {bound} of {rounds} rounds; " if bound else ""
                    if key == "two_shot":
                        note += crossover_note(per_size)
                    algbw, busbw = bandwidths("all_reduce", nbytes, times[key], w)
                    out.append(op_row(ctx, shape=label, dtype=ctx.dtype, method=method,
                                      transport=TRANSPORT, ms=times[key],
                                      t_baseline=times["unfused"], note=note, world=w,
                                      bytes=nbytes, sm_budget=group.sm_budget,
                                      host_queue_ms=statistics.median(s[1] for s in samples[key]),
                                      virtual_algbw_GBps=algbw, virtual_busbw_GBps=busbw))
        finally:
            group.free()
    return out
