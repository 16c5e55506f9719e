"""``parallelize`` with a ``cp`` mesh dim: a tiny Llama trained 3 AdamW steps at dp x cp, cp x tp,
dp x cp with ``dp="fsdp"``, pp x cp, dp_replicate x cp and dp_shard x cp with ``dp="hsdp"`` (and,
with PYFUSED_LONG_TESTS=1, pp x dp_replicate x cp with ``dp="hsdp"``, dp x cp x tp, pp x cp with
``dp="fsdp"``, pp x cp at cp = 3, dp x pp x cp and pp x cp x tp) equals the same
model trained in one process on the whole batch (every gradient of the first step and their norm,
the loss of every step, then every parameter), with a sequence of 13 tokens (padded at the end to
a multiple of 2 cp); refused model types, attention masks and an HSDP option without HSDP's dims
raise the same error on every rank.

HSDP (``dp="hsdp"``): the cp ranks shard with dp_shard and replicate over dp_replicate; at
dp_replicate = 2 x cp = 2 (the cp group is the shard group, the replica all-reduce crosses
dp_replicate), dp_shard = 2 x cp = 2 (shards over dp_shard x cp flattened) and, with
PYFUSED_LONG_TESTS=1, pp = 2 x dp_replicate = 2 x cp = 2.

The parameters after the steps are compared with a tolerance of 1% of the learning rate per step:
AdamW divides each gradient by its running RMS, so an fp32 rounding difference in a gradient near
zero moves that element by a fraction of the learning rate (one element of 2304 moved 2e-5 at
lr 1e-2), and the next steps' gradients then differ by as much (7e-7 of 3e-4). The first step's
gradients, compared at fp32 tolerance from the same weights, are what catch a wrong scale (to
which AdamW's update is blind).
"""
import pytest
import torch

from tests.test_parallelize import VOCAB, build
from tests.utils import assert_close, long_test

pytest.importorskip("transformers", reason="pyfused.parallelize tests need transformers")

SEQ, PER_DP, STEPS, LR = 13, 2, 3, 1e-2
TIMEOUT = 240


def _batches(dp: int):
    g = torch.Generator().manual_seed(7)
    return [(torch.randint(0, VOCAB, (PER_DP * dp, SEQ), generator=g),
             torch.randint(0, VOCAB, (PER_DP * dp, SEQ), generator=g)) for _ in range(STEPS)]


def _train(rank, world, dims, sizes, data_parallel="ddp"):
    from torch.distributed.device_mesh import init_device_mesh

    import pyfused

    mesh = init_device_mesh("cpu", sizes, mesh_dim_names=dims)
    ref = build("llama", seed=3)
    pm = pyfused.parallelize(build("llama", seed=3), mesh, dp=data_parallel)
    info = pm.mesh_info  # dp: the "dp" dim, or HSDP's dp_replicate x dp_shard
    dp, coord = info.size["dp"], info.coord["dp"]
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    opt = torch.optim.AdamW(pm.parameters(), lr=LR)
    for step, (ids, labels) in enumerate(_batches(dp)):
        ref_loss = ref(input_ids=ids, labels=labels).loss
        ref_loss.backward()
        ref_grads = {n: p.grad.detach().clone() for n, p in ref.named_parameters()}
        ref_opt.step()
        ref_opt.zero_grad()
        mine = slice(coord * PER_DP, (coord + 1) * PER_DP)
        out = pm(input_ids=ids[mine], labels=labels[mine])
        pm.backward(out.loss)
        for name, g in (pm.full_grad_dict().items() if step == 0 else ()):
            assert_close(g, ref_grads[name], name=f"grad {name} rank {rank} {dims}")
        if step == 0:  # the norm alone: a bound this large clips nothing (both scale by 1.0)
            ref_norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in ref_grads.values()]))
            assert_close(pm.clip_grad_norm_(1e9), ref_norm, name=f"norm rank {rank} {dims}")
        opt.step()
        opt.zero_grad()
        total = out.loss.detach().clone()  # the whole sequence's loss of this dp rank's batch
        for d in ("dp", "dp_replicate", "dp_shard"):  # HSDP: "dp" has no group
            if info.group[d] is not None and info.size[d] > 1:
                torch.distributed.all_reduce(total, group=info.group[d])
        assert_close(total / dp, ref_loss, name=f"loss step {step} rank {rank} {dims}")
    full = pm.full_state_dict()
    for name, t in ref.state_dict().items():
        err = (full[name] - t).abs().max().item()
        assert err <= 0.01 * LR * STEPS, f"{name} after {STEPS} steps rank {rank} {dims}: {err:.3g}"
    return True


@pytest.mark.parametrize("dims,sizes,data_parallel", [
    (("dp", "cp"), (2, 2), "ddp"), (("cp",), (3,), "ddp"), (("cp", "tp"), (2, 2), "ddp"),
    (("dp", "cp"), (2, 2), "fsdp"), (("pp", "cp"), (2, 2), "ddp"),
    (("dp_replicate", "dp_shard", "cp"), (2, 1, 2), "hsdp"),
    (("dp_replicate", "dp_shard", "cp"), (1, 2, 2), "hsdp"),
    pytest.param(("pp", "dp_replicate", "dp_shard", "cp"), (2, 2, 1, 2), "hsdp",
                 marks=long_test("pp x dp_replicate x cp with dp='hsdp' on 8 ranks")),
    pytest.param(("dp", "cp", "tp"), (2, 2, 2), "ddp", marks=long_test("dp x cp x tp on 8 ranks")),
    pytest.param(("pp", "cp"), (2, 2), "fsdp", marks=long_test("pp x cp with dp='fsdp'")),
    pytest.param(("pp", "cp"), (2, 3), "ddp", marks=long_test("pp x cp at cp = 3 on 6 ranks")),
    pytest.param(("dp", "pp", "cp"), (2, 2, 2), "ddp", marks=long_test("dp x pp x cp on 8 ranks")),
    pytest.param(("pp", "cp", "tp"), (2, 2, 2), "ddp", marks=long_test("pp x cp x tp on 8 ranks")),
], ids=["dp2xcp2", "cp3", "cp2xtp2", "dp2xcp2-fsdp", "pp2xcp2", "rep2xcp2-hsdp",
        "shard2xcp2-hsdp", "pp2xrep2xcp2-hsdp", "dp2xcp2xtp2", "pp2xcp2-fsdp", "pp2xcp3",
        "dp2xpp2xcp2", "pp2xcp2xtp2"])
def test_training_matches_single_process(ranks, dims, sizes, data_parallel):
    world = 1
    for s in sizes:
        world *= s
    assert all(ranks.run(world, _train, dims, sizes, data_parallel, timeout=TIMEOUT))


def _logits(rank, world):
    """Each rank's logits rows, put back in global order, equal the unsharded model's."""
    from torch.distributed.device_mesh import init_device_mesh

    import pyfused

    ids, _ = _batches(1)[0]
    ref = build("llama", seed=3)(input_ids=ids).logits
    pm = pyfused.parallelize(build("llama", seed=3), init_device_mesh("cpu", (world,),
                                                                      mesh_dim_names=("cp",)))
    logits = pm.context.gather_rows(pm(input_ids=ids).logits)
    assert_close(logits[:, :SEQ], ref, name=f"logits rank {rank}")
    return True


def test_logits_match_in_global_order(ranks):
    assert all(ranks.run(2, _logits, timeout=TIMEOUT))


def _refused(rank, world, case):
    from torch.distributed.device_mesh import init_device_mesh

    import pyfused
    from pyfused.comm import InputError, LocalWorkError

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    try:
        if case == "gpt2":
            pyfused.parallelize(build("gpt2"), mesh)
        elif case == "hsdp":
            pyfused.parallelize(build("llama", seed=3), mesh, dp="hsdp")
        else:
            pm = pyfused.parallelize(build("llama", seed=3), mesh)
            ids, labels = _batches(1)[0]
            mask = torch.ones_like(ids)
            mask[:, 0] = 0  # left padding: not one causal sequence
            pm(input_ids=ids, attention_mask=mask, labels=labels)
    except (InputError, LocalWorkError) as e:
        return str(e)
    return None


@pytest.mark.parametrize("case,expected", [
    ("gpt2", "context parallelism (cp=2) supports"),
    ("hsdp", "dp='hsdp' needs the mesh dims 'dp_replicate' and 'dp_shard'"),
    ("left padding", "padding at the end")])
def test_refused_with_the_same_error_on_every_rank(ranks, case, expected):
    errors = ranks.run(2, _refused, case, timeout=TIMEOUT)
    assert errors[0] is not None and len(set(errors)) == 1 and expected in errors[0], errors
