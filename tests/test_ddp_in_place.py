"""In-place gradient reduction of pyfused DistributedDataParallel on CPU.

A gradient of at least ``reducer.IN_PLACE_BYTES_CPU`` has a bucket of its own and is all-reduced
on ``.grad`` itself (pyfused/dp/reducer.py). The models of the DDP tests are far below 1 MiB, so
here every worker lowers the threshold to 0 -- every parameter alone, every collective on its
gradient -- and the same oracles as tests/test_ddp.py must hold: torch DDP and single-process
training on the full batch, gradient accumulation, the bucket rebuild, the error for a missing
gradient. The threshold itself (which buckets are in place by default) is checked in one process.
"""
import contextlib

import pytest
import torch

from pyfused.dp import buckets, reducer
from tests import test_ddp_helpers as H

TIMEOUT = 60
ERR_TIMEOUT = 30


@contextlib.contextmanager
def _every_gradient_in_place():
    old = reducer.IN_PLACE_BYTES_CPU
    reducer.IN_PLACE_BYTES_CPU = 0
    try:
        yield
    finally:
        reducer.IN_PLACE_BYTES_CPU = old


def _in_place(rank, world, fn, *args, **kwargs):
    """``fn`` on this rank with every gradient reduced in place (the pool's worker keeps no trace)."""
    with _every_gradient_in_place():
        return fn(rank, world, *args, **kwargs)


# ----------------------------------------------------------------------------- assignment

def _params(*numels):
    return [torch.empty(n) for n in numels]


def test_large_parameters_get_their_own_bucket_ordered_by_readiness():
    ps = _params(10, 1000, 20, 2000, 30)  # reversed: 4 3 2 1 0
    idx = buckets.assign(list(enumerate(ps)), cap_bytes=1 << 20, first_cap_bytes=1 << 20,
                         own_bytes=4000)
    # 3 and 1 (>= 4000 bytes) alone; the small ones 4, 2, 0 share one bucket, ready at the end
    assert idx == [[3], [1], [4, 2, 0]]
    # without in-place reduction: torch's assignment, one bucket in reverse order
    assert buckets.assign(list(enumerate(ps)), 1 << 20, 1 << 20) == [[4, 3, 2, 1, 0]]


def test_default_threshold_on_cpu():
    from pyfused.layers import DistributedDataParallel

    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 8))
    info = DistributedDataParallel(model).bucket_info()  # no process group: local training
    in_place = {n for b in info if b["in_place"] for n in b["params"]}
    assert in_place == {"0.weight"}, info  # 4 MiB; the rest share a copied bucket
    for options in (dict(find_unused_parameters=True), dict(gradient_as_bucket_view=True),
                    dict(comm_dtype=torch.bfloat16), dict(shard_optimizer=True)):
        info = DistributedDataParallel(model, **options).bucket_info()
        assert not any(b["in_place"] for b in info), (options, info)


# ----------------------------------------------------------------------------- training oracles

@pytest.mark.parametrize("kind,world", [("mlp", 1), ("mlp", 2), ("mlp", 3), ("lstm", 2)])
def test_matches_torch_ddp_and_full_batch(ranks, kind, world):
    ranks.run(world, _in_place, H.compare_training, kind, opt="adamw", steps=3, timeout=TIMEOUT)


@pytest.mark.parametrize("set_to_none", [True, False])
def test_no_sync_accumulation(ranks, set_to_none):
    ranks.run(3, _in_place, H.compare_training, "mlp", opt="sgd", steps=2, micro=3,
              set_to_none=set_to_none, timeout=TIMEOUT)


def test_rebuild_from_observed_order(ranks):
    ranks.run(2, _in_place, H.compare_training, "backwards", opt="adamw", steps=3, micro=2,
              timeout=TIMEOUT)


def _reduced_on_the_gradient(rank, world):
    """The collective runs on ``.grad`` itself: no bucket buffer, and a gradient kept between
    steps (``zero_grad(set_to_none=False)``) is the same storage after every backward."""
    from pyfused.layers import DistributedDataParallel

    m = DistributedDataParallel(H.build("mlp", 0))
    assert all(b["in_place"] for b in m.bucket_info())
    assert not any("comm_buf" in b.extra for b in m.reducer.buckets)
    H.loss_of("mlp", m, H.batch("mlp", 0, 0, rank)).backward()
    ptrs = [p.grad.data_ptr() for p in m.parameters()]
    m.zero_grad(set_to_none=False)
    H.loss_of("mlp", m, H.batch("mlp", 0, 1, rank)).backward()
    assert [p.grad.data_ptr() for p in m.parameters()] == ptrs
    return True


def test_collective_runs_on_the_gradient(ranks):
    assert all(ranks.run(2, _in_place, _reduced_on_the_gradient, timeout=TIMEOUT))


class _Transposed(torch.nn.Module):
    """A parameter stored transposed: its gradient is not contiguous (the copy fallback)."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(6, 5).t())
        self.b = torch.nn.Parameter(torch.randn(6))

    def forward(self, x):
        return x @ self.w + self.b


def _non_contiguous_gradient(rank, world):
    from pyfused.layers import DistributedDataParallel

    torch.manual_seed(0)
    model = _Transposed()
    ref = _Transposed()
    ref.load_state_dict(model.state_dict())
    m = DistributedDataParallel(model)
    xs = [torch.randn(4, 5, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    m(xs[rank]).square().sum().backward()
    assert not model.w.grad.is_contiguous()
    sum(ref(x).square().sum() for x in xs).backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad / world)
    return True


def test_non_contiguous_gradient_goes_through_a_copy(ranks):
    assert all(ranks.run(3, _in_place, _non_contiguous_gradient, timeout=TIMEOUT))


def _missing_gradient(rank, world):
    from pyfused.layers import DistributedDataParallel

    model = H.build("branchy", 5)
    model.never.requires_grad_(False)
    m = DistributedDataParallel(model)
    data = H.batch("branchy", 5, 0, rank)
    err = H.error_text(lambda: H.loss_of("branchy", m, data, use_b=rank != 1).backward())
    assert H.group_still_in_step(world)
    return err


def test_missing_gradient_is_an_error_on_every_rank(ranks):
    errs = ranks.run(3, _in_place, _missing_gradient, timeout=ERR_TIMEOUT)
    assert all(e["type"] == "InputError" for e in errs), errs
    assert len({e["msg"] for e in errs}) == 1, errs
    assert "'b.weight'" in errs[0]["msg"], errs
