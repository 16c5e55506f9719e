"""Sharded optimizer (ZeRO-1/2): the same training as unsharded torch DDP, 1/world of the state.

Buckets are made small (0.5-2 KB) so every model has several buckets and parameters that straddle
shard boundaries; world size 3 exercises padding (no bucket length is a multiple of 3 * 4 floats).
Grid cut for the 2-core box: optimizers x models run at one world size each, the MLP at 2, 3, 4.
"""
import pytest
import torch

from tests import test_ddp_helpers as H
from tests.utils import test_device as device_of_ranks

TIMEOUT = 60
SHARD = dict(shard_optimizer=True, bucket_cap_mb=0.002)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_sharded_matches_unsharded(ranks, world):
    ranks.run(world, H.compare_training, "mlp", opt="adamw_groups", steps=3, ours=SHARD,
              timeout=TIMEOUT)


@pytest.mark.parametrize("kind,opt,world", [
    ("cnn", "sgd", 3),          # BatchNorm buffers + momentum/nesterov/weight decay
    ("lstm", "adagrad", 3),
    ("gru", "rmsprop", 2),
])
def test_sharded_models_and_optimizers(ranks, kind, opt, world):
    ranks.run(world, H.compare_training, kind, opt=opt, steps=3, full=kind != "cnn",
              ours=dict(SHARD, bucket_cap_mb=0.0005), timeout=TIMEOUT)


def test_sharded_no_sync(ranks):
    ranks.run(3, H.compare_training, "mlp", opt="adamw", steps=2, micro=3, ours=SHARD,
              timeout=TIMEOUT)


def test_sharded_bf16_communication(ranks):
    ranks.run(3, H.compare_training, "mlp", opt="sgd", steps=3, full=False, tol=torch.bfloat16,
              ours=dict(SHARD, comm_dtype=torch.bfloat16), timeout=TIMEOUT)


def _state_bytes(rank, world):
    """Optimizer state per rank, sharded vs unsharded, on a model big enough (~40K parameters) that
    per-tensor scalars and padding are small next to Adam's two moments."""
    import torch.nn as nn

    from pyfused.dp import optimizer_state_bytes
    from pyfused.layers import DistributedDataParallel

    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(97, 211), nn.ReLU(), nn.Linear(211, 97), nn.ReLU(),
                             nn.Linear(97, 5)).to(device_of_ranks())

    out = {}
    for shard in (False, True):
        m = DistributedDataParallel(model(), shard_optimizer=shard, bucket_cap_mb=0.05)
        opt = m.wrap_optimizer(torch.optim.AdamW(m.parameters(), lr=1e-3))
        m(torch.randn(3, 97, device=device_of_ranks())).sum().backward()
        opt.step()
        out[shard] = optimizer_state_bytes(opt)
    numel = sum(p.numel() for p in model().parameters())
    assert out[False] >= 2 * 4 * numel  # exp_avg + exp_avg_sq in fp32
    return out


@pytest.mark.parametrize("world", [2, 3, 4])
def test_optimizer_state_is_one_world_th(ranks, world):
    sizes = ranks.run(world, _state_bytes, timeout=TIMEOUT)
    for s in sizes:
        assert s[True] <= 1.1 / world * s[False], (world, s)
    # the shards add up to the whole (plus padding and per-piece step counters)
    assert sum(s[True] for s in sizes) >= sizes[0][False] * 0.999


def _master_weights(rank, world):
    """bf16 parameters + fp32 master shards == a hand-written reference: torch DDP on the bf16 model,
    fp32 master copy, gradients cast to fp32, AdamW on the master, master cast back to bf16."""
    import copy

    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from pyfused.layers import DistributedDataParallel
    from tests.utils import assert_close

    local = H.build("mlp", 8).to(torch.bfloat16)
    ref = TorchDDP(copy.deepcopy(local))
    master = [p.detach().float().clone() for p in ref.parameters()]
    opt_ref = torch.optim.AdamW(master, lr=1e-2)
    mine = DistributedDataParallel(copy.deepcopy(local), **SHARD)
    opt = mine.wrap_optimizer(torch.optim.AdamW(mine.parameters(), lr=1e-2), master_dtype=torch.float32)
    assert all(t.dtype == torch.float32 for g in opt.param_groups for t in g["params"])
    for s in range(3):
        x, y = H.batch("mlp", 8, s, rank)
        for m in (ref, mine):
            m.zero_grad()
            torch.nn.functional.mse_loss(m(x.bfloat16()).float(), y).backward()
        for mp, p in zip(master, ref.parameters()):
            mp.grad = p.grad.float()
        opt_ref.step()
        with torch.no_grad():
            for mp, p in zip(master, ref.parameters()):
                p.copy_(mp)
        opt.step()
    mine.synchronize_params()
    for p, q in zip(ref.parameters(), mine.parameters()):
        assert q.dtype == torch.bfloat16
        assert_close(q, p, torch.bfloat16, "bf16 parameter with fp32 master shard")
    return True


def test_fp32_master_shards_for_bf16_model(ranks):
    assert all(ranks.run(3, _master_weights, timeout=TIMEOUT))


def _step_then_read(rank, world):
    """After a sharded step the parameters are in flight; state_dict() and the next forward must
    see the gathered values, and parameters are views of the flat buffers."""
    from pyfused.layers import DistributedDataParallel

    m = DistributedDataParallel(H.build("mlp", 2), **SHARD)
    opt = m.wrap_optimizer(torch.optim.SGD(m.parameters(), lr=0.5))
    before = {k: v.clone() for k, v in m.state_dict().items()}
    H.loss_of("mlp", m, H.batch("mlp", 2, 0, rank)).backward()
    assert all(p.grad is None for p in m.parameters()), "sharded mode keeps no full gradient"
    opt.step()
    after = m.state_dict()  # waits for the gathers
    assert all(not torch.equal(before[k], after[k]) for k in before), "some parameter did not move"
    gathered = [v.new_empty(world * v.numel()) for v in after.values()]
    for g, v in zip(gathered, after.values()):
        torch.distributed.all_gather_into_tensor(g, v.reshape(-1).contiguous())
        parts = g.view(world, -1)
        assert (parts == parts[0]).all(), "ranks disagree on a parameter after the gather"
    return True


def test_parameters_after_step_are_gathered(ranks):
    assert all(ranks.run(3, _step_then_read, timeout=TIMEOUT))


def _wrap_errors(rank, world, case):
    from pyfused.layers import DistributedDataParallel

    m = DistributedDataParallel(H.build("mlp", 0), **SHARD)
    if case == "adafactor":
        opt = torch.optim.Adafactor(m.parameters())
    elif case == "foreign":
        stranger = torch.nn.Parameter(torch.ones(2, device=device_of_ranks()))
        opt = torch.optim.SGD(list(m.parameters()) + [stranger], lr=0.1)
    elif case == "one-rank-lbfgs":
        params = m.parameters()
        opt = (torch.optim.LBFGS(params) if rank == 1 else torch.optim.SGD(params, lr=0.1))
    err = H.error_text(m.wrap_optimizer, opt)
    assert H.group_still_in_step(world)
    return err


@pytest.mark.parametrize("case,expect", [
    ("adafactor", "Adafactor updates a parameter from more than its own elements"),
    ("foreign", "not one of this module's parameters"),
    ("one-rank-lbfgs", "LBFGS updates a parameter from more than its own elements"),
])
def test_wrap_optimizer_errors_on_every_rank(ranks, case, expect):
    errs = ranks.run(2, _wrap_errors, case, timeout=30)
    assert all(e["type"] == "InputError" for e in errs), errs
    assert len({e["msg"] for e in errs}) == 1, errs
    assert expect in errs[0]["msg"], errs[0]["msg"]
    if case == "one-rank-lbfgs":
        assert errs[0]["msg"].endswith("(rank 1)"), errs[0]["msg"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_any_nonfinite_finds_one_bad_element_anywhere(dtype):
    from pyfused.dp.sharded import any_nonfinite

    cpu = torch.device("cpu")
    clean = [torch.randn(1000).to(dtype), torch.empty(0, dtype=dtype), torch.randn(7).to(dtype)]
    assert not any_nonfinite(clean, cpu) and not any_nonfinite([], cpu)
    for bad in (float("nan"), float("inf"), -float("inf")):
        for which, at in ((0, 0), (0, 517), (0, 999), (2, 6)):
            tensors = [t.clone() for t in clean]
            tensors[which][at] = bad
            assert any_nonfinite(tensors, cpu), (bad, which, at)


def _fp16_scaler(rank, world, plain):
    """fp16 autocast + loss scaling: sharded pyfused == torch DDP with GradScaler, including a step
    where an overflow lands in one rank's shard only (every rank must skip that step, so found_inf
    has to be agreed across the group). With FSDP's ShardedGradScaler the scaler agrees; with torch's
    plain GradScaler (``plain``) pyfused's own non-finite agreement after backward must, or the
    ranks disagree on skipping the step and the parameter all-gather hangs."""
    import copy

    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from pyfused.layers import DistributedDataParallel
    from tests.utils import assert_close

    base = H.build("mlp", 9)
    ref = TorchDDP(copy.deepcopy(base))
    mine = DistributedDataParallel(copy.deepcopy(base), **SHARD)
    opts = [torch.optim.AdamW(ref.parameters(), lr=1e-2),
            mine.wrap_optimizer(torch.optim.AdamW(mine.parameters(), lr=1e-2))]
    dev = device_of_ranks().type
    mine_scaler = (torch.amp.GradScaler(dev, init_scale=1024.0) if plain else
                   ShardedGradScaler(dev, init_scale=1024.0, process_group=torch.distributed.group.WORLD))
    scalers = [torch.amp.GradScaler(dev, init_scale=1024.0), mine_scaler]
    for s in range(4):
        x, y = H.batch("mlp", 9, s, rank)
        for m, opt, scaler in zip((ref, mine), opts, scalers):
            opt.zero_grad()
            with torch.autocast(dev, dtype=torch.float16):
                out = m(x)
            loss = torch.nn.functional.mse_loss(out.float(), y)
            if s == 2 and rank == 1:  # overflows one element of fc3.bias's gradient only
                loss = loss + 1e38 * m.module.fc3.bias[0]
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        assert scalers[0].get_scale() == scalers[1].get_scale(), s
    assert scalers[0].get_scale() < 1024.0  # the overflow step was skipped
    mine.synchronize_params()
    for (n, p), q in zip(ref.named_parameters(), mine.parameters()):
        assert_close(q, p, torch.float32, f"fp16-scaled parameter {n}")
    return True


def test_fp16_grad_scaler_sharded(ranks):
    assert all(ranks.run(2, _fp16_scaler, False, timeout=TIMEOUT))


@pytest.mark.parametrize("world", [2, 3])
def test_fp16_plain_grad_scaler_sharded_does_not_hang(ranks, world):
    assert all(ranks.run(world, _fp16_scaler, True, timeout=TIMEOUT))
