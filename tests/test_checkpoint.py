"""DCP checkpoints of ``pyfused.parallelize`` models (pyfused/parallelize/checkpoint.py) reshard.

A tiny Llama (vocabulary 101: padded on every TP size; 2 KV heads: replicated at tp=4) is trained
for two steps with AdamW at (dp=2, tp=2) and saved; the run goes on for two more steps. The
checkpoint is then loaded into a model built from a different seed at tp=4, pp=2 x tp=2, dp=4,
fully sharded (dp=4, dp=2 x tp=2, dp=2 x pp=2), at pp=2 x cp=2 with DDP and fully sharded (with
PYFUSED_LONG_TESTS=1), and into the plain single-process model: the
loaded parameters must equal the saved ones bit for bit, and the next two steps (the first tests
the parameters, the second the optimizer state) must give the saving run's losses. The same
checkpoint loads into pyfused's DistributedDataParallel with a ZeRO-sharded optimizer over 4 ranks
(its optimizer state: flat ranges of each parameter, cut across rows), which saves it again; that
checkpoint loads into the plain model with the same losses. A GPT-2 saved fully sharded at dp=2 x
pp=2 loads back on that mesh and into the plain model.
"""
import pytest
import torch

from tests.test_parallelize import SEQ, build
from tests.utils import assert_close, long_test

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
    pytest.param((2, 2), ("pp", "cp"), {"n_microbatches": 2, "split_points": [2]},
                 marks=long_test("a checkpoint loaded at pp x cp")),
    pytest.param((2, 2), ("pp", "cp"), {"dp": "fsdp", "n_microbatches": 2, "split_points": [2]},
                 marks=long_test("a checkpoint loaded at pp x cp with dp='fsdp'")),
], ids=["tp4", "pp2xtp2", "dp4", "fsdp-dp4", "fsdp-dp2xtp2", "fsdp-dp2xpp2", "pp2xcp2",
        "fsdp-pp2xcp2"])
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


def load_into_plain_model(path, model, opt) -> dict:
    """Load a checkpoint saved by ``checkpoint.save`` into the plain model and its optimizer (DCP
    in this process, no process group); returns the saved ``extra``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    state = {"model": model.state_dict(), "optim": get_optimizer_state_dict(model, opt),
             "extra": {"step": 0}}
    dcp.load(state, checkpoint_id=path)
    model.load_state_dict(state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])
    return state["extra"]


def _plain_losses(path, full, family="llama"):
    """Load the checkpoint into the plain model (DCP in one process) and train the next steps."""
    overrides = MODEL if family == "llama" else {"vocab_size": MODEL["vocab_size"]}
    model = build(family, seed=1, **overrides)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    assert load_into_plain_model(path, model, opt) == {"step": SAVED_AT}
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


# ---- an interrupted save, a dead or frozen peer, an incomplete folder ---------------------------
# Fresh ranks that may lose one (tests/fault_ranks.py): TP=3 over a tiny Llama, so that every rank
# writes rows of its own. The group's timeout is long while the ranks start and save the first
# checkpoint, then TIMEOUT_S (torch.distributed.set_timeout) for the struck save or load.
FAULT_WORLD, VICTIM, TIMEOUT_S, MARGIN_S = 3, 1, 3.0, 6.0


def _tp3_llama(seed: int):
    import transformers as tf

    torch.manual_seed(seed)
    cfg = tf.LlamaConfig(vocab_size=60, hidden_size=24, intermediate_size=30, num_hidden_layers=1,
                         num_attention_heads=6, num_key_value_heads=3, max_position_embeddings=16)
    return tf.LlamaForCausalLM(cfg)


def _striking_writer(path):
    """A FileSystemWriter with fault points just before and after this rank writes its shards."""
    from torch.distributed.checkpoint import FileSystemWriter

    from pyfused.comm.faults import fault_point

    class StrikingWriter(FileSystemWriter):
        def write_data(self, plan, planner):
            fault_point("test.write:before")
            done = super().write_data(plan, planner)
            done.wait()
            fault_point("test.write:after")  # this rank's shards are on disk, the save unfinished
            return done

    return StrikingWriter(path)


def _striking_reader(path):
    from torch.distributed.checkpoint import FileSystemReader

    from pyfused.comm.faults import fault_point

    class StrikingReader(FileSystemReader):
        def read_data(self, plan, planner):
            fault_point("test.read:before")
            return super().read_data(plan, planner)

    return StrikingReader(path)


def _interrupted(rank, out, op, point, action):
    """Train and save step 1 (rank 0 keeps its full state dict), train step 2, then ``op``
    ("save": save step 2 into the same folder; "load": load step 1) with rank VICTIM striking at
    ``point``."""
    import datetime

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import pyfused
    from pyfused.comm import faults
    from pyfused.parallelize import checkpoint
    from tests.fault_ranks import record_strike

    mesh = init_device_mesh("cpu", (FAULT_WORLD,), mesh_dim_names=("tp",))
    pm = pyfused.parallelize(_tp3_llama(0), mesh)
    opt = torch.optim.AdamW(pm.parameters(), lr=LR)
    path = out / "ckpt"
    ids = torch.randint(0, 60, (2, 9), generator=torch.Generator().manual_seed(1))
    for step in (1, 2):
        pm.backward(pm(input_ids=ids, labels=ids).loss)
        opt.step()
        if step == 1:
            checkpoint.save(path, pm, opt, extra={"step": 1})
            full = pm.full_state_dict()
            if rank == 0:
                torch.save(full, out / "step1.pt")
    dist.barrier()
    dist.set_timeout(datetime.timedelta(seconds=TIMEOUT_S))
    if rank == VICTIM:
        faults.strike_at(point, 1, action, before=lambda _: record_strike(out))
    if op == "save":
        checkpoint.save(path, pm, opt, extra={"step": 2}, storage_writer=_striking_writer(path))
    else:
        checkpoint.load(path, pm, opt, storage_reader=_striking_reader(path))


@pytest.mark.parametrize("action", ["kill", "stop"])
@pytest.mark.parametrize("op,point", [("save", "test.write:before"), ("save", "test.write:after"),
                                      ("load", "test.read:before")],
                         ids=["save-before-write", "save-after-write", "load-before-read"])
def test_interrupted_save_leaves_the_previous_checkpoint(op, point, action, tmp_path):
    """The survivors raise PeerFailure naming the checkpoint operation within the timeout, and the
    folder still loads exactly step 1's checkpoint: the interrupted save wrote nothing into it."""
    from pyfused.parallelize import checkpoint
    from tests.fault_ranks import launch

    bound = (TIMEOUT_S if action != "kill" else 0.0) + MARGIN_S
    results = launch(_interrupted, (op, point, action), world=FAULT_WORLD, victim=VICTIM,
                     out=tmp_path, timeout_s=60.0, bound_s=TIMEOUT_S + MARGIN_S,
                     preload=["pyfused.parallelize", "transformers.models.llama.modeling_llama",
                              "torch.distributed.checkpoint", "tests.test_checkpoint"])
    for r, res in results.items():
        assert res["raised"] == "PeerFailure", f"rank {r}: {res}"
        assert f"pyfused.checkpoint.{op}" in res["message"] or \
            f"agreement after checkpoint.{op}" in res["message"], res["message"]
        assert 0 <= res["raise_s"] <= bound, f"rank {r} raised after {res['raise_s']:.1f} s"
    print(f"\n{op} interrupted ({action} {point}): " + ", ".join(
        f"rank {r} raised at {res['raise_s']:.2f} s" for r, res in results.items()))
    step1 = torch.load(tmp_path / "step1.pt")
    model = _tp3_llama(5)
    extra = checkpoint.load(tmp_path / "ckpt", model, extra={"step": 0})
    assert extra == {"step": 1}, extra
    for k, v in model.state_dict().items():
        assert torch.equal(v, step1[k]), f"{k}: the loaded checkpoint is not step 1's"


def _load_incomplete(rank, world, path):
    import torch.distributed.checkpoint as dcp

    from pyfused.parallelize import checkpoint

    torch.manual_seed(0)  # the same replica on every rank
    model = torch.nn.Linear(5, 3)
    dcp.save({"model": model.state_dict()}, checkpoint_id=path)  # no COMPLETE marker
    try:
        checkpoint.load(path, torch.nn.Linear(5, 3))
        message = None
    except checkpoint.CheckpointError as e:
        message = str(e)
    fresh = torch.nn.Linear(5, 3)
    checkpoint.load(path, fresh, allow_incomplete=True)
    return message, all(torch.equal(a, b) for a, b in zip(fresh.parameters(), model.parameters()))


def test_load_refuses_an_incomplete_checkpoint(ranks, tmp_path):
    """A folder without the marker (a save that did not finish, a plain dcp.save) is refused with
    the same CheckpointError on every rank; allow_incomplete=True loads it."""
    got = ranks.run(2, _load_incomplete, str(tmp_path / "plain"), timeout=120)
    assert got[0] == got[1], got
    message, loaded = got[0]
    assert message and "has no COMPLETE marker" in message and "allow_incomplete=True" in message
    assert loaded


def test_save_commits_by_renaming(tmp_path):
    """One process (no group): the folder appears complete, the staging and replaced folders go."""
    from pyfused.parallelize import checkpoint

    model, path = torch.nn.Linear(5, 3), tmp_path / "one"
    for step in (1, 2):
        checkpoint.save(path, model, extra={"step": step})
        assert checkpoint.is_complete(path)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["one"]
    assert checkpoint.load(path, torch.nn.Linear(5, 3), extra={"step": 0}) == {"step": 2}
