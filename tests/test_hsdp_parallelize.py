"""``parallelize(model, mesh, dp="hsdp")``: fully_shard on the ("dp_replicate", "dp_shard") dims of
the mesh, against the single-process model, and DCP checkpoints across HSDP, FSDP, DDP and
different numbers of hosts.

Grid cut for the 2-core box (each case is a 4-rank transformers run): a Llama at
dp_replicate=2 x dp_shard=2 and at dp_shard=2 x tp=2 (HSDP rows of tensor-parallel shards)
against the single-process model (tests/test_parallelize_mesh.py's check: logits, loss, every
gathered gradient, the clipped norm, the state dict bit-exact); one checkpoint saved at HSDP 2x2
after two AdamW steps, loaded at FSDP dp=4, DDP dp=4, HSDP dp_shard=2 x tp=2 and, on 2 ranks (one
host of two where the saving run had two), at HSDP 1x2 and DDP dp=2: the parameters bit-exact and
the next two steps' losses those of the saving run; one checkpoint saved at DDP (dp=2, tp=2) by
tests/test_checkpoint.py's saver loaded at HSDP 2x2. The refused meshes: the same error on every
rank.
"""
import pytest
import torch

from tests import test_checkpoint as C, test_parallelize_mesh as M
from tests.utils import assert_close

pytest.importorskip("transformers", reason="pyfused.parallelize tests need transformers")

TIMEOUT = 300
HSDP = ("dp_replicate", "dp_shard")


@pytest.mark.parametrize("shape,names", [((2, 2), HSDP), ((1, 2, 2), HSDP + ("tp",))],
                         ids=["2x2", "1x2xtp2"])
def test_hsdp_matches_single_process(ranks, shape, names):
    assert all(ranks.run(4, M._mesh_matches, "llama", shape, names, True, {"dp": "hsdp"},
                         timeout=TIMEOUT))


def _losses(pm, opt, first: int, last: int):
    """Steps first..last of tests/test_checkpoint.py's batches, each data-parallel rank on its rows
    (HSDP: dp_replicate x dp_shard ranks); the global batch's losses."""
    import torch.distributed as dist

    info = pm.mesh_info
    dp, dp_rank = info.size["dp"], info.coord["dp"]
    losses = []
    for step in range(first, last + 1):
        ids, labels = C._batch(step)
        rows = slice(dp_rank * C.ROWS // dp, (dp_rank + 1) * C.ROWS // dp)
        opt.zero_grad(set_to_none=True)
        out = pm(input_ids=ids[rows], labels=labels[rows])
        pm.backward(out.loss)
        opt.step()
        loss = out.loss.detach().clone()
        for d in ("dp", "dp_replicate", "dp_shard"):  # the dp ranks' mean (tp ranks agree)
            if info.group[d] is not None and info.size[d] > 1:
                dist.all_reduce(loss, group=info.group[d])
        losses.append(loss.item() / dp)
    return losses


def _save_hsdp(rank, world, path):
    from pyfused.parallelize import checkpoint

    pm, opt = C._parallel((2, 2), HSDP, seed=0, options={"dp": "hsdp"})
    _losses(pm, opt, 1, C.SAVED_AT)
    checkpoint.save(path, pm, opt, extra={"step": C.SAVED_AT})
    full = pm.full_state_dict()
    other, _ = C._parallel((2, 2), HSDP, seed=1, options={"dp": "hsdp"})
    other.load_full_state_dict(full)  # each rank copies its shard's rows, no communication
    for k, v in other.full_state_dict().items():
        assert torch.equal(v, full[k]), f"{k} after load_full_state_dict"
    return full if rank == 0 else None, _losses(pm, opt, C.SAVED_AT + 1, C.SAVED_AT + C.AFTER)


def _load(rank, world, path, shape, names, options, saved, losses):
    from pyfused.parallelize import checkpoint

    pm, opt = C._parallel(shape, names, seed=1, options=options)
    tag = f"mesh {dict(zip(names, shape))} {options} rank {rank}"
    assert not torch.equal(pm.full_state_dict()["lm_head.weight"], saved["lm_head.weight"]), tag
    assert checkpoint.load(path, pm, opt, extra={"step": 0}) == {"step": C.SAVED_AT}, tag
    full = pm.full_state_dict()
    for k, v in saved.items():
        assert torch.equal(full[k], v), f"{k} after loading, {tag}"
    got = _losses(pm, opt, C.SAVED_AT + 1, C.SAVED_AT + C.AFTER)
    assert_close(torch.tensor(got), torch.tensor(losses), name=f"losses after loading, {tag}")
    return True


@pytest.fixture(scope="module")
def hsdp_saved(ranks, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("dcp") / "hsdp")
    results = ranks.run(4, _save_hsdp, path, timeout=TIMEOUT)
    full, losses = results[0]
    assert all(r[1] == losses for r in results), "the ranks disagree on the losses"
    return path, full, losses


@pytest.mark.parametrize("world,shape,names,options", [
    (4, (4,), ("dp",), {"dp": "fsdp"}),
    (4, (4,), ("dp",), {}),
    (4, (1, 2, 2), HSDP + ("tp",), {"dp": "hsdp"}),
    (2, (1, 2), HSDP, {"dp": "hsdp"}),
    (2, (2,), ("dp",), {}),
], ids=["fsdp-dp4", "ddp-dp4", "hsdp-1x2xtp2", "2ranks-hsdp-1x2", "2ranks-ddp-dp2"])
def test_hsdp_checkpoint_loads_elsewhere(ranks, hsdp_saved, world, shape, names, options):
    path, full, losses = hsdp_saved
    assert all(ranks.run(world, _load, path, shape, names, options, full, losses,
                         timeout=TIMEOUT))


def test_ddp_checkpoint_loads_at_hsdp(ranks, tmp_path):
    path = str(tmp_path / "ddp")
    results = ranks.run(4, C._save, path, timeout=TIMEOUT)  # dp=2 x tp=2, DDP
    full, losses = results[0]
    assert all(ranks.run(4, _load, path, (2, 2), HSDP, {"dp": "hsdp"}, full, losses,
                         timeout=TIMEOUT))


def _refused(rank, world, shape, names, options):
    from torch.distributed.device_mesh import init_device_mesh

    import pyfused
    from pyfused.parallelize.api import ParallelizeError

    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    try:
        pyfused.parallelize(M.build("llama"), mesh, **options)
    except ParallelizeError as e:
        return str(e)
    return None


@pytest.mark.parametrize("shape,names,options,expect", [
    ((4,), ("dp",), {"dp": "hsdp"}, "dp='hsdp' needs the mesh dims 'dp_replicate' and 'dp_shard'"),
    ((2, 2), ("dp_shard", "dp_replicate"), {"dp": "hsdp"}, "needs 'dp_shard' right after"),
    ((2, 2), ("dp_replicate", "tp"), {"dp": "hsdp"}, "dp='hsdp' needs the mesh dims"),
    ((2, 2), HSDP, {"dp": "fsdp"}, "are HSDP's: pass dp='hsdp'"),
    ((2, 2), HSDP, {}, "are HSDP's: pass dp='hsdp'"),
], ids=["1-D", "swapped", "replicate-only", "fsdp", "ddp"])
def test_bad_hsdp_meshes_same_error_everywhere(ranks, shape, names, options, expect):
    messages = ranks.run(4, _refused, shape, names, options, timeout=TIMEOUT)
    assert messages[0] and len(set(messages)) == 1, messages
    assert expect in messages[0], messages[0]
