"""DCP checkpoints of ``pyfused.parallelize`` models (pyfused/parallelize/checkpoint.py) reshard.

A tiny Llama (vocabulary 101: padded on every TP size; 2 KV heads: replicated at tp=4) is trained
for two steps with AdamW at (dp=2, tp=2) and saved; the run goes on for two more steps. The
checkpoint is then loaded into a model built from a different seed at tp=4, pp=2 x tp=2, dp=4,
fully sharded (dp=4, dp=2 x tp=2, dp=2 x pp=2) and into the plain single-process model: the
loaded parameters must equal the saved ones bit for bit, and the next two steps (the first tests
the parameters, the second the optimizer state) must give the saving run's losses. The same checkpoint loads into pyfused's DistributedDataParallel with a
ZeRO-sharded optimizer over 4 ranks (its optimizer state: flat ranges of each parameter, cut across
rows), which saves it again; that checkpoint loads into the plain model with the same losses. A
GPT-2 saved fully sharded at dp=2 x pp=2 loads back on that mesh and into the plain model.
"""
import pytest
import torch

from tests.test_parallelize import SEQ, build
from tests.utils import assert_close

pytest.importorskip("transformers", reason="pyfused.parallelize tests need transformers (the 'models' extra)")

MODEL = dict(vocab_size=101, num_key_value_heads=2)
ROWS, LR, SAVED_AT, AFTER = 4, 1e-2, 2, 2


def _batch(step: int):
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, MODEL["vocab_size"], (ROWS, SEQ), generator=g)
    return ids, ids.clone()


def _train(pm, opt, first: int, last: int, dp_group=None):
    """Steps first..last; each dp rank takes its rows; returns the global batch's losses.
    ``dp_group``: for a model that is not a ParallelModel (DistributedDataParallel)."""
    import torch.distributed as dist

    if dp_group is None:
        info = pm.mesh_info
        dp, dp_rank, dp_group = info.size["dp"], info.coord["dp"], info.group["dp"]
    else:
        dp, dp_rank = dist.get_world_size(dp_group), dist.get_rank(dp_group)
    losses = []
    for step in range(first, last + 1):
        ids, labels = _batch(step)
        rows = slice(dp_rank * ROWS // dp, (dp_rank + 1) * ROWS // dp)
        opt.zero_grad(set_to_none=True)
        out = pm(input_ids=ids[rows], labels=labels[rows])
        out.loss.backward() if not hasattr(pm, "mesh_info") else pm.backward(out.loss)
        opt.step()
        loss = out.loss.detach().clone()
        if dp > 1:
            dist.all_reduce(loss, group=dp_group)
        losses.append(loss.item() / dp)
    return losses


def _parallel(shape, names, seed, options=None, family="llama"):
    from torch.distributed.device_mesh import init_device_mesh

    import pyfused

    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    overrides = MODEL if family == "llama" else {"vocab_size": MODEL["vocab_size"]}
    pm = pyfused.parallelize(build(family, seed=seed, **overrides), mesh, **(options or {}))
    return pm, torch.optim.AdamW(pm.parameters(), lr=LR)


def _save(rank, world, path):
    from pyfused.parallelize import checkpoint

    pm, opt = _parallel((2, 2), ("dp", "tp"), seed=0)
    _train(pm, opt, 1, SAVED_AT)
    checkpoint.save(path, pm, opt, extra={"step": SAVED_AT})
    full = pm.full_state_dict()
    return full if rank == 0 else None, _train(pm, opt, SAVED_AT + 1, SAVED_AT + AFTER)


def _load(rank, world, path, shape, names, options, saved, losses):
    from pyfused.parallelize import checkpoint

    pm, opt = _parallel(shape, names, seed=1, options=options)
    tag = f"mesh {dict(zip(names, shape))} rank {rank}"
    assert not torch.equal(pm.full_state_dict()["lm_head.weight"], saved["lm_head.weight"]), tag
    extra = checkpoint.load(path, pm, opt, extra={"step": 0})
    assert extra == {"step": SAVED_AT}, (extra, tag)
    full = pm.full_state_dict()
    assert list(full) == list(saved), tag
    for k, v in saved.items():
        assert torch.equal(full[k], v), f"{k} after loading, {tag}"
    got = _train(pm, opt, SAVED_AT + 1, SAVED_AT + AFTER)
    assert_close(torch.tensor(got), torch.tensor(losses), name=f"losses after loading, {tag}")
    return True


@pytest.fixture(scope="module")
def saved(ranks, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("dcp") / "step_2")
    results = ranks.run(4, _save, path, timeout=240)
    full, losses = results[0]
    assert all(r[1] == losses for r in results), "the dp/tp ranks disagree on the losses"
    return path, full, losses


@pytest.mark.parametrize("shape,names,options", [
    ((4,), ("tp",), {}),
    ((2, 2), ("pp", "tp"), {"n_microbatches": 2, "split_points": [2]}),
    ((4,), ("dp",), {}),
    ((4,), ("dp",), {"dp": "fsdp"}),
    ((2, 2), ("dp", "tp"), {"dp": "fsdp"}),
    ((2, 2), ("dp", "pp"), {"dp": "fsdp", "n_microbatches": 2, "split_points": [2]}),
], ids=["tp4", "pp2xtp2", "dp4", "fsdp-dp4", "fsdp-dp2xtp2", "fsdp-dp2xpp2"])
def test_load_on_another_mesh(ranks, saved, shape, names, options):
    path, full, losses = saved
    assert all(ranks.run(4, _load, path, shape, names, options, full, losses, timeout=240))


def _load_zero(rank, world, path, resaved, saved, losses):
    import torch.distributed as dist

    from pyfused.layers import DistributedDataParallel
    from pyfused.parallelize import checkpoint

    # another model config: the same clear error on every rank (DCP plans the load collectively)
    other = DistributedDataParallel(build("llama", seed=1, **MODEL, intermediate_size=48))
    with pytest.raises(checkpoint.CheckpointError, match="failed on ranks .0, 1, 2, 3.*Size mismatch"):
        checkpoint.load(path, other)
    # small buckets: many pieces, most of them starting and ending inside a row
    ddp = DistributedDataParallel(build("llama", seed=1, **MODEL), bucket_cap_mb=0.004,
                                  shard_optimizer=True)
    opt = ddp.wrap_optimizer(torch.optim.AdamW(ddp.parameters(), lr=LR))
    extra = checkpoint.load(path, ddp, opt, extra={"step": 0})
    assert extra == {"step": SAVED_AT}, extra
    for k, v in ddp.module.state_dict().items():
        assert torch.equal(v, saved[k]), f"{k} after loading, rank {rank}"
    checkpoint.save(resaved, ddp, opt, extra=extra)
    state = checkpoint.state_dict(ddp, opt)["optim"]["state"]
    cut = [k for k, st in state.items() if len(getattr(st["exp_avg"], "global_offsets", ())) > 1]
    assert cut, "no ZeRO piece starts or ends inside a row: the test misses that case"
    got = _train(ddp, opt, SAVED_AT + 1, SAVED_AT + AFTER, dp_group=dist.group.WORLD)
    assert_close(torch.tensor(got), torch.tensor(losses), name=f"losses after loading, ZeRO rank {rank}")
    return True


def _plain_losses(path, full, family="llama"):
    """Load the checkpoint into the plain model (DCP in one process) and train the next steps."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    overrides = MODEL if family == "llama" else {"vocab_size": MODEL["vocab_size"]}
    model = build(family, seed=1, **overrides)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    state = {"model": model.state_dict(), "optim": get_optimizer_state_dict(model, opt),
             "extra": {"step": 0}}
    dcp.load(state, checkpoint_id=path)
    model.load_state_dict(state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])
    assert state["extra"] == {"step": SAVED_AT}
    for k, v in model.state_dict().items():
        assert torch.equal(v, full[k]), k
    got = []
    for step in range(SAVED_AT + 1, SAVED_AT + AFTER + 1):
        ids, labels = _batch(step)
        opt.zero_grad(set_to_none=True)
        out = model(input_ids=ids, labels=labels)
        out.loss.backward()
        opt.step()
        got.append(out.loss.item())
    return got


def test_zero_sharded_optimizer_loads_and_saves(ranks, saved, tmp_path):
    path, full, losses = saved
    resaved = str(tmp_path / "zero")
    assert all(ranks.run(4, _load_zero, path, resaved, full, losses, timeout=240))
    assert_close(torch.tensor(_plain_losses(resaved, full)), torch.tensor(losses),
                 name="losses after loading the ZeRO run's checkpoint, plain model")


def test_load_into_the_plain_model(saved, tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    path, full, losses = saved
    converted = tmp_path / "full.pt"
    dcp_to_torch_save(path, converted)
    model_sd = torch.load(converted, weights_only=False)["model"]
    assert sorted(model_sd) == sorted(full)
    for k, v in full.items():
        assert torch.equal(model_sd[k], v), k

    got = _plain_losses(path, full)
    assert_close(torch.tensor(got), torch.tensor(losses), name="losses after loading, plain model")


def _gpt2_round_trip(rank, world, path):
    """GPT-2: a fused q|k|v Conv1D (three boxes per shard, transposed) and an LM head tied to the
    embedding (on both pipeline stages). Saved at (dp=2, tp=2), loaded at pp=2 x tp=2."""
    from pyfused.parallelize import checkpoint

    pm, opt = _parallel((2, 2), ("dp", "tp"), seed=0, family="gpt2")
    _train(pm, opt, 1, SAVED_AT)
    checkpoint.save(path, pm, opt, extra={"step": SAVED_AT})
    saved = pm.full_state_dict()
    losses = _train(pm, opt, SAVED_AT + 1, SAVED_AT + AFTER)

    pm, opt = _parallel((2, 2), ("pp", "tp"), seed=1, options={"n_microbatches": 2}, family="gpt2")
    checkpoint.load(path, pm, opt)
    full = pm.full_state_dict()
    for k, v in saved.items():
        assert torch.equal(full[k], v), f"gpt2 {k} after loading at pp=2 x tp=2, rank {rank}"
    got = _train(pm, opt, SAVED_AT + 1, SAVED_AT + AFTER)
    assert_close(torch.tensor(got), torch.tensor(losses), name=f"gpt2 losses after loading, rank {rank}")
    return saved if rank == 0 else None, losses


def test_gpt2_fused_qkv_and_tied_head(ranks, tmp_path):
    path = str(tmp_path / "gpt2")
    full, losses = ranks.run(4, _gpt2_round_trip, path, timeout=240)[0]
    assert_close(torch.tensor(_plain_losses(path, full, "gpt2")), torch.tensor(losses),
                 name="gpt2 losses after loading, plain model")


def _fsdp_pipeline_round_trip(rank, world, path):
    """GPT-2 saved at fsdp dp=2 x pp=2 (each stage's DTensor shards over its dp group; the tied
    head on the last stage) and loaded into the same mesh from another seed."""
    from pyfused.parallelize import checkpoint

    options = {"dp": "fsdp", "n_microbatches": 2}
    pm, opt = _parallel((2, 2), ("dp", "pp"), seed=0, options=options, family="gpt2")
    _train(pm, opt, 1, SAVED_AT)
    checkpoint.save(path, pm, opt, extra={"step": SAVED_AT})
    saved = pm.full_state_dict()
    losses = _train(pm, opt, SAVED_AT + 1, SAVED_AT + AFTER)

    pm, opt = _parallel((2, 2), ("dp", "pp"), seed=1, options=options, family="gpt2")
    checkpoint.load(path, pm, opt)
    full = pm.full_state_dict()
    for k, v in saved.items():
        assert torch.equal(full[k], v), f"gpt2 {k} after loading at fsdp dp=2 x pp=2, rank {rank}"
    got = _train(pm, opt, SAVED_AT + 1, SAVED_AT + AFTER)
    assert_close(torch.tensor(got), torch.tensor(losses), name=f"gpt2 fsdp x pp losses, rank {rank}")
    return saved if rank == 0 else None, losses


def test_fsdp_pipeline_saves_and_loads(ranks, tmp_path):
    path = str(tmp_path / "fsdp_pp")
    full, losses = ranks.run(4, _fsdp_pipeline_round_trip, path, timeout=240)[0]
    assert_close(torch.tensor(_plain_losses(path, full, "gpt2")), torch.tensor(losses),
                 name="gpt2 losses after loading the fsdp x pp checkpoint, plain model")
