"""``parallelize(model, mesh, dp="hsdp")`` with pipeline parallelism: each stage fully sharded on
the 2-D (dp_replicate, dp_shard) mesh, against the single-process model.

* three AdamW steps with clipping (1F1B, 2 microbatches of uneven rows with padded labels): the
  loss of every step, every gradient of the first step, the clipped norm of every step and the
  parameters after equal the single-process model trained on the whole batch -- a Llama at
  dp_replicate=2 x dp_shard=1 x pp=2 (the replica all-reduce alone), a GPT-2 at dp_replicate=1 x
  dp_shard=2 x pp=2 (the tied LM head's sharded rows summed across the stages) and, with
  PYFUSED_LONG_TESTS=1, a Llama at 2 x 2 x pp=2 on 8 ranks;
* a checkpoint saved at dp_replicate=2 x dp_shard=1 x pp=2 loads at dp=2 x tp=2 (DDP): the
  parameters bit-exact, the next two steps' losses those of the saving run.

What catches what: a replica all-reduce that is missing or not averaged changes the first step's
gradients at dp_replicate=2 (each replica would keep its own half-batch's gradient, or twice the
mean); a norm summed over dp_replicate as well as dp_shard is sqrt(2) times too large, which the
norm check catches at dp_replicate=2 (and, through the clipped update, the parameters).
"""
import pytest
import torch

from tests import test_checkpoint as C, test_hsdp_parallelize as HP
from tests.test_fsdp_pipeline import LR, MAX_NORM, STEPS
from tests.test_parallelize import SEQ, VOCAB, build
from tests.utils import assert_close, long_test

pytest.importorskip("transformers", reason="pyfused.parallelize tests need transformers")

TIMEOUT = 300
HSDP_PP = ("pp", "dp_replicate", "dp_shard")


def _batch(step: int, rows: int):
    """Step ``step``'s batch of ``rows`` rows, padded labels in its first row. Every data-parallel
    rank takes rows // dp of them: the same shape on every rank (a pipeline whose microbatch
    shapes differ from its data peers' runs its own metadata passes, whose parameter gathers the
    peers do not join; docs/FSDP.md)."""
    g = torch.Generator().manual_seed(200 + step)
    ids = torch.randint(0, VOCAB, (rows, SEQ), generator=g)
    labels = ids.clone()
    labels[0, : 2 + step] = -100  # the dp ranks' token counts differ from step to step
    return ids, labels


def _mean_over_data_ranks(value: torch.Tensor, info) -> float:
    """The mean of ``value`` over the dp_replicate x dp_shard ranks (a collective over both)."""
    import torch.distributed as dist

    total = value.detach().clone()
    for d in ("dp_replicate", "dp_shard"):
        if info.size[d] > 1:
            dist.all_reduce(total, group=info.group[d])
    return total / info.size["dp"]


def _reference_step(ref, opt, ids, labels, dp: int):
    """One step of the single-process model on the dp ranks' rows together: (the mean of their
    mean losses, the gradients before clipping, the clipped norm)."""
    opt.zero_grad(set_to_none=True)
    loss = 0.0
    for r in range(dp):
        part = slice(r * len(ids) // dp, (r + 1) * len(ids) // dp)
        part_loss = ref(input_ids=ids[part], labels=labels[part]).loss / dp
        part_loss.backward()
        loss += part_loss.detach()
    grads = {n: p.grad.clone() for n, p in ref.named_parameters()}
    norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)
    opt.step()
    return loss, grads, norm


def _trains_like_one_process(rank, world, family, shape, options):
    """``shape``: (pp, dp_replicate, dp_shard); 5 rows per data-parallel rank, 2 microbatches of
    3 and 2."""
    from torch.distributed.device_mesh import init_device_mesh

    import pyfused

    mesh = init_device_mesh("cpu", shape, mesh_dim_names=HSDP_PP)
    pm = pyfused.parallelize(build(family), mesh, dp="hsdp", **options)
    info = pm.mesh_info
    dp, dp_rank = info.size["dp"], info.coord["dp"]
    opt = torch.optim.AdamW(pm.parameters(), lr=LR)
    ref = build(family)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    tag = f"{family} mesh {dict(zip(HSDP_PP, shape))} rank {rank}"
    for step in range(STEPS):
        ids, labels = _batch(step, 5 * dp)
        ref_loss, ref_grads, ref_norm = _reference_step(ref, ref_opt, ids, labels, dp)
        rows = slice(dp_rank * len(ids) // dp, (dp_rank + 1) * len(ids) // dp)
        opt.zero_grad(set_to_none=True)
        out = pm(input_ids=ids[rows], labels=labels[rows])
        pm.backward(out.loss)
        if step == 0:
            grads = pm.full_grad_dict()
            assert list(grads) == list(ref_grads), tag
            for name, g in grads.items():
                assert_close(g, ref_grads[name], name=f"step-0 gradient {name}, {tag}")
        assert_close(pm.clip_grad_norm_(MAX_NORM), ref_norm, name=f"norm step {step}, {tag}")
        opt.step()
        assert_close(_mean_over_data_ranks(out.loss, info), ref_loss,
                     name=f"loss step {step}, {tag}")
    full, want = pm.full_state_dict(), ref.state_dict()
    assert list(full) == list(want), tag
    # AdamW divides each element by its own gradient's magnitude: the fp16 row, as in
    # tests/test_fsdp_pipeline.py
    for k, v in want.items():
        assert_close(full[k], v, dtype=torch.float16, name=f"{k} after {STEPS} steps, {tag}")
    return True


@pytest.mark.parametrize("family,shape,options", [
    ("llama", (2, 2, 1), {"n_microbatches": 2, "split_points": [2]}),
    ("gpt2", (2, 1, 2), {"n_microbatches": 2, "split_points": [2]}),
], ids=["llama-pp2x2x1", "gpt2-pp2x1x2"])
def test_hsdp_x_pipeline_trains_like_one_process(ranks, family, shape, options):
    assert all(ranks.run(4, _trains_like_one_process, family, shape, options, timeout=TIMEOUT))


@pytest.mark.slow
@long_test("hsdp x pp at dp_replicate=2 x dp_shard=2 x pp=2 (8 processes on the CPU)")
def test_hsdp_x_pipeline_at_world_8():
    from tests.dist_pool import RankPool

    pool = RankPool(8)  # few tests run 8 ranks: not kept for the session
    try:
        assert all(pool.run(_trains_like_one_process, "llama", (2, 2, 2),
                            {"n_microbatches": 2, "split_points": [2]}, timeout=600))
    finally:
        pool.close()


PP_OPTIONS = {"dp": "hsdp", "n_microbatches": 2, "split_points": [2]}
SAVING_MESH = ((2, 1, 2), HP.HSDP + ("pp",))


def _save_hsdp_pp(rank, world, path):
    from pyfused.parallelize import checkpoint

    pm, opt = C._parallel(*SAVING_MESH, seed=0, options=PP_OPTIONS)
    HP._losses(pm, opt, 1, C.SAVED_AT)
    checkpoint.save(path, pm, opt, extra={"step": C.SAVED_AT})
    full = pm.full_state_dict()
    return full if rank == 0 else None, HP._losses(pm, opt, C.SAVED_AT + 1, C.SAVED_AT + C.AFTER)


def test_hsdp_pipeline_checkpoint_loads_at_dp_x_tp(ranks, tmp_path):
    path = str(tmp_path / "hsdp_pp")
    results = ranks.run(4, _save_hsdp_pp, path, timeout=TIMEOUT)
    full, losses = results[0]
    assert all(r[1] == losses for r in results), "the ranks disagree on the losses"
    assert all(ranks.run(4, HP._load, path, (2, 2), ("dp", "tp"), {}, full, losses,
                         timeout=TIMEOUT))
