"""``parallelize(model, mesh, dp="fsdp")`` with pipeline parallelism: each stage fully sharded over
the dp dim, against the single-process model.

* one step (test_parallelize_mesh.py's check): logits, loss, every gathered gradient, the clipped
  norm, the gathered state dict bit-exact -- Llama and GPT-2 (tied LM head across the stages);
* three AdamW steps with clipping on a 3-D (dp=2, pp=2, tp=1) mesh, 1F1B with 2 microbatches and
  GPipe with 3 uneven ones: the parameters equal the single-process model's;
* the memory claim: each dp rank of a stage holds only its rows of that stage's parameters, and
  nothing stays gathered after a step; gradients are reduce-scattered once per step; the full
  state dict loads into the shards;
* a split-backward schedule is refused with the same error on every rank;
* fsdp x pp x tp on the 3-D (2, 2, 2) mesh at world 8 (its own pool, closed after the test): one
  step of GPT-2 with sequence parallelism and three training steps of Llama;
* without parallelize: an MLP's ``FullyShardedStage``s under pyfused.pipeline's 1F1B, GPipe and
  interleaved 1F1B give the single-process gradients; an unwrapped fully_shard stage and a
  split-backward schedule get the same error on every rank.
"""
import pytest
import torch

from tests import test_parallelize_mesh as M
from tests.test_parallelize import SEQ, VOCAB, build
from tests.utils import assert_close, long_test

pytest.importorskip("transformers", reason="pyfused.parallelize tests need transformers")

ROWS, STEPS, LR, MAX_NORM = 10, 3, 1e-2, 0.5  # 5 rows per dp rank: uneven microbatches


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_fsdp_x_pipeline_one_step(ranks, family):
    # llama: one block per stage with the embedding and the head (the time-balanced cut may differ)
    options = {"n_microbatches": 2, "dp": "fsdp", **({"split_points": [2]} if family == "llama" else {})}
    assert all(ranks.run(4, M._mesh_matches, family, (2, 2), ("dp", "pp"), True, options, timeout=240))


def _batch(step: int):
    g = torch.Generator().manual_seed(200 + step)
    ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
    labels = ids.clone()
    labels[0, : 2 + step] = -100  # the dp halves' token counts differ from step to step
    return ids, labels


def _reference(family: str, dp: int):
    """The single-process model trained like the dp ranks together: each step the mean of the dp
    halves' mean losses (what FSDP's averaged reduce-scatter gives), clipped, AdamW."""
    ref = build(family)
    opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    norms = []
    for step in range(STEPS):
        ids, labels = _batch(step)
        opt.zero_grad(set_to_none=True)
        for r in range(dp):
            part = slice(r * ROWS // dp, (r + 1) * ROWS // dp)
            (ref(input_ids=ids[part], labels=labels[part]).loss / dp).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM))
        opt.step()
    return ref.state_dict(), torch.stack(norms)


def _trains_like_one_process(rank, world, family, options, shape=(2, 2, 1)):
    """``shape``: (dp, pp, tp); (2, 2, 2) runs at world 8."""
    from torch.distributed.device_mesh import init_device_mesh

    import pyfused

    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp", "pp", "tp"))
    dp, dp_rank = mesh.size(0), mesh.get_local_rank("dp")
    pm = pyfused.parallelize(build(family), mesh, dp="fsdp", **options)
    opt = torch.optim.AdamW(pm.parameters(), lr=LR)
    norms = []
    for step in range(STEPS):
        ids, labels = _batch(step)
        rows = slice(dp_rank * ROWS // dp, (dp_rank + 1) * ROWS // dp)
        opt.zero_grad(set_to_none=True)
        out = pm(input_ids=ids[rows], labels=labels[rows])
        pm.backward(out.loss)
        norms.append(pm.clip_grad_norm_(MAX_NORM))
        opt.step()
    full = pm.full_state_dict()
    want, ref_norms = _reference(family, dp)
    tag = f"{family} {options} mesh {shape} rank {rank}"
    assert list(full) == list(want), tag
    # AdamW divides each element by its own gradient's magnitude: a rounding-level difference in a
    # near-zero gradient moves that element by up to the learning rate (docs/FSDP.md, Tests)
    for k, v in want.items():
        assert_close(full[k], v, dtype=torch.float16, name=f"{k} after {STEPS} steps, {tag}")
    assert_close(torch.stack(norms), ref_norms, name=f"gradient norms, {tag}")
    return True


@pytest.mark.parametrize("family,options", [
    ("llama", {"n_microbatches": 2, "schedule": "1f1b", "split_points": [2]}),
    ("gpt2", {"n_microbatches": 3, "schedule": "gpipe", "split_points": [2]}),
], ids=["llama-1f1b-m2", "gpt2-gpipe-m3"])
def test_fsdp_x_pipeline_trains_like_one_process(ranks, family, options):
    assert all(ranks.run(4, _trains_like_one_process, family, options, timeout=240))


def _shards_and_syncs_once(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    import pyfused
    from pyfused.fsdp import FSDPModule

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    dp_rank = mesh.get_local_rank("dp")
    full = build("llama").state_dict()
    pm = pyfused.parallelize(build("llama"), mesh, dp="fsdp", n_microbatches=4, split_points=[2])
    stage = pm._stage
    units = [m for m in stage.submodule.modules() if isinstance(m, FSDPModule)]
    assert len(units) == 2, units  # the stage's block and its root (embedding or head)
    # every trained parameter of the stage is a DTensor holding this dp rank's rows, torch.chunk's cut
    local, whole = 0, 0
    for name, p in stage.submodule.named_parameters():
        assert isinstance(p, DTensor), name
        rows = p.shape[0]
        chunk = -(-rows // 2)
        assert p.to_local().shape[0] == max(0, min(chunk, rows - dp_rank * chunk)), name
        local += p.to_local().numel()
        whole += p.numel()
    keys = {k for k in full if k in dict(pm.module.named_parameters())}
    assert whole == sum(full[k].numel() for k in keys)
    assert local <= whole // 2 + sum(full[k][0].numel() for k in keys), (local, whole)

    ids, labels = _batch(0)
    rows = slice(dp_rank * 2, dp_rank * 2 + 2)
    batch = dict(input_ids=ids[rows].repeat(2, 1), labels=labels[rows].repeat(2, 1))  # 4 x 1 row
    pm(**batch)  # the first step also runs the schedule's shape pass (a forward under no_grad)
    groups = [u._pyfused_fsdp.group for u in units]
    gathers = [g.gathers for g in groups]
    reduces = []
    for g in groups:  # count the reduce-scatters of the step
        start = g.start_reduce

        def counted(start=start):
            reduces.append(1)
            return start()
        g.start_reduce = counted
    pm(**batch)
    assert len(reduces) == len(groups), f"{len(reduces)} reduce-scatters for {len(groups)} units"
    assert [g.gathers - n for g, n in zip(groups, gathers)] == [1] * len(groups)
    assert all(g.gathered_bytes() == 0 for g in groups), "parameters left gathered after the step"
    assert all(isinstance(p.grad, DTensor) for p in stage.submodule.parameters())
    # the original model's state dict loads into the shards (each rank copies its rows) and back
    other = build("llama", seed=1).state_dict()
    pm.load_full_state_dict(other)
    assert all(isinstance(p, DTensor) for p in stage.submodule.parameters())
    loaded = pm.full_state_dict()
    assert list(loaded) == list(other)
    assert all(torch.equal(loaded[k], v) for k, v in other.items())
    return True


def test_fsdp_stage_holds_its_shards_and_reduces_once(ranks):
    assert all(ranks.run(4, _shards_and_syncs_once, timeout=240))


def _three_d_mesh(rank, world):
    one_step = {"n_microbatches": 2, "dp": "fsdp", "split_points": [2]}
    assert M._mesh_matches(rank, world, "gpt2", (2, 2, 2), ("dp", "pp", "tp"), True, one_step)
    return _trains_like_one_process(rank, world, "llama", {"n_microbatches": 2, "split_points": [2]},
                                    (2, 2, 2))


@pytest.mark.slow
@long_test("fsdp x pp x tp at world 8 (8 processes on the CPU)")
def test_fsdp_x_pipeline_x_tensor_parallel_at_world_8():
    from tests.dist_pool import RankPool

    pool = RankPool(8)  # no other test runs 8 ranks: not kept for the session
    try:
        assert all(pool.run(_three_d_mesh, timeout=400))
    finally:
        pool.close()


def _split_backward_schedule(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    import pyfused
    from pyfused.parallelize.api import ParallelizeError

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    try:
        pyfused.parallelize(build("llama"), mesh, dp="fsdp", schedule="zbh1")
    except ParallelizeError as e:
        return str(e)
    return None


def test_split_backward_schedule_same_error_everywhere(ranks):
    # parallelize offers GPipe and 1F1B, whose last microbatch's backward is a stage's last one
    messages = ranks.run(4, _split_backward_schedule, timeout=240)
    assert messages[0] and len(set(messages)) == 1 and "'zbh1'" in messages[0], messages


def _batches_of_two_shapes(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    import pyfused
    from pyfused.comm import InputError

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    pm = pyfused.parallelize(build("llama"), mesh, dp="fsdp", n_microbatches=2)
    ids, labels = _batch(0)
    rows = 4 if pm.mesh_info.coord["dp"] == 0 else 5  # the second data rank feeds one row more
    try:
        pm(input_ids=ids[:rows], labels=labels[:rows])
    except InputError as e:
        return str(e)
    return None


def test_batches_of_different_shapes_same_error_everywhere(ranks):
    """fully_shard gathers a stage's parameters in the pipeline's shape pass, which reruns when a
    pipeline's batch shape changes: data ranks feeding different shapes would wait on each other's
    gathers until the group's timeout. They get the same InputError at once instead."""
    messages = ranks.run(4, _batches_of_two_shapes, timeout=240)
    assert messages[0] and len(set(messages)) == 1, messages
    assert f"from [4, {SEQ}] to [5, {SEQ}]" in messages[0], messages[0]


# ---- fully_shard under pyfused.pipeline's schedules directly: FullyShardedStage ----------------
BLOCK_WIDTHS = (6, 16, 16, 12, 5)  # 5 output rows: uneven shards (3 / 2) at dp=2


def _blocks():
    torch.manual_seed(3)
    widths = BLOCK_WIDTHS
    return [torch.nn.Sequential(torch.nn.Linear(widths[i], widths[i + 1]), torch.nn.Tanh())
            for i in range(len(widths) - 1)]


def _direct_stages(mesh, schedule: str, m: int):
    """This rank's stages of the 4 blocks (4 stages, 2 per rank, for interleaved 1F1B), each a
    fully_shard root over dp whose later blocks are units of their own; the reference blocks."""
    import copy

    from pyfused.fsdp import FullyShardedStage, fully_shard
    from pyfused.pipeline import PipelineStage

    blocks = _blocks()
    ref = [copy.deepcopy(b) for b in blocks]
    pp_rank, v = mesh.get_local_rank("pp"), 2 if schedule == "interleaved_1f1b" else 1
    per_stage = len(blocks) // (2 * v)
    stages, held = [], []
    for k in [pp_rank + 2 * j for j in range(v)]:
        mod = torch.nn.Sequential(*blocks[k * per_stage:(k + 1) * per_stage])
        for b in list(mod)[1:]:
            fully_shard(b, mesh=mesh["dp"])
        fully_shard(mod, mesh=mesh["dp"])
        stages.append(PipelineStage(FullyShardedStage(mod, m), k, 2 * v, "cpu",
                                    group=mesh.get_group("pp")))
        held += [(i, blocks[i]) for i in range(k * per_stage, (k + 1) * per_stage)]
    return stages, held, ref


def _direct_schedule(rank, world, schedule):
    from torch.distributed.device_mesh import init_device_mesh

    import pyfused.pipeline as pl

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    m, rows = 3, 8
    stages, held, ref = _direct_stages(mesh, schedule, m)
    cls = {"1f1b": pl.Schedule1F1B, "gpipe": pl.ScheduleGPipe,
           "interleaved_1f1b": pl.ScheduleInterleaved1F1B}[schedule]
    loss_fn = torch.nn.functional.mse_loss
    sched = cls(stages if schedule == "interleaved_1f1b" else stages[0], m, loss_fn=loss_fn)
    g = torch.Generator().manual_seed(4)
    x, y = torch.randn(rows, BLOCK_WIDTHS[0], generator=g), torch.randn(rows, BLOCK_WIDTHS[-1], generator=g)
    half = slice(mesh.get_local_rank("dp") * rows // 2, (mesh.get_local_rank("dp") + 1) * rows // 2)
    first = any(s.is_first for s in stages)
    last = any(s.is_last for s in stages)
    for _ in range(2):  # without zero_grad: the second step's gradients add to the first's
        sched.step(*((x[half],) if first else ()), target=y[half] if last else None)
    loss_fn(torch.nn.Sequential(*ref)(x), y).backward()
    for i, block in held:
        for (name, p), q in zip(block.named_parameters(), ref[i].parameters()):
            assert_close(p.grad.full_tensor(), 2 * q.grad,
                         name=f"{schedule} block {i} {name} gradient, rank {rank}")
    # an unwrapped fully_shard stage, or a split backward: the same error on every rank
    from pyfused.comm import InputError
    from pyfused.fsdp import FullyShardedStage, fully_shard

    errors = []
    for wrapped, cls in ((False, pl.Schedule1F1B), (True, pl.ScheduleZBH1)):
        mod = torch.nn.Sequential(*_blocks()[:2])
        fully_shard(mod, mesh=mesh["dp"])
        stage = pl.PipelineStage(FullyShardedStage(mod, 2) if wrapped else mod,
                                 mesh.get_local_rank("pp"), 2, "cpu", group=mesh.get_group("pp"))
        try:
            cls(stage, 2, loss_fn=loss_fn).step(x[:2], target=y[:2])
        except InputError as e:
            errors.append(str(e))
    return errors


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "interleaved_1f1b"])
def test_fully_shard_under_pipeline_schedules(ranks, schedule):
    errors = ranks.run(4, _direct_schedule, schedule, timeout=240)
    assert all(e == errors[0] for e in errors) and len(errors[0]) == 2, errors
    assert "FullyShardedStage(module, n_microbatches)" in errors[0][0], errors[0]
    assert "not 'zbh1'" in errors[0][1], errors[0]
