"""pyfused.clip_grad_norm_ == torch.nn.utils.clip_grad_norm_ on the full model, sharded or not.

The reference is torch DDP + torch's clip on every rank (its gradients are the full averaged
gradients); ours clips a pyfused DDP, whose sharded gradients live 1/world per rank. max_norm is
small enough that every step clips (checked), so the coefficient matters.
"""
import math

import pytest
import torch

from tests import test_ddp_helpers as H

TIMEOUT = 60
MAX_NORM = 0.05


@pytest.mark.parametrize("shard", [False, True], ids=["replicated", "sharded"])
@pytest.mark.parametrize("norm_type", [2.0, math.inf, 1.0], ids=["l2", "inf", "l1"])
def test_clip_matches_torch(ranks, shard, norm_type):
    # world 3 only (padding + pieces on every rank); the other sizes run the same code paths in
    # tests/test_ddp_sharded.py
    norms = ranks.run(3, H.compare_training, "mlp", opt="adamw", steps=3, clip=(MAX_NORM, norm_type),
                      ours=dict(shard_optimizer=shard, bucket_cap_mb=0.002), timeout=TIMEOUT)
    for per_rank in norms:
        assert all(ref > MAX_NORM for ref, _ in per_rank), f"no clipping happened: {per_rank}"


def test_clip_params_list_sharded_recurrent(ranks):
    """Parameters given as a list (not the module) still find their shards; LSTM, world 2."""
    norms = ranks.run(2, H.compare_training, "lstm", opt="sgd", steps=2,
                      clip=(MAX_NORM, 2.0, True), ours=dict(shard_optimizer=True,
                                                            bucket_cap_mb=0.0005), timeout=TIMEOUT)
    assert all(ref > MAX_NORM for per_rank in norms for ref, _ in per_rank)


def _nonfinite(rank, world):
    import pyfused
    from pyfused.layers import DistributedDataParallel

    m = DistributedDataParallel(H.build("mlp", 0), shard_optimizer=True, bucket_cap_mb=0.002)
    m.wrap_optimizer(torch.optim.SGD(m.parameters(), lr=0.1))
    H.loss_of("mlp", m, H.batch("mlp", 0, 0, rank)).backward()
    if rank == 1:  # only one rank's shard holds the inf: every rank must see it
        m._sharded.shard_grads()[0].view(-1)[0] = math.inf
    err = H.error_text(pyfused.clip_grad_norm_, m, 1.0, error_if_nonfinite=True)
    total = pyfused.clip_grad_norm_(m, 1.0)
    return err, float(total)


def test_nonfinite_norm_raises_on_every_rank(ranks):
    out = ranks.run(2, _nonfinite, timeout=TIMEOUT)
    assert all(err["type"] == "RuntimeError" and "non-finite" in err["msg"] for err, _ in out), out
    assert all(math.isinf(total) for _, total in out)


@pytest.mark.parametrize("norm_type", [2.0, math.inf, 0.5])
def test_single_process_is_torch(norm_type):
    import pyfused

    mods = [H.build("mlp", 1), H.build("mlp", 1)]
    for m in mods:
        H.loss_of("mlp", m, H.batch("mlp", 1, 0, 0)).backward()
    a = torch.nn.utils.clip_grad_norm_(mods[0].parameters(), 0.01, norm_type)
    b = pyfused.clip_grad_norm_(mods[1], 0.01, norm_type)
    assert torch.equal(a, b)
    for p, q in zip(mods[0].parameters(), mods[1].parameters()):
        assert torch.equal(p.grad, q.grad)
