"""HSDP: ``pyfused.fully_shard`` on a 2-D (replicate, shard) mesh, against torch FSDP2's HSDP in the
same gloo run and against the single-process model.

Meshes: 2x2 at world 4 carries the main checks; the edges 2x1 (replicas of whole parameters: no
reduce-scatter, only the all-reduce) and 1x2 (one replica: FSDP on 2-D DTensors) run at world 2,
and 3x1 at world 3 (an all-reduce over 3 ranks). Grid cut for the 2-core box: the MLP of
tests/test_fsdp_helpers.py (uneven and empty shards, a frozen layer, a never-used parameter, a root
whose inputs need no gradient) carries the numerics; a transformers model runs through
``parallelize(dp="hsdp")`` in tests/test_hsdp_parallelize.py.

Against FSDP2. FSDP2 averages with gloo's AVG (a sum, then a division by S for the reduce-scatter
and by R for the all-reduce); pyfused multiplies each gradient by 1/(R x S) before summing. The two
are the same bits when R and S are powers of two (the scalings are exact), so at 2x2, 2x1 and 1x2
gradients and parameters after three AdamW steps are compared with ``torch.equal``, in fp32 and in
bf16 compute with fp32 reduction; at 3x1 at the fp32 row of the tolerance table (gradients) and the
fp16 row (parameters, as in tests/test_fsdp.py: AdamW turns a rounding-level difference of a
near-zero gradient into up to ~lr).

Also: refused meshes and units (the same error on every rank of a 2x2 mesh, also on ranks that share
no group with the one at fault), the host mesh with hosts faked by ``PYFUSED_HOST`` (the same body
runs on real hosts in tests/test_multihost_testbed.py), buffer bytes against FSDP2's, and DCP round
trips between HSDP and FSDP.
"""
import pytest
import torch
import torch.nn as nn

from benchmarks import multihost_testbed as mt
from tests import test_fsdp_helpers as H
from tests.utils import assert_close

TIMEOUT = 300  # a hang guard; the first run in a pool pays the DTensor and transformers imports
ROWS = 12      # global rows per micro-step: divisible by 1-4
STEPS = 3
DIMS = ("dp_replicate", "dp_shard")


def _mesh(shape, names=DIMS):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def _policy(bf16: bool):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if bf16:
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()  # torch's default: no casts


def _shard(model, shard, **kwargs):
    for unit in model.units():
        shard(unit, **kwargs)
    shard(model, **kwargs)
    return model


def _train(rank, world, shard, mesh, bf16=False, micro=1, mode="no_sync", max_norm=None):
    """The MLP sharded by ``shard`` (torch's or pyfused's ``fully_shard``) on ``mesh`` after
    ``STEPS`` AdamW steps of ``micro`` micro-steps each, accumulated as ``mode`` says: "no_sync"
    (sync off until the last), "rs_only" (reduce-scatter on every micro-step, the all-reduce on
    the last: ``set_requires_all_reduce``), "sync_every". Returns (the first step's full
    gradients, the gradient norms (``max_norm``: pyfused.clip_grad_norm_ clips), the full state
    dict after the last step)."""
    import pyfused

    model = _shard(H.build("mlp"), shard, mesh=mesh, mp_policy=_policy(bf16))
    opt = H.make_optimizer(model)
    per = ROWS // world
    first, norms = None, []
    for step in range(STEPS):
        for k in range(micro):
            last = k == micro - 1
            if mode == "no_sync":
                model.set_requires_gradient_sync(last)
            elif mode == "rs_only":
                model.set_requires_all_reduce(last)
            mine = H.rows_of(H.batch("mlp", step, k, ROWS), rank * per, (rank + 1) * per)
            (model.loss(mine) / micro).backward()
        if first is None:
            first = {n: p.grad.full_tensor().clone() for n, p in model.named_parameters()
                     if p.grad is not None}
        if max_norm is not None:
            norms.append(float(pyfused.clip_grad_norm_(model, max_norm)))
        opt.step()
        opt.zero_grad()
    return first, norms, {k: v.full_tensor() for k, v in model.state_dict().items()}


def _placements_are_hsdp(model, mesh) -> None:
    from torch.distributed.tensor import Replicate, Shard

    for name, p in model.named_parameters():
        assert p.device_mesh == mesh and p.placements == (Replicate(), Shard(0)), name


def _against_fsdp2(rank, world, shape, bf16=False, micro=1, mode="no_sync"):
    """pyfused's HSDP against torch FSDP2's, the same mesh and data: bit-identical when R and S
    are powers of two, else within the tolerances of the module docstring."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    import pyfused

    mesh = _mesh(shape)
    want_first, _, want = _train(rank, world, torch_fully_shard, mesh, bf16, micro, mode)
    first, _, got = _train(rank, world, pyfused.fully_shard, mesh, bf16, micro, mode)
    _placements_are_hsdp(_shard(H.build("mlp"), pyfused.fully_shard, mesh=mesh), mesh)
    assert sorted(first) == sorted(want_first), "the same parameters must have gradients"
    exact = all(n & (n - 1) == 0 for n in shape)
    for k, v in want_first.items():
        if exact:
            assert torch.equal(first[k], v), f"step-0 gradient of {k}"
        else:
            assert_close(first[k], v, name=f"step-0 gradient of {k}")
    for k, v in want.items():
        if exact:
            assert torch.equal(got[k], v), f"{k} after {STEPS} steps"
        else:
            assert_close(got[k], v, dtype=torch.float16, name=k)
    return True


@pytest.mark.parametrize("shape", [(2, 2), (2, 1), (1, 2), (3, 1)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_fp32_matches_fsdp2(ranks, shape):
    assert all(ranks.run(shape[0] * shape[1], _against_fsdp2, shape, timeout=TIMEOUT))


@pytest.mark.parametrize("mode", ["no_sync", "rs_only", "sync_every"])
def test_bf16_accumulation_matches_fsdp2(ranks, mode):
    # bf16 compute, fp32 reduction, 2 micro-steps a step, accumulated each of the three ways
    assert all(ranks.run(4, _against_fsdp2, (2, 2), True, 2, mode, timeout=TIMEOUT))


def _against_single_process(rank, world, shape, micro, max_norm=0.1):
    import pyfused

    first, norms, full = _train(rank, world, pyfused.fully_shard, _mesh(shape), micro=micro,
                                max_norm=max_norm)
    ref, ref_norms, ref_first = H.reference_training("mlp", STEPS, micro, ROWS, max_norm)
    assert all(n > max_norm for n in ref_norms), "the test must clip"
    assert sorted(first) == sorted(ref_first), "the same parameters must have gradients"
    for k, want in ref_first.items():
        assert_close(first[k], want, name=f"step-0 gradient of {k}")
    for k, want in ref.state_dict().items():  # the fp16 row: see tests/test_fsdp.py
        assert_close(full[k], want, dtype=torch.float16, name=k)
    assert_close(torch.tensor(norms), torch.tensor(ref_norms), name="grad norms")
    start = H.build("mlp").state_dict()
    for k in ("unused.weight", "frozen.weight", "frozen.bias"):  # no gradient: untouched
        assert torch.equal(full[k], start[k]), k
    return True


@pytest.mark.parametrize("shape,micro", [((2, 2), 1), ((2, 2), 2), ((3, 1), 1)],
                         ids=["2x2", "2x2-accumulate", "3x1"])
def test_matches_single_process(ranks, shape, micro):
    assert all(ranks.run(shape[0] * shape[1], _against_single_process, shape, micro,
                         timeout=TIMEOUT))


def _errors(rank, world):
    """Bad meshes and bad units: (message per case), each the same on every rank."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import pyfused
    from pyfused.comm import InputError

    def refused(fn):
        try:
            fn()
        except InputError as e:
            return str(e)
        return None

    mesh = _mesh((2, 2))
    cube = init_device_mesh("cpu", (2, 2, 1), mesh_dim_names=("a", "b", "c"))
    swapped = _mesh((2, 2), names=("dp_shard", "dp_replicate"))
    out = {
        "3-D": refused(lambda: pyfused.fully_shard(nn.Linear(4, 4), mesh=cube)),
        "swapped": refused(lambda: pyfused.fully_shard(nn.Linear(4, 4), mesh=swapped)),
        # rank 3 (the second replica's second shard) alone has another shape: the ranks of the
        # first replica, which share no group with it, raise the same error
        "shapes": refused(lambda: pyfused.fully_shard(
            nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 9 if rank == 3 else 8)), mesh=mesh)),
        "option": refused(lambda: pyfused.fully_shard(
            nn.Linear(4, 4), mesh=mesh, reshard_after_forward=2 if rank == 2 else True)),
    }
    dist.barrier()  # every group is still usable
    return out


def test_bad_meshes_and_units_same_error_everywhere(ranks):
    out = ranks.run(4, _errors, timeout=TIMEOUT)
    assert all(o == out[0] for o in out), out
    got = out[0]
    assert "1-D DeviceMesh" in got["3-D"] and "2-D DeviceMesh" in got["3-D"] and \
        "a 3-D DeviceMesh" in got["3-D"], got["3-D"]
    assert "('dp_shard', 'dp_replicate')" in got["swapped"] and \
        "(replicate, shard)" in got["swapped"], got["swapped"]
    assert "rank 3 has '1.weight' [9, 8]" in got["shapes"], got["shapes"]
    assert "on rank 2" in got["option"] and "reshard_after_forward" in got["option"], got["option"]


def _on_fake_hosts(rank, world):
    from tests import multihost_checks as C

    with C.fake_hosts(rank, 2):  # ranks 0, 1 on fake0; 2, 3 on fake1
        return C.hsdp_on_host_mesh(rank, world)


@pytest.mark.skipif(mt.unavailable_reason() is None,
                    reason="the namespace test bed is available: the same check runs there on real "
                           "hosts (tests/test_multihost_testbed.py::test_two_hosts_under_torchrun)")
def test_host_mesh_matches_fsdp2_and_transposed_warns(ranks):
    # where namespaces cannot be made, the same body on faked hosts
    out = ranks.run(4, _on_fake_hosts, timeout=TIMEOUT)
    for rank, o in enumerate(out):
        assert o["mesh"] == [2, 2] and o["warning"] is None, o
        shard = f"'fake0' (rank {rank % 2}), 'fake1' (rank {rank % 2 + 2})"
        assert "shards across hosts" in o["transposed"] and \
            f"shard group: {shard}" in o["transposed"] and "host_mesh()" in o["transposed"], o


def _memory_against_fsdp2(rank, world):
    """The buffers behind memory at HSDP 2x2, measured deterministically, as
    tests/test_fsdp_state.py measures FSDP's (a whole step's peak depends on when gloo's threads
    release buffers: the bench's ``peak_MB`` column): after one step of the same model, pyfused's
    parameter shards and sharded gradients take at most FSDP2's storage; gathering a unit holds the
    all-gather output (S x the unit's padded shard) and the gathered parameters, nothing else."""
    from pyfused.benchmarks import bench_fsdp

    mesh = _mesh((2, 2))
    shape = bench_fsdp.ModelShape(depth=3, width=37, batch=6)  # 37 rows: uneven over 2 shards
    gen = torch.Generator().manual_seed(rank)
    x, y = torch.randn(shape.batch, shape.width, generator=gen), torch.randn(shape.batch, 16)
    torch.manual_seed(0)
    base = bench_fsdp.Model(shape)
    storage = {}
    for name in ("torch-fsdp2", "pyfused"):
        model = bench_fsdp.sharded(name, base, mesh)
        bench_fsdp.step_fn(model, bench_fsdp.make_opt(model), x, y)()
        for what in ("params", "grads"):
            tensors = [p if what == "params" else p.grad for p in model.parameters()]
            storage[name, what] = sum({t._local_tensor.untyped_storage().data_ptr():
                                       t._local_tensor.untyped_storage().nbytes()
                                       for t in tensors}.values())
    for what in ("params", "grads"):
        assert storage["pyfused", what] <= storage["torch-fsdp2", what], (what, storage)

    group = model.blocks[1]._pyfused_fsdp.group
    growth = H.unshard_growth(model, model.blocks[1])
    assert group.world == 2 and group.replicas == 2
    assert growth == group.world * group.shard_numel * 4 + group.leaf_nbytes, growth
    return True


def test_memory_buffers_at_most_fsdp2(ranks):
    assert all(ranks.run(4, _memory_against_fsdp2, timeout=TIMEOUT))


def _trained(rank, world, mesh, seed):
    """The MLP sharded by pyfused on ``mesh`` (2-D: HSDP, 1-D: FSDP), one AdamW step taken."""
    import pyfused

    model = _shard(H.build("mlp", seed=seed), pyfused.fully_shard, mesh=mesh)
    opt = H.make_optimizer(model)
    per = ROWS // world
    model.loss(H.rows_of(H.batch("mlp", seed, 0, ROWS), rank * per, (rank + 1) * per)).backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def _full(state) -> dict:
    """A state dict (nested: the optimizer's) with every DTensor gathered."""
    from torch.distributed.tensor import DTensor

    if isinstance(state, dict):
        return {k: _full(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_full(v) for v in state]
    return state.full_tensor() if isinstance(state, DTensor) else state


def _dcp_round_trip(rank, world, folder):
    """Model and optimizer state (torch's get_state_dict) saved by DCP at HSDP 2x2, loaded at FSDP
    over 4 ranks and at HSDP 1x4, and saved at FSDP, loaded at HSDP: bit-exact."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    meshes = {"hsdp": _mesh((2, 2)), "fsdp": _mesh((4,), ("dp",)), "hsdp-1x4": _mesh((1, 4))}
    saved = {}
    for i, (src, dst) in enumerate((("hsdp", "fsdp"), ("hsdp", "hsdp-1x4"), ("fsdp", "hsdp"))):
        path = f"{folder}/{i}"
        model, opt = _trained(rank, world, meshes[src], seed=0)
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
        saved = _full({"model": msd, "optim": osd})
        model, opt = _trained(rank, world, meshes[dst], seed=1)
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=path)
        # strict=False: the never-used parameter has no optimizer state to load
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=StateDictOptions(strict=False))
        msd, osd = get_state_dict(model, opt)
        loaded = _full({"model": msd, "optim": osd})
        for k, v in saved["model"].items():
            assert torch.equal(loaded["model"][k], v), (src, dst, k)
        for name, st in saved["optim"]["state"].items():
            for k, v in st.items():
                assert torch.equal(loaded["optim"]["state"][name][k], v), (src, dst, name, k)
    return True


def test_dcp_round_trips_hsdp_fsdp(ranks, tmp_path):
    assert all(ranks.run(4, _dcp_round_trip, str(tmp_path), timeout=TIMEOUT))
