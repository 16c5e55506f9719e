"""``pyfused.fully_shard``: training equals the single-process model; shards and state dicts.

Every rank builds the same model (same seed), shards it (each block a unit, then the root) and
trains on its rows of the same global batches; the reference trains the unsharded model on the
whole batch in the same process. Grid cut for the 2-core box: the MLP runs at world sizes 1-4 with
and without gradient accumulation; the GRU LM and Llama at 3 (uneven shards) and 2.
"""
import pytest
import torch

from tests import test_fsdp_helpers as H
from tests.utils import assert_close

TIMEOUT = 300  # a hang guard; the first run in a pool pays the DTensor and transformers imports
ROWS = 12  # global rows per micro-batch: divisible by 1, 2, 3 and 4


def _train(rank, world, name, micro, reshard_after_forward=True, steps=3, max_norm=0.1):
    import pyfused
    from pyfused.fsdp import no_sync

    model = H.build(name)
    for unit in model.units():
        pyfused.fully_shard(unit, reshard_after_forward=reshard_after_forward)
    pyfused.fully_shard(model)
    opt = H.make_optimizer(model)
    per = ROWS // world
    norms, first = [], None
    for step in range(steps):
        for k in range(micro):
            mine = H.rows_of(H.batch(name, step, k, ROWS), rank * per, (rank + 1) * per)
            ctx = no_sync(model) if k < micro - 1 else _nothing()
            with ctx:
                (model.loss(mine) / micro).backward()
        if first is None:
            first = {n: p.grad.full_tensor().clone() for n, p in model.named_parameters()
                     if p.grad is not None}
        norms.append(float(pyfused.clip_grad_norm_(model, max_norm)))
        opt.step()
        opt.zero_grad()
    full = {k: v.full_tensor() for k, v in model.state_dict().items()}
    ref, ref_norms, ref_first = H.reference_training(name, steps, micro, ROWS, max_norm)
    assert all(n > max_norm for n in ref_norms), "the test must clip"
    assert sorted(first) == sorted(ref_first), "the same parameters must have gradients"
    for k, want in ref_first.items():
        assert_close(first[k], want, name=f"step-0 gradient of {k}")
    # AdamW divides each element's update by its own gradient's magnitude, so a rounding-level
    # difference in a near-zero gradient (summed over ranks vs over the batch) moves that element by
    # up to ~lr: the parameters are compared at the fp16 row of the tolerance table.
    for k, want in ref.state_dict().items():
        assert_close(full[k], want, dtype=torch.float16, name=k)
    assert_close(torch.tensor(norms), torch.tensor(ref_norms), name="grad norms")
    if name == "mlp":  # never used: no gradient, AdamW skipped it; frozen: untouched
        start = H.build(name).state_dict()
        for k in ("unused.weight", "frozen.weight", "frozen.bias"):
            assert torch.equal(full[k], start[k]), k
        assert model.unused.weight.grad is None
    return True


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("micro", [1, 2])
def test_mlp_matches_single_process(ranks, world, micro):
    assert all(ranks.run(world, _train, "mlp", micro, timeout=TIMEOUT))


def test_mlp_keep_gathered_after_forward(ranks):
    assert all(ranks.run(3, _train, "mlp", 1, reshard_after_forward=False, timeout=TIMEOUT))


@pytest.mark.parametrize("name,world,micro", [("gru", 3, 2), ("gru", 2, 1),
                                              ("llama", 3, 1), ("llama", 2, 2)])
def test_models_match_single_process(ranks, name, world, micro):
    assert all(ranks.run(world, _train, name, micro, timeout=TIMEOUT))
