"""DCP checkpoints of expert-parallel models reshard: a tiny Mixtral (4 experts) trained for two SGD
steps with momentum at ep=4 (one expert per rank) and saved loads at dp=2 x ep=2 (two experts per
rank) and into the plain single-process model; saved fully sharded (dp="fsdp") at dp=2 x ep=2, it
loads fully sharded at ep=4. The loaded parameters equal the saved ones bit for bit, and the next
step -- which reads the momentum buffers, the optimizer state of the expert shards included --
gives the saving run's losses.
"""
import pytest
import torch

from tests.utils import assert_close

pytest.importorskip("transformers", reason="the MoE checkpoint tests need transformers")

TIMEOUT = 400
SAVED_AT = 2
EXPERTS = 4


def _data_rank(info) -> int:
    return info.coord["dp"] * info.size["ep"] + info.coord["ep"]


def _parallel(dims, shape, seed, dp="ddp"):
    from torch.distributed.device_mesh import init_device_mesh

    import pyfused
    from tests.moe_models import build

    mesh = init_device_mesh("cpu", shape, mesh_dim_names=dims)
    pm = pyfused.parallelize(build("mixtral", seed=seed, experts=EXPERTS), mesh, dp=dp)
    return pm, _optimizer(pm)


def _optimizer(model):
    return torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)


def _step(pm, opt, step: int) -> float:
    from tests.moe_models import batch

    ids, labels = batch(seed=100 * step + _data_rank(pm.mesh_info), seq=8)
    opt.zero_grad(set_to_none=True)
    out = pm(input_ids=ids, labels=labels)
    pm.backward(out.loss)
    opt.step()
    return out.loss.item()


def _save_then_load(rank, world, path, saving, loading):
    """Save on the ``saving`` (dims, shape, dp), then load on the ``loading`` one: (the saved state
    on rank 0, the saving run's loss of the step after the save)."""
    from pyfused.parallelize import checkpoint

    pm, opt = _parallel(*saving[:2], seed=0, dp=saving[2])
    for step in range(SAVED_AT):
        _step(pm, opt, step)
    checkpoint.save(path, pm, opt, extra={"step": SAVED_AT})
    saved = pm.full_state_dict()
    after = _step(pm, opt, SAVED_AT)

    other, other_opt = _parallel(*loading[:2], seed=1, dp=loading[2])
    where = f"{dict(zip(*loading[:2]))} dp={loading[2]}, rank {rank}"
    experts = "model.layers.0.mlp.experts.gate_up_proj"
    assert not torch.equal(other.full_state_dict()[experts], saved[experts])
    assert checkpoint.load(path, other, other_opt, extra={"step": 0}) == {"step": SAVED_AT}
    loaded = other.full_state_dict()
    assert list(loaded) == list(saved)
    for k, v in saved.items():
        assert torch.equal(loaded[k], v), f"{k} after loading at {where}"
    assert_close(torch.tensor(_step(other, other_opt, SAVED_AT)), torch.tensor(after),
                 name=f"loss after loading at {where}")
    return saved if rank == 0 else None, after


def _plain_step(path, saved):
    """Load into the plain model (DCP in this process) and run the next step on data rank 0's
    batch alone: its loss is the forward before the update, so it needs the parameters only."""
    from tests.moe_models import batch, build
    from tests.test_checkpoint import load_into_plain_model

    model = build("mixtral", seed=1, experts=EXPERTS)
    opt = _optimizer(model)
    assert load_into_plain_model(path, model, opt) == {"step": SAVED_AT}
    for k, v in model.state_dict().items():
        assert torch.equal(v, saved[k]), f"{k} in the plain model"
    momentum = [opt.state[p].get("momentum_buffer") for p in model.parameters()]
    assert all(m is not None for m in momentum), "the momentum buffers were not loaded"
    ids, labels = batch(seed=100 * SAVED_AT, seq=8)
    return model(input_ids=ids, labels=labels).loss.item()


EP4 = (("ep",), (4,))
DP2_EP2 = (("dp", "ep"), (2, 2))


@pytest.mark.parametrize("saving,loading", [(EP4 + ("ddp",), DP2_EP2 + ("ddp",)),
                                            (DP2_EP2 + ("fsdp",), EP4 + ("fsdp",))],
                         ids=["ddp", "fsdp"])
def test_expert_shards_load_at_another_ep_size_and_into_the_plain_model(ranks, tmp_path, saving,
                                                                         loading):
    path = str(tmp_path / "step_2")
    results = ranks.run(4, _save_then_load, path, saving, loading, timeout=TIMEOUT)
    saved, after = results[0]
    assert_close(torch.tensor(_plain_step(path, saved)), torch.tensor(after),
                 name="loss after loading into the plain model (data rank 0's batch)")
