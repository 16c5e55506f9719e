"""pyfused DistributedDataParallel == torch DDP == single-process training on the full batch.

Each test trains on gloo ranks and compares every parameter (and buffer) after a few optimizer
steps; fp32 uses the suite's fp32 tolerance (in practice the results agree to ~1e-7: only the
summation order of the all-reduce differs). Grid cut for the 2-core CI box: every model runs at
two or three world sizes, the MLP at all of 1-4; the option variants run on the MLP at one or two
world sizes (they change the reducer, not the model).
"""
import contextlib

import pytest
import torch

from tests import test_ddp_helpers as H

TIMEOUT = 60
ERR_TIMEOUT = 30  # error paths: a hang shows up as a timeout quickly


@pytest.mark.parametrize("kind,world", [
    ("mlp", 1), ("mlp", 2), ("mlp", 3), ("mlp", 4),
    ("cnn_gn", 2), ("cnn_gn", 3),
    ("lstm", 2), ("lstm", 3), ("gru", 2),
])
def test_matches_torch_ddp_and_full_batch(ranks, kind, world):
    ranks.run(world, H.compare_training, kind, opt="adamw", steps=3,
              ours=dict(bucket_cap_mb=0.002), timeout=TIMEOUT)


@pytest.mark.parametrize("world", [2, 3])
def test_batchnorm_buffers_match_torch_ddp(ranks, world):
    # BatchNorm's batch statistics are per rank, so only torch DDP (same broadcast_buffers rules)
    # is the reference here, not the full batch.
    ranks.run(world, H.compare_training, "cnn", opt="sgd", steps=3, full=False, timeout=TIMEOUT)


@pytest.mark.parametrize("world", [2, 3])
def test_no_sync_accumulation(ranks, world):
    ranks.run(world, H.compare_training, "mlp", opt="sgd", steps=2, micro=3,
              ours=dict(bucket_cap_mb=0.002), timeout=TIMEOUT)


def test_no_sync_recurrent(ranks):
    ranks.run(2, H.compare_training, "lstm", opt="adamw", steps=2, micro=2, timeout=TIMEOUT)


@pytest.mark.parametrize("set_to_none", [True, False])
def test_gradient_as_bucket_view(ranks, set_to_none):
    ranks.run(3, H.compare_training, "mlp", opt="adamw", steps=3, micro=2, set_to_none=set_to_none,
              ours=dict(gradient_as_bucket_view=True, bucket_cap_mb=0.002),
              theirs=dict(gradient_as_bucket_view=True), timeout=TIMEOUT)
    ranks.run(2, _grads_are_bucket_views, timeout=TIMEOUT)


def _grads_are_bucket_views(rank, world):
    from pyfused.layers import DistributedDataParallel

    m = DistributedDataParallel(H.build("mlp", 0), gradient_as_bucket_view=True)
    for _ in range(2):
        H.loss_of("mlp", m, H.batch("mlp", 0, 0, rank)).backward()
    bufs = [b.extra["grad_buf"] for b in m.reducer.buckets]
    for p in m.parameters():
        assert any(buf.untyped_storage().data_ptr() == p.grad.untyped_storage().data_ptr()
                   for buf in bufs), "a gradient does not live in its bucket"


def test_bf16_communication(ranks):
    """comm_dtype=bf16 == torch DDP with its bf16 compression hook (to bf16 rounding), and the
    gradients stay fp32."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook

    ranks.run(2, H.compare_training, "mlp", opt="sgd", steps=3, full=False, tol=torch.bfloat16,
              ours=dict(comm_dtype=torch.bfloat16), theirs=dict(comm_hook=bf16_compress_hook),
              timeout=TIMEOUT)
    ranks.run(3, _bf16_grads_close_to_fp32_average, timeout=TIMEOUT)


def _bf16_grads_close_to_fp32_average(rank, world):
    from pyfused.layers import DistributedDataParallel
    from tests.utils import assert_close

    exact = DistributedDataParallel(H.build("mlp", 3), bucket_cap_mb=0.002)
    low = DistributedDataParallel(H.build("mlp", 3), bucket_cap_mb=0.002, comm_dtype=torch.bfloat16)
    for m in (exact, low):
        H.loss_of("mlp", m, H.batch("mlp", 3, 0, rank)).backward()
    for p, q in zip(exact.parameters(), low.parameters()):
        assert q.grad.dtype == torch.float32
        assert_close(q.grad, p.grad, torch.bfloat16, "bf16-reduced gradient")
        # the reduction really ran in bf16: every averaged value is a bf16 number
        assert torch.equal(q.grad, q.grad.bfloat16().float())
    assert any(not torch.equal(p.grad, q.grad) for p, q in zip(exact.parameters(), low.parameters()))


@pytest.mark.parametrize("shard", [False, True], ids=["replicated", "sharded"])
def test_autocast_bf16_matches_torch_ddp(ranks, shard):
    """fp32 master weights, bf16 compute via torch.autocast: the same numbers as torch DDP under
    the same autocast (both reduce the fp32 gradients autocast produces)."""
    ranks.run(2, H.compare_training, "cnn_gn", opt="adamw", steps=3, full=False,
              autocast=torch.bfloat16, ours=dict(shard_optimizer=shard), timeout=TIMEOUT)


def _launch_timeline(rank, world, shard):
    """Buckets start reducing during backward, in order, as soon as their gradients are ready."""
    from pyfused.layers import DistributedDataParallel

    m = DistributedDataParallel(H.build("mlp", 0), bucket_cap_mb=0.0001, shard_optimizer=shard)
    red = m.reducer
    seen = []
    red.on_bucket_launched = lambda b: seen.append((b.index, sum(red.ready), red.in_backward))
    H.loss_of("mlp", m, H.batch("mlp", 0, 0, rank)).backward()
    n = len(red.params)
    assert [i for i, _, _ in seen] == list(range(len(red.buckets))) and len(seen) > 2, seen
    # the first bucket (the last layer's bias) went out while most gradients were still to come
    assert seen[0][1] <= 2 and seen[0][2], seen
    assert seen[-1][1] == n
    return True


@pytest.mark.parametrize("shard", [False, True], ids=["allreduce", "reduce-scatter"])
def test_buckets_launch_during_backward_in_order(ranks, shard):
    assert all(ranks.run(2, _launch_timeline, shard, timeout=TIMEOUT))


def _rebuilt_from_observed_order(rank, world, as_view):
    """Layers registered last-used first: the initial buckets (reverse registration) start with the
    gradients backward produces last. After the first backward the buckets follow the observed order
    (rank 0's, the same on every rank): bucket 0 holds fc3's gradients and goes out first, early."""
    from pyfused.layers import DistributedDataParallel

    m = DistributedDataParallel(H.build("backwards", 0), bucket_cap_mb=0.0001,
                                gradient_as_bucket_view=as_view)
    first = m.bucket_info()[0]["params"]
    assert all(n.startswith("fc1.") for n in first), first
    H.loss_of("backwards", m, H.batch("backwards", 0, 0, rank)).backward()
    info = m.bucket_info()
    assert all(n.startswith("fc3.") for n in info[0]["params"]), info
    assert all(n.startswith("fc1.") for n in info[-1]["params"]), info
    red = m.reducer
    seen = []
    red.on_bucket_launched = lambda b: seen.append((b.index, sum(red.ready)))
    H.loss_of("backwards", m, H.batch("backwards", 0, 1, rank)).backward()
    assert [i for i, _ in seen] == list(range(len(red.buckets))) and seen[0][1] <= 2, seen
    if as_view:  # the gradients moved into the new buckets
        bufs = [b.extra["grad_buf"] for b in red.buckets]
        for p in m.parameters():
            assert any(buf.untyped_storage().data_ptr() == p.grad.untyped_storage().data_ptr()
                       for buf in bufs), "a gradient does not live in its (rebuilt) bucket"
    return [b["params"] for b in info]


@pytest.mark.parametrize("as_view", [False, True], ids=["copy", "bucket_view"])
def test_buckets_rebuilt_from_the_observed_gradient_order(ranks, as_view):
    orders = ranks.run(2, _rebuilt_from_observed_order, as_view, timeout=TIMEOUT)
    assert orders[0] == orders[1]
    # and training through the rebuild equals torch DDP (which rebuilds too) and the full batch
    ranks.run(3, H.compare_training, "backwards", opt="adamw", steps=3, micro=2,
              ours=dict(bucket_cap_mb=0.0001, gradient_as_bucket_view=as_view),
              theirs=dict(gradient_as_bucket_view=as_view), timeout=TIMEOUT)

# ----------------------------------------------------------------------------- unused parameters

def _unused_matches_torch(rank, world, shard):
    """``b`` is used on rank 0 only (locally unused elsewhere), ``never`` on no rank."""
    import copy

    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from pyfused.layers import DistributedDataParallel
    from tests.utils import assert_close

    local = H.build("branchy", 5)
    ref = TorchDDP(copy.deepcopy(local), find_unused_parameters=True)
    mine = DistributedDataParallel(copy.deepcopy(local), find_unused_parameters=True,
                                   bucket_cap_mb=0.0005, shard_optimizer=shard)
    opt_ref = H.make_opt("sgd", ref.parameters())
    opt_mine = mine.wrap_optimizer(H.make_opt("sgd", mine.parameters()))
    for s in range(3):
        data = [H.batch("branchy", 5, s, rank)]
        fwd = dict(use_b=(rank == 0) or s == 2)  # step 2: b used everywhere
        H.train_step("branchy", ref, opt_ref, data, ddp=True, fwd=fwd)
        H.train_step("branchy", mine, opt_mine, data, ddp=True, fwd=fwd)
        if not shard:
            for (n, p), q in zip(ref.module.named_parameters(), mine.module.parameters()):
                assert (p.grad is None) == (q.grad is None), f"step {s}: {n}.grad None-ness differs"
                if p.grad is not None:
                    assert_close(q.grad, p.grad, torch.float32, f"step {s} grad {n}")
    mine.synchronize_params()
    assert mine.module.never.weight.grad is None  # unused on every rank: .grad untouched
    for (n, p), q in zip(ref.module.named_parameters(), mine.module.parameters()):
        assert_close(q, p, torch.float32, f"parameter {n}")
    return True


@pytest.mark.parametrize("shard", [False, True], ids=["replicated", "sharded"])
def test_find_unused_parameters(ranks, shard):
    assert all(ranks.run(3, _unused_matches_torch, shard, timeout=TIMEOUT))


def _unused_only_inside_no_sync(rank, world):
    """Rank 1 uses ``b`` only in the micro-batch inside no_sync, rank 0 never: ``b`` still counts as
    used (torch's rule), so its accumulated gradient must be averaged, not left local."""
    import copy

    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from pyfused.layers import DistributedDataParallel
    from tests.utils import assert_close

    local = H.build("branchy", 6)
    models = [TorchDDP(copy.deepcopy(local), find_unused_parameters=True),
              DistributedDataParallel(copy.deepcopy(local), find_unused_parameters=True)]
    for m in models:
        for k in range(2):
            data = H.batch("branchy", 6, 0, rank, k)
            ctx = m.no_sync() if k == 0 else contextlib.nullcontext()
            with ctx:
                H.loss_of("branchy", m, data, use_b=(rank == 1 and k == 0)).backward()
    ref, mine = models
    for (n, p), q in zip(ref.module.named_parameters(), mine.module.parameters()):
        assert (p.grad is None) == (q.grad is None), n
        if p.grad is not None:
            assert_close(q.grad, p.grad, torch.float32, f"grad {n}")
    assert mine.module.b.weight.grad is not None
    g = mine.module.b.weight.grad.clone()
    torch.distributed.all_reduce(g, op=torch.distributed.ReduceOp.MAX)
    assert torch.equal(g, mine.module.b.weight.grad), "ranks hold different gradients for b"
    return True


def test_used_only_inside_no_sync_counts_as_used(ranks):
    assert all(ranks.run(2, _unused_only_inside_no_sync, timeout=TIMEOUT))


def _unused_without_find_unused(rank, world, who_skips):
    from pyfused.layers import DistributedDataParallel

    model = H.build("branchy", 5)
    model.never.requires_grad_(False)  # only ``b`` can miss its gradient
    m = DistributedDataParallel(model)
    data = H.batch("branchy", 5, 0, rank)
    use_b = rank not in who_skips
    err = H.error_text(lambda: H.loss_of("branchy", m, data, use_b=use_b).backward())
    # the group is still in step, and the next iteration works when every parameter gets a gradient
    assert H.group_still_in_step(world)
    m.zero_grad()
    H.loss_of("branchy", m, data, use_b=True).backward()
    return err


@pytest.mark.parametrize("who_skips", [(1,), (0, 1, 2)], ids=["one-rank", "all-ranks"])
def test_unused_parameter_is_an_error_on_every_rank(ranks, who_skips):
    errs = ranks.run(3, _unused_without_find_unused, who_skips, timeout=ERR_TIMEOUT)
    assert all(e["type"] == "InputError" for e in errs), errs
    assert len({e["msg"] for e in errs}) == 1, f"ranks raised different messages: {errs}"
    msg = errs[0]["msg"]
    assert "'b.weight'" in msg and "'b.bias'" in msg and "find_unused_parameters=True" in msg, msg
    assert f"rank(s) {list(who_skips)}" in msg, msg
    assert "'a.weight'" not in msg, msg


class _ReentrantTwice(torch.nn.Module):
    """``a`` and ``b`` are used inside a reentrant checkpoint and again outside it, so their
    gradients are accumulated twice in one backward (torch DDP refuses this too)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        h = checkpoint(lambda t: self.a(torch.relu(self.b(t))), x, use_reentrant=True)
        return self.a(h) + self.b(h)


def _gradient_twice(rank, world):
    from pyfused.layers import DistributedDataParallel
    from tests.utils import test_device as device_of_ranks

    torch.manual_seed(0)
    m = DistributedDataParallel(_ReentrantTwice().to(device_of_ranks()), bucket_cap_mb=0.00001)
    x = torch.randn(3, 4, device=device_of_ranks(), requires_grad=True)
    err = H.error_text(lambda: m(x).sum().backward())
    assert H.group_still_in_step(world)
    return err


def test_gradient_arriving_twice_is_an_error(ranks):
    errs = ranks.run(2, _gradient_twice, timeout=ERR_TIMEOUT)
    assert all(e["type"] == "InputError" and "twice" in e["msg"] for e in errs), errs


# ----------------------------------------------------------------------------- construction errors

def _build_mismatched(rank, world, variant):
    import torch.nn as nn

    from pyfused.layers import DistributedDataParallel
    from tests.utils import test_device as device_of_ranks

    model = H.build("mlp", 0)
    opts = {}
    if rank == world - 1:
        if variant == "shape":
            model.fc2 = nn.Linear(37, 30).to(device_of_ranks())
            model.fc3 = nn.Linear(30, 5).to(device_of_ranks())
        elif variant == "count":
            model.extra = nn.Linear(5, 5).to(device_of_ranks())
        elif variant == "option":
            opts = dict(bucket_cap_mb=1)
        elif variant == "dtype":
            model.fc1.double()
    err = H.error_text(DistributedDataParallel, model, **opts)
    assert H.group_still_in_step(world)
    return err


@pytest.mark.parametrize("variant,expect", [
    ("shape", ["rank 0 has parameter 'fc2.weight' [29, 37] float32",
               "rank 2 has parameter 'fc2.weight' [30, 37] float32"]),
    ("count", ["rank 0 has no such entry", "rank 2 has parameter 'extra.weight' [5, 5]"]),
    ("option", ["the option bucket_cap_bytes differs between ranks"]),
    ("dtype", ["rank 2 has parameter 'fc1.weight' [37, 13] float64"]),
])
def test_mismatched_model_errors_on_every_rank(ranks, variant, expect):
    errs = ranks.run(3, _build_mismatched, variant, timeout=ERR_TIMEOUT)
    assert all(e["type"] == "InputError" for e in errs), errs
    assert len({e["msg"] for e in errs}) == 1, f"ranks raised different messages: {errs}"
    for part in expect:
        assert part in errs[0]["msg"], errs[0]["msg"]


@pytest.mark.parametrize("shard", [False, True], ids=["replicated", "sharded"])
def test_without_process_group_is_local_training(shard):
    """No torch.distributed group: a group of one, identical to plain training."""
    import copy

    from pyfused.layers import DistributedDataParallel
    from tests.utils import assert_close

    plain = H.build("mlp", 4)
    wrapped = DistributedDataParallel(copy.deepcopy(plain), bucket_cap_mb=0.001,
                                      shard_optimizer=shard)
    opts = [H.make_opt("adamw", plain.parameters()),
            wrapped.wrap_optimizer(H.make_opt("adamw", wrapped.parameters()))]
    for s in range(2):
        data = [H.batch("mlp", 4, s, 0)]
        H.train_step("mlp", plain, opts[0], data, ddp=False)
        H.train_step("mlp", wrapped, opts[1], data, ddp=True)
    for p, q in zip(plain.parameters(), wrapped.module.parameters()):
        assert_close(q, p, torch.float32, "local DDP parameter")
    assert list(wrapped.state_dict()) == ["module." + k for k in plain.state_dict()]
