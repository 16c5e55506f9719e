"""DCP checkpoints of ``pyfused.parallelize`` models (pyfused/parallelize/checkpoint.py) reshard.

A tiny Llama (vocabulary 101: padded on every TP size; 2 KV heads: replicated at tp=4) is trained
for two steps with AdamW at (dp=2, tp=2) and saved; the run goes on for two more steps. The
checkpoint is then loaded into a model built from a different seed at tp=4, pp=2 x tp=2, dp=4 and
into the plain single-process model: the loaded parameters must equal the saved ones bit for bit,
and the next two steps (the first tests the parameters, the second the optimizer state) must give
the saving run's losses.
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


def _train(pm, opt, first: int, last: int):
    """Steps first..last; each dp rank takes its rows; returns the global batch's losses."""
    import torch.distributed as dist

    info = pm.mesh_info
    dp, dp_rank = info.size["dp"], info.coord["dp"]
    losses = []
    for step in range(first, last + 1):
        ids, labels = _batch(step)
        rows = slice(dp_rank * ROWS // dp, (dp_rank + 1) * ROWS // dp)
        opt.zero_grad(set_to_none=True)
        out = pm(input_ids=ids[rows], labels=labels[rows])
        pm.backward(out.loss)
        opt.step()
        loss = out.loss.detach().clone()
        if dp > 1:
            dist.all_reduce(loss, group=info.group["dp"])
        losses.append(loss.item() / dp)
    return losses


def _parallel(shape, names, seed, options=None):
    from torch.distributed.device_mesh import init_device_mesh

    import pyfused

    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    pm = pyfused.parallelize(build("llama", seed=seed, **MODEL), mesh, **(options or {}))
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
], ids=["tp4", "pp2xtp2", "dp4"])
def test_load_on_another_mesh(ranks, saved, shape, names, options):
    path, full, losses = saved
    assert all(ranks.run(4, _load, path, shape, names, options, full, losses, timeout=240))


def test_load_into_the_plain_model(saved, tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    path, full, losses = saved
    converted = tmp_path / "full.pt"
    dcp_to_torch_save(path, converted)
    model_sd = torch.load(converted, weights_only=False)["model"]
    assert sorted(model_sd) == sorted(full)
    for k, v in full.items():
        assert torch.equal(model_sd[k], v), k

    model = build("llama", seed=1, **MODEL)
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
    assert_close(torch.tensor(got), torch.tensor(losses), name="losses after loading, plain model")
