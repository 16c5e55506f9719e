"""The training paths ``gpu_nccl_paths.py`` checks, each against single-process training.

Every path is ``fn(cmp, rank, world, device)``: it trains (or runs forward and backward) with the
library on ``world`` ranks and the same model in this process on the whole batch, and hands every
pair of results to ``cmp.check``. Models, batches, optimizers and tolerances are the CPU tests'
(tests/test_ddp_helpers.py, test_fsdp_helpers.py, test_pipeline.py, test_parallelize*.py,
moe_models.py, test_ring_attention.py), so a path passes here exactly when its test's checks would.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from tests.utils import TOLERANCES

STEPS = 3


class Comparison:
    """The largest differences over every compared tensor, and the comparisons out of tolerance.

    ``max_rel`` is each tensor's largest difference over its largest expected magnitude (an
    elementwise ratio would blow up at values near zero). A tensor passes under the tests' policy
    (tests/utils.py ``TOLERANCES`` of ``dtype``) or, given ``abs_bound``, when no element is
    further than that. ``perturb``: add a visible error to every distributed result (a check that
    the report can fail)."""

    def __init__(self, perturb: bool = False):
        self.max_abs = 0.0
        self.max_rel = 0.0
        self.failures: list = []
        self.perturb = perturb

    def check(self, name: str, actual: torch.Tensor, expected: torch.Tensor,
              dtype: torch.dtype = torch.float32, abs_bound: float | None = None) -> None:
        act = actual.detach().to("cpu", torch.float64)
        exp = expected.detach().to("cpu", torch.float64)
        if act.shape != exp.shape:
            self.failures.append(f"{name}: shape {tuple(act.shape)} != {tuple(exp.shape)}")
            return
        scale = exp.abs().max().item() if exp.numel() else 0.0
        if self.perturb:
            act = act + 1e-2 * max(scale, 1.0)
        err = (act - exp).abs()
        worst = err.max().item() if err.numel() else 0.0
        if not torch.isfinite(act).all():
            worst = float("inf")
        self.max_abs = max(self.max_abs, worst)
        self.max_rel = max(self.max_rel, worst / scale if scale else worst)
        if abs_bound is not None:
            ok = worst <= abs_bound
        else:
            rtol, atol = TOLERANCES[dtype]
            ok = bool((err <= atol * scale + rtol * exp.abs()).all()) and worst != float("inf")
        if not ok:
            self.failures.append(f"{name}: max abs diff {worst:.3g} (scale {scale:.3g})")


def mean_over_ranks(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().clone()
    dist.all_reduce(t)
    return t / dist.get_world_size()


def data_parallel(cmp: Comparison, rank: int, world: int, device, shard: bool, micro: int = 1) -> None:
    """pyfused DDP (``shard``: its sharded optimizer, ZeRO-2) on the DDP tests' MLP, AdamW, small
    buckets (several per model; with ``shard`` parameters straddle shard edges); ``micro``
    micro-batches a step, all but the last under ``no_sync``."""
    from pyfused.layers import DistributedDataParallel
    from tests import test_ddp_helpers as H

    kind, seed = "mlp", 1
    mine = DistributedDataParallel(H.build(kind, seed + rank), bucket_cap_mb=0.002,
                                   shard_optimizer=shard)  # rank 0's weights are broadcast
    opt = mine.wrap_optimizer(H.make_opt("adamw", mine.parameters()))
    single = H.build(kind, seed)
    opt_single = H.make_opt("adamw", single.parameters())
    for s in range(STEPS):
        mbs = [H.batch(kind, seed, s, rank, k) for k in range(micro)]
        H.train_step(kind, mine, opt, mbs, ddp=True)
        mine.synchronize_params()
        H.train_step(kind, single, opt_single,
                     [H.full_batch(kind, seed, s, world, k) for k in range(micro)], ddp=False)
        with torch.no_grad():  # the next step's first loss, from the updated parameters
            loss = H.loss_of(kind, mine.module, H.batch(kind, seed, s + 1, rank))
            ref_loss = H.loss_of(kind, single, H.full_batch(kind, seed, s + 1, world))
        cmp.check(f"loss after step {s}", mean_over_ranks(loss), ref_loss)
        for (name, p), q in zip(single.named_parameters(), mine.module.parameters()):
            cmp.check(f"{name} step {s}", q, p)


def ddp(cmp, rank, world, device):
    data_parallel(cmp, rank, world, device, shard=False)


def zero2(cmp, rank, world, device):
    data_parallel(cmp, rank, world, device, shard=True)


def zero2_no_sync(cmp, rank, world, device):
    data_parallel(cmp, rank, world, device, shard=True, micro=2)


def fsdp(cmp, rank, world, device):
    """pyfused ``fully_shard`` on the FSDP tests' MLP (each block a unit, then the root; a frozen
    layer, an unused one): 12 global rows, each rank its share."""
    import pyfused
    from tests import test_fsdp_helpers as H

    rows = 12
    model = H.build("mlp").to(device)
    for unit in model.units():
        pyfused.fully_shard(unit)
    pyfused.fully_shard(model)
    opt = H.make_optimizer(model)
    ref = H.build("mlp").to(device)
    ref_opt = H.make_optimizer(ref)
    per = rows // world
    for s in range(STEPS):
        whole = tuple(t.to(device) for t in H.batch("mlp", s, 0, rows))
        loss = model.loss(H.rows_of(whole, rank * per, (rank + 1) * per))
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_loss = ref.loss(whole)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        cmp.check(f"loss step {s}", mean_over_ranks(loss), ref_loss)
        full = {k: v.full_tensor() for k, v in model.state_dict().items()}
        # AdamW moves an element with a near-zero gradient by up to ~lr on a rounding-level
        # difference: tests/test_fsdp.py compares the parameters at the fp16 row, as here.
        for k, want in ref.state_dict().items():
            cmp.check(f"{k} step {s}", full[k], want, dtype=torch.float16)


def pipeline(cmp, rank, world, device):
    """1F1B over ``world`` stages (one per rank) of the pipeline tests' 9-layer MLP, 4 microbatches,
    SGD with momentum; each rank checks its stage's parameters, the last also the loss."""
    import copy

    import torch.nn as nn

    from pyfused.pipeline import PipelineSegment, PipelineStage, Schedule1F1B, even_starts, layer_units, split
    from tests.test_pipeline import batch, build_model

    m = 4
    model = build_model("mlp").to(device)
    ref = copy.deepcopy(model)
    ref_chain = PipelineSegment(layer_units(ref))
    mods, _ = split(model, world, split_points=even_starts(len(layer_units(model)), world))
    loss_fn = nn.MSELoss()
    sched = Schedule1F1B(PipelineStage(mods[rank], rank, world, device), m, loss_fn)
    params = list(mods[rank].parameters())
    opt = torch.optim.SGD(params, lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    names = {id(p): n for n, p in model.named_parameters()}
    last = rank == world - 1
    for s in range(STEPS):
        x, y = (t.to(device) for t in batch(s, m))
        losses = []
        sched.step(*((x,) if rank == 0 else ()), target=y if last else None, losses=losses)
        opt.step()
        opt.zero_grad()
        ref_loss = loss_fn(ref_chain(x), y)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        if last:
            cmp.check(f"loss step {s}", torch.stack(losses).mean(), ref_loss)
        for p in params:
            cmp.check(f"{names[id(p)]} step {s}", p, ref.get_parameter(names[id(p)]))


def parallelize(cmp, rank, world, device):
    """``pyfused.parallelize`` at tp=``world`` of the parallelize tests' tiny random Llama (hidden
    48, 8 heads, FFN 44), AdamW: the loss of every step, the first step's gradients, then the
    parameters within 1% of the learning rate per step (tests/test_parallelize_context.py)."""
    from torch.distributed.device_mesh import init_device_mesh

    import pyfused
    from tests.test_parallelize import VOCAB, build

    lr, seq, rows = 1e-2, 12, 3
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("tp",))
    ref = build("llama", seed=3).to(device)
    pm = pyfused.parallelize(build("llama", seed=3).to(device), mesh)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=lr)
    opt = torch.optim.AdamW(pm.parameters(), lr=lr)
    g = torch.Generator().manual_seed(7)
    for s in range(STEPS):
        ids, labels = (torch.randint(0, VOCAB, (rows, seq), generator=g).to(device) for _ in "il")
        ref_loss = ref(input_ids=ids, labels=labels).loss
        ref_loss.backward()
        ref_grads = {n: p.grad.detach().clone() for n, p in ref.named_parameters()}
        ref_opt.step()
        ref_opt.zero_grad()
        out = pm(input_ids=ids, labels=labels)
        pm.backward(out.loss)
        for name, grad in (pm.full_grad_dict().items() if s == 0 else ()):
            cmp.check(f"grad {name}", grad, ref_grads[name])
        opt.step()
        opt.zero_grad()
        cmp.check(f"loss step {s}", out.loss, ref_loss)
        full = pm.full_state_dict()
        for name, t in ref.state_dict().items():
            cmp.check(f"{name} step {s}", full[name], t, abs_bound=0.01 * lr * (s + 1))


def moe(cmp, rank, world, device):
    """``ExpertParallelExperts`` (ep=``world``, 2 experts per rank, unfused dispatch/combine) in
    the MoE tests' tiny Mixtral, each rank its own batch: logits, loss, aux loss and the replicated
    gradients equal the single-process model's on that batch, each rank's experts' gradients the
    sum over every rank's batch (tests/test_moe_layer.py)."""
    from pyfused.layers import ExpertParallelExperts
    from tests.moe_models import batch, build, experts_modules

    def run(model, seed):
        ids, labels = (t.to(device) for t in batch(seed=seed))
        model.zero_grad()
        out = model(input_ids=ids, labels=labels, output_router_logits=True)
        out.loss.backward()
        grads = {n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p))
                 for n, p in model.named_parameters()}
        return out, grads

    experts = 2 * world
    model = build("mixtral", experts=experts).to(device)
    for name, module in experts_modules(model).items():
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, ExpertParallelExperts(module, method="unfused"))
    out, mine = run(model, rank)
    ref = build("mixtral", experts=experts).to(device)
    totals = {}
    for source in range(world):
        ref_out, ref_grads = run(ref, source)
        for n, grad in ref_grads.items():
            totals[n] = totals.get(n, 0) + grad
        if source == rank:
            own, expected = ref_grads, ref_out
    cmp.check("logits", out.logits, expected.logits)
    cmp.check("loss", out.loss, expected.loss)
    cmp.check("aux loss", out.aux_loss, expected.aux_loss)
    rows = slice(rank * 2, rank * 2 + 2)
    for n, grad in mine.items():
        cmp.check(f"grad {n}", grad, totals[n][rows] if ".experts." in n else own[n])


def ring_attention(cmp, rank, world, device):
    """``ring_attention(method="ring")`` at cp=``world``, causal, grouped-query heads (6 / 2), the
    zigzag layout, 10 local rows of head width 10, fp32: output and dQ, dK, dV against fp64
    attention over the whole sequence (tests/test_ring_attention.py)."""
    from pyfused.ops.ring_attention import ring_attention as ring, ring_attention_ref
    from pyfused.ops.sequence_shards import shard_sequence
    from tests.utils import rank_tensors

    b, d, hq, hkv, s_local = 2, 10, 6, 2, 10
    s = world * s_local
    q, g = rank_tensors(20, 2, (b, hq, s, d), torch.float32)
    k, v = rank_tensors(21, 2, (b, hkv, s, d), torch.float32)
    ref_in = [t.double().requires_grad_() for t in (q, k, v)]
    ref = ring_attention_ref(*ref_in)
    ref.backward(g.double())

    def local(t):
        return shard_sequence(t, 2, rank, world, "zigzag")

    mine = [local(t).to(device).requires_grad_() for t in (q, k, v)]
    out = ring(*mine, method="ring", layout="zigzag")
    out.backward(local(g).to(device))
    cmp.check("out", out, local(ref))
    for label, t, r in zip("qkv", mine, ref_in):
        cmp.check(f"d{label}", t.grad, local(r.grad))


PATHS = {"ddp": ddp, "zero2": zero2, "zero2_no_sync": zero2_no_sync, "fsdp": fsdp, "pipeline": pipeline,
         "parallelize": parallelize, "moe": moe, "ring_attention": ring_attention}
