"""``parallelize(model, mesh, dp="fsdp")``: fully_shard on the dp dim composed with tensor
parallelism, against the single-process model (test_parallelize_mesh.py's check: eval and training
logits and loss, every gathered gradient, the clipped norm, the gathered state dict bit-exact)."""
import pytest

from tests import test_parallelize_mesh as M

pytest.importorskip("transformers", reason="pyfused.parallelize tests need transformers")


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_fsdp_x_tensor_parallel(ranks, family):
    assert all(ranks.run(4, M._mesh_matches, family, (2, 2), ("dp", "tp"), True, {"dp": "fsdp"},
                         timeout=240))


def _fsdp_really_shards(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    import pyfused

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    pm = pyfused.parallelize(M.build("llama"), mesh, dp="fsdp")
    assert all(isinstance(p, DTensor) for p in pm.parameters())
    assert type(pm.module.model.layers[0]).__name__.startswith("FSDP")
    return True


def test_fsdp_parameters_are_dp_shards(ranks):
    assert all(ranks.run(4, _fsdp_really_shards, timeout=240))


def _bad_dp(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    import pyfused
    from pyfused.parallelize.api import ParallelizeError

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    try:
        pyfused.parallelize(M.build("llama"), mesh, dp="zero3")
    except ParallelizeError as e:
        return str(e)
    return None


def test_unknown_dp_same_error_everywhere(ranks):
    messages = ranks.run(4, _bad_dp, timeout=240)
    assert messages[0] and len(set(messages)) == 1 and "'zero3'" in messages[0], messages
