"""``pyfused.fully_shard``: state dicts, cross-rank checks, memory, mixed precision."""
import pytest
import torch
import torch.nn as nn

from tests import test_fsdp_helpers as H
from tests.utils import assert_close

TIMEOUT = 300  # a hang guard; the first run in a pool pays the DTensor and transformers imports


def _shard(model, **kwargs):
    import pyfused

    for unit in model.units():
        pyfused.fully_shard(unit, **kwargs)
    pyfused.fully_shard(model, **kwargs)
    return model


def _state_dict_round_trip(rank, world, folder):
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )

    original = H.build("llama").state_dict()
    model = _shard(H.build("llama"))
    local = model.state_dict()
    full = {k: v.full_tensor() for k, v in local.items()}
    assert sorted(full) == sorted(original)
    for k, v in original.items():
        assert torch.equal(full[k], v), k  # bit-exact
    opts = StateDictOptions(full_state_dict=True)
    for k, v in get_model_state_dict(model, options=opts).items():
        assert torch.equal(v, original[k]), k
    other = H.build("llama", seed=1).state_dict()
    set_model_state_dict(model, dict(other), options=opts)  # it replaces the dict's values
    for k, v in model.state_dict().items():
        assert torch.equal(v.full_tensor(), other[k]), k
    # DCP: save the sharded state, load it into a model sharded from other weights
    import torch.distributed.checkpoint as dcp

    dcp.save(model.state_dict(), checkpoint_id=folder)
    fresh = _shard(H.build("llama", seed=2))
    state = fresh.state_dict()
    dcp.load(state, checkpoint_id=folder)
    fresh.load_state_dict(state)
    for k, v in fresh.state_dict().items():
        assert torch.equal(v.full_tensor(), other[k]), k
    return True


@pytest.mark.parametrize("world", [1, 3])
def test_full_state_dict_bit_exact(ranks, world, tmp_path):
    assert all(ranks.run(world, _state_dict_round_trip, str(tmp_path / "ckpt"), timeout=TIMEOUT))


def _mismatched(rank, world):
    import torch.distributed as dist

    import pyfused
    from pyfused.comm import InputError

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 9 if rank == 1 else 8))
    try:
        pyfused.fully_shard(model)
    except InputError as e:
        message = str(e)
    else:
        message = None
    dist.barrier()  # the group is still usable
    return message


def _bad_option(rank, world):
    import pyfused
    from pyfused.comm import InputError

    try:  # only rank 1 passes a bad value: every rank must still raise, none may hang
        pyfused.fully_shard(nn.Linear(4, 4), reshard_after_forward=2 if rank == 1 else True)
    except InputError as e:
        return str(e)
    return None


def test_bad_option_same_error_everywhere(ranks):
    messages = ranks.run(3, _bad_option, timeout=TIMEOUT)
    assert messages[0] is not None and len(set(messages)) == 1, messages
    assert "on rank 1" in messages[0] and "reshard_after_forward" in messages[0], messages[0]


def test_mismatched_shapes_same_error_everywhere(ranks):
    messages = ranks.run(3, _mismatched, timeout=TIMEOUT)
    assert messages[0] is not None and len(set(messages)) == 1, messages
    assert "'1.weight'" in messages[0] and "[9, 8]" in messages[0], messages[0]


def _memory(rank, world, reshard_after_forward):
    from pyfused.fsdp.group import UNSHARDED

    model = _shard(H.build("mlp"), reshard_after_forward=reshard_after_forward)
    opt = H.make_optimizer(model)
    full = H.build("mlp")
    replicated = sum(p.numel() * 4 for p in full.parameters())
    block = max(sum(p.numel() * 4 for p in b.parameters()) for b in full.blocks)
    in_blocks = {id(p) for b in full.blocks for p in b.parameters()}
    root = sum(p.numel() * 4 for p in full.parameters() if id(p) not in in_blocks)
    pad = sum(p[0].numel() * 4 for p in full.parameters())  # at most one row per parameter
    units = [model._pyfused_fsdp] + [b._pyfused_fsdp for b in model.blocks]
    per = 12 // world
    x, y = H.rows_of(H.batch("mlp", 0, 0, 12), rank * per, (rank + 1) * per)
    loss = nn.functional.mse_loss(model(x), y)
    after_forward = [u.group.state == UNSHARDED for u in units[1:]]
    loss.backward()
    opt.step()

    def local_bytes(tensors):  # each storage once (a unit's gradients share one buffer)
        storages = {}
        for t in tensors:
            if t is not None:
                st = t._local_tensor.untyped_storage()
                storages[st.data_ptr()] = st.nbytes()
        return sum(storages.values())

    shards = local_bytes(model.parameters())
    grads = local_bytes(p.grad for p in model.parameters())
    state = local_bytes(v for s in opt.state.values() for v in s.values() if v.dim() > 0)
    bound = (replicated + world * pad) / world  # 1/W of replicated + one padding row per parameter
    assert shards <= bound, (shards, bound)
    assert grads <= bound and state <= 2 * shards, (grads, state, shards, bound)
    peak = model.gathered_bytes_peak()
    gathers = [u.group.gathers for u in units[1:]]
    if reshard_after_forward:
        assert not any(after_forward), "blocks must be freed after forward"
        assert gathers == [2] * len(gathers), gathers  # gathered again for backward
        assert root + block <= peak <= root + 2 * block, (peak, root, block)
    else:
        assert all(after_forward) and gathers == [1] * len(gathers), gathers
        assert peak == replicated, (peak, replicated)
    assert all(u.group.state != UNSHARDED for u in units), "resharded after backward"
    return True


@pytest.mark.parametrize("world,reshard", [(2, True), (4, True), (3, False)])
def test_memory_per_rank(ranks, world, reshard):
    assert all(ranks.run(world, _memory, reshard, timeout=TIMEOUT))


def _buffers_against_fsdp2(rank, world):
    """The buffers behind FSDP2-level memory, measured deterministically (a whole step's peak also
    depends on when gloo's threads release buffers, in torch's FSDP2 as well, so it is a benchmark
    column): the sharded gradients' storage, the same model trained one step by pyfused and by torch
    FSDP2 in the same process group, is at most FSDP2's; and gathering a unit holds its all-gather
    output and its gathered parameters, no separate all-gather input (torch's MemTracker)."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from pyfused.benchmarks import bench_fsdp
    from pyfused.fsdp import fully_shard

    shape = bench_fsdp.ModelShape(depth=3, width=37, batch=6)  # 37 rows: uneven at world 3
    gen = torch.Generator().manual_seed(rank)
    x, y = torch.randn(shape.batch, shape.width, generator=gen), torch.randn(shape.batch, 16)
    grads = {}
    for name, shard in (("torch", torch_fully_shard), ("pyfused", fully_shard)):
        torch.manual_seed(0)
        model = bench_fsdp.Model(shape)
        for block in model.blocks:
            shard(block)
        shard(model)
        bench_fsdp.step_fn(model, bench_fsdp.make_opt(model), x, y)()
        storages = {p.grad._local_tensor.untyped_storage().data_ptr():
                    p.grad._local_tensor.untyped_storage().nbytes() for p in model.parameters()}
        grads[name] = sum(storages.values())
    assert grads["pyfused"] <= grads["torch"], ("gradient storage", grads)

    group = model.blocks[1]._pyfused_fsdp.group
    growth = H.unshard_growth(model, model.blocks[1])
    all_gather_output = world * group.shard_numel * 4
    assert growth == all_gather_output + group.leaf_nbytes, (growth, group.leaf_nbytes)
    return True


@pytest.mark.parametrize("world", [2, 3])
def test_memory_buffers_at_most_fsdp2(ranks, world):
    assert all(ranks.run(world, _buffers_against_fsdp2, timeout=TIMEOUT))


def _mixed_precision(rank, world, param_dtype, reduce_dtype):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    compute = param_dtype or torch.float32
    model = _shard(H.build("mlp"), mp_policy=policy)
    seen = []
    model.blocks[0].fc.register_forward_hook(lambda m, i, o: seen.append((m.weight.dtype, o.dtype)))
    per = 12 // world
    model.loss(H.rows_of(H.batch("mlp", 0, 0, 12), rank * per, (rank + 1) * per)).backward()
    assert seen == [(compute, compute)], seen
    ref = H.build("mlp")
    ref.loss(H.batch("mlp", 0, 0, 12)).backward()
    for name, p in model.named_parameters():
        assert p.dtype == torch.float32, name  # fp32 master shards
        want = dict(ref.named_parameters())[name].grad
        if want is None:
            assert p.grad is None, name
            continue
        assert p.grad.dtype == torch.float32
        assert_close(p.grad.full_tensor(), want, dtype=torch.bfloat16, name=name)
    return True


# the 1/W scaling: after widening to fp32, in the copy within bf16, in the copy before narrowing
@pytest.mark.parametrize("param_dtype,reduce_dtype,world", [
    (torch.bfloat16, torch.float32, 2), (torch.bfloat16, None, 3), (None, torch.bfloat16, 3)])
def test_mixed_precision(ranks, param_dtype, reduce_dtype, world):
    assert all(ranks.run(world, _mixed_precision, param_dtype, reduce_dtype, timeout=TIMEOUT))


class _Branches(nn.Module):
    """``b`` is used on rank 0 only, ``c`` on no rank."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(5, 7)
        self.b = nn.Linear(7, 7)
        self.c = nn.Linear(7, 3)

    def forward(self, x, use_b):
        h = self.a(x)
        return (self.b(h) if use_b else h).sum()


def _partly_used(rank, world):
    import pyfused

    torch.manual_seed(0)
    model = pyfused.fully_shard(_Branches())
    torch.manual_seed(0)
    ref = _Branches()
    x = torch.randn(world, 5)
    model(x[rank:rank + 1], rank == 0).backward()
    for r in range(world):  # the average over ranks of each rank's gradient (zeros where unused)
        (ref(x[r:r + 1], r == 0) / world).backward()
    assert model.c.weight.grad is None and model.c.bias.grad is None  # unused on every rank
    for name in ("a.weight", "a.bias", "b.weight", "b.bias"):
        got = dict(model.named_parameters())[name].grad.full_tensor()
        assert_close(got, dict(ref.named_parameters())[name].grad, name=name)
    return True


def test_parameter_used_on_some_ranks(ranks):
    assert all(ranks.run(3, _partly_used, timeout=TIMEOUT))
