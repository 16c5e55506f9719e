"""Column -> GELU -> Row MLP built from pyfused layers == the same MLP built from nn.Linear.

On every rank each parameter's gradient must be the full model's gradient for the slice that rank
holds -- in sequence-parallel mode too, where the replicated row-parallel bias sees only its rank's
tokens (the layer takes its gradient from the gathered output gradient, all tokens).
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.utils import WORLD_SIZES, assert_close

HIDDEN = 13  # odd on purpose; the sharded FFN dim is 5 * world


def _mlp_matches(rank, world, sp, overlap, dtype, seed):
    from pyfused.layers import ColumnParallelLinear, RowParallelLinear

    torch.manual_seed(seed)
    ffn, seq, batch = 5 * world, 3 * world, 2
    fc1, fc2 = nn.Linear(HIDDEN, ffn).to(dtype), nn.Linear(ffn, HIDDEN).to(dtype)
    x = torch.randn(seq, batch, HIDDEN).to(dtype)
    g = torch.randn(seq, batch, HIDDEN).to(dtype)

    ref_fc1, ref_fc2 = nn.Linear(HIDDEN, ffn).double(), nn.Linear(ffn, HIDDEN).double()
    ref_fc1.load_state_dict(fc1.state_dict()), ref_fc2.load_state_dict(fc2.state_dict())
    x_ref = x.double().requires_grad_()
    y_ref = ref_fc2(F.gelu(ref_fc1(x_ref)))
    (y_ref * g.double()).sum().backward()

    col = ColumnParallelLinear.from_linear(fc1, sequence_parallel=sp, overlap=overlap)
    row = RowParallelLinear.from_linear(fc2, sequence_parallel=sp, overlap=overlap)
    rows = slice(rank * seq // world, (rank + 1) * seq // world) if sp else slice(None)
    x_in = x[rows].clone().requires_grad_()
    y = row(F.gelu(col(x_in)))
    (y * g[rows]).sum().backward()

    o = slice(rank * ffn // world, (rank + 1) * ffn // world)
    tag = f"sp={sp} overlap={overlap} rank {rank}"
    assert_close(y, y_ref[rows], dtype, f"output {tag}")
    assert_close(x_in.grad, x_ref.grad[rows], dtype, f"input grad {tag}")
    assert_close(col.weight.grad, ref_fc1.weight.grad[o], dtype, f"fc1.weight grad {tag}")
    assert_close(col.bias.grad, ref_fc1.bias.grad[o], dtype, f"fc1.bias grad {tag}")
    assert_close(row.weight.grad, ref_fc2.weight.grad[:, o], dtype, f"fc2.weight grad {tag}")
    assert_close(row.bias.grad, ref_fc2.bias.grad, dtype, f"fc2.bias grad {tag}")
    return True


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("overlap", ["unfused", "decomposed", "auto"])
def test_mlp_matches_single_device(ranks, world, sp, overlap):
    assert all(ranks.run(world, _mlp_matches, sp, overlap, torch.float32, seed=world))


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_mlp_low_precision(ranks, sp):
    # one world size per low-precision dtype: the float32 grid above covers the schedule logic
    assert all(ranks.run(3, _mlp_matches, sp, "decomposed", torch.bfloat16, seed=7))
    assert all(ranks.run(2, _mlp_matches, sp, "decomposed", torch.float16, seed=8))


def _gather_and_scatter_options(rank, world):
    from pyfused.layers import ColumnParallelLinear, RowParallelLinear

    torch.manual_seed(0)
    lin1, lin2 = nn.Linear(HIDDEN, 4 * world), nn.Linear(4 * world, 7)
    x = torch.randn(5, HIDDEN)
    col = ColumnParallelLinear.from_linear(lin1, gather_output=True)
    row = RowParallelLinear.from_linear(lin2, input_is_parallel=False)
    xr = x.clone().requires_grad_()
    y = row(col(xr))
    x2 = x.clone().requires_grad_()
    y2 = lin2(lin1(x2))
    y.sum().backward()
    y2.sum().backward()
    assert_close(y, y2)
    assert_close(xr.grad, x2.grad)
    o = slice(rank * 4, rank * 4 + 4)
    assert_close(col.weight.grad, lin1.weight.grad[o])
    assert_close(row.weight.grad, lin2.weight.grad[:, o])
    return True


@pytest.mark.parametrize("world", [2, 3])
def test_gather_output_and_unsplit_input(ranks, world):
    assert all(ranks.run(world, _gather_and_scatter_options))


def _state_dict_round_trip(rank, world):
    from pyfused.layers import ColumnParallelLinear, RowParallelLinear

    torch.manual_seed(1)
    full = nn.Linear(3 * world, 2 * world)
    out = []
    for cls in (ColumnParallelLinear, RowParallelLinear):
        layer = cls.from_linear(full)
        sd = layer.full_state_dict()
        out.append(torch.equal(sd["weight"], full.weight) and torch.equal(sd["bias"], full.bias))
        out.append(torch.equal(layer.to_linear().weight, full.weight))
        # a freshly initialised layer loads the full state and gathers back to it
        fresh = cls(3 * world, 2 * world)
        fresh.load_full_state_dict(full.state_dict())
        out.append(torch.equal(fresh.full_state_dict()["weight"], full.weight))
        # the ordinary state_dict holds only this rank's shard
        out.append(layer.state_dict()["weight"].numel() == full.weight.numel() // world)
    return all(out)


@pytest.mark.parametrize("world", [1, 3, 4])
def test_state_dict_gathers_back(ranks, world):
    assert all(ranks.run(world, _state_dict_round_trip))


def _bad_layer(rank, world, kind):
    from pyfused.comm import InputError
    from pyfused.layers import ColumnParallelLinear, RowParallelLinear

    try:
        if kind == "indivisible":
            ColumnParallelLinear(8, 3 * world + 1)
        elif kind == "differs":
            RowParallelLinear(4 * world * (2 if rank == world - 1 else 1), 8)
        elif kind == "input":
            col = ColumnParallelLinear(8, 2 * world)
            col(torch.randn(3 if rank else 4, 8))
    except InputError as e:
        return str(e)
    return None


@pytest.mark.parametrize("kind", ["indivisible", "differs", "input"])
def test_bad_layer_arguments_fail_on_every_rank(ranks, kind):
    msgs = ranks.run(3, _bad_layer, kind, timeout=30)
    assert msgs[0] is not None and len(set(msgs)) == 1, msgs
    expected = {"indivisible": "must be divisible", "differs": "differs between ranks",
                "input": "differs between ranks"}[kind]
    assert expected in msgs[0], msgs[0]


def _weight_grads_arrive_contiguous(rank, world, sp):
    """Each layer's weight gradient as autograd hands it to the weight (a hook sees it before it
    is accumulated): contiguous, like the [N, K] weight -- no copy into ``weight.grad``."""
    from pyfused.layers import ColumnParallelLinear, RowParallelLinear

    torch.manual_seed(0)
    ffn, seq = 6 * world, 4 * world
    col = ColumnParallelLinear.from_linear(nn.Linear(HIDDEN, ffn), sequence_parallel=sp,
                                           overlap="unfused")
    row = RowParallelLinear.from_linear(nn.Linear(ffn, HIDDEN), sequence_parallel=sp,
                                        overlap="unfused")
    arrived = {}
    for name, layer in (("column", col), ("row", row)):
        layer.weight.register_hook(lambda g, name=name: arrived.setdefault(name, g))
    x = torch.randn(seq // world if sp else seq, 2, HIDDEN, requires_grad=True)
    row(F.gelu(col(x))).sum().backward()
    return {name: (tuple(g.shape), g.is_contiguous()) for name, g in arrived.items()}


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_weight_gradients_arrive_in_the_weights_layout(ranks, sp):
    """The GEMM ops take a layer's weight as ``weight.t()``; their ``b`` gradient comes back laid
    out as that view, so the weight receives a contiguous gradient (as torch's own linear layers
    give it) instead of a transposed one that autograd must copy."""
    for got in ranks.run(2, _weight_grads_arrive_contiguous, sp):
        assert all(contiguous for _, contiguous in got.values()) and len(got) == 2, got
