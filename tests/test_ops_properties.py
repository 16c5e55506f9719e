"""Property-based shapes (hypothesis), op registration (opcheck, torch.compile) and group forms."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from pyfused.ops.registry import GEMM_OPS, OPS as REGISTRY
from tests.op_checks import check_against_reference
from tests.utils import assert_close, rank_tensors

OPS = list(GEMM_OPS)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(op=st.sampled_from(OPS), world=st.sampled_from([2, 3]),
       method=st.sampled_from(["decomposed", "unfused"]),
       rows=st.integers(1, 7), mid=st.lists(st.integers(1, 3), max_size=2), k=st.integers(1, 40),
       n=st.integers(1, 40), dtype=st.sampled_from([torch.float32, torch.float16]))
def test_random_shapes_match_reference(ranks, op, world, method, rows, mid, k, n, dtype):
    d0 = rows * world if REGISTRY[op].scatters_dim0 else rows
    a_shape = (d0, *mid, k)
    assert all(ranks.run(world, check_against_reference, op, method, dtype, a_shape, n, seed=rows + k))


def _opcheck(rank, world, op_name):
    """torch.library.opcheck of the op's registered op on the arguments its ``opcheck_args`` hook
    gives for this rank's inputs (from ``make_inputs``, with gradients)."""
    from pyfused.comm import group_name, resolve_group

    spec = REGISTRY[op_name]
    tensors = [t.requires_grad_(t.is_floating_point())  # index inputs take no gradient
               for t in spec.make_inputs(world, 3, 4, 5, seed=rank)[rank]]
    args = spec.opcheck_args(tensors, group_name(resolve_group(None)))
    torch.library.opcheck(spec.registered_op, args)
    return True


@pytest.mark.parametrize("op", list(REGISTRY))
@pytest.mark.parametrize("world", [1, 2])
def test_opcheck(ranks, op, world):
    """Schema, fake (meta) implementation, autograd registration and AOT dispatch of each op."""
    assert all(ranks.run(world, _opcheck, op))


def _compiled_mlp(rank, world):
    import torch.nn as nn
    import torch.nn.functional as F

    from pyfused.layers import ColumnParallelLinear, RowParallelLinear

    torch.manual_seed(0)
    fc1, fc2 = nn.Linear(8, 4 * world), nn.Linear(4 * world, 8)
    col = ColumnParallelLinear.from_linear(fc1, sequence_parallel=True, overlap="decomposed")
    row = RowParallelLinear.from_linear(fc2, sequence_parallel=True, overlap="decomposed")

    def mlp(x):
        return row(F.gelu(col(x)))

    x = torch.randn(2 * world, 3, 8)
    shard = x[rank * 2:(rank + 1) * 2]
    eager = mlp(shard)
    compiled = torch.compile(mlp, backend="aot_eager", fullgraph=False)(shard)
    assert_close(compiled, eager)
    assert_close(eager, fc2(F.gelu(fc1(x)))[rank * 2:(rank + 1) * 2])
    return True


def test_torch_compile_decomposed(ranks):
    """The ops trace through torch.compile (AOT autograd) on CPU with the decomposed method."""
    assert all(ranks.run(2, _compiled_mlp, timeout=300))


def _subgroups(rank, world):
    """Two disjoint groups {0,2} and {1,3}: the ring must address peers by global rank."""
    import torch.distributed as dist

    from pyfused.ops import (
        all_gather_matmul,
        all_gather_matmul_ref,
        matmul_reduce_scatter,
        matmul_reduce_scatter_ref,
    )

    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    pg = groups[rank % 2]
    members = [0, 2] if rank % 2 == 0 else [1, 3]
    me = members.index(rank)
    a_all = rank_tensors(rank % 2, 2, (4, 6), torch.float32)
    b_all = rank_tensors(10 + rank % 2, 2, (6, 5), torch.float32)
    y = all_gather_matmul(a_all[me], b_all[me], group=pg, method="decomposed")
    assert_close(y, all_gather_matmul_ref(a_all, b_all[me]))
    z = matmul_reduce_scatter(a_all[me], b_all[me], group=pg, method="decomposed")
    assert_close(z, matmul_reduce_scatter_ref(a_all, b_all, me))
    return True


def test_subgroups_use_global_peer_ranks(ranks):
    assert all(ranks.run(4, _subgroups))


def _device_mesh(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    from pyfused.comm import GroupError, resolve_group
    from pyfused.ops import matmul_all_reduce, matmul_all_reduce_ref

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tp = mesh["tp"]
    tp_rank = tp.get_local_rank()
    a_all = rank_tensors(mesh["dp"].get_local_rank(), 2, (3, 7), torch.float32)
    b_all = rank_tensors(5, 2, (7, 4), torch.float32)
    for group in (tp, (mesh, "tp")):
        y = matmul_all_reduce(a_all[tp_rank], b_all[tp_rank], group=group, method="decomposed")
        assert_close(y, matmul_all_reduce_ref(a_all, b_all))
    with pytest.raises(GroupError, match="1-D|dims"):
        resolve_group(mesh)
    return True


def test_device_mesh_dims_as_groups(ranks):
    assert all(ranks.run(4, _device_mesh))


def test_single_process_without_init():
    """With torch.distributed not initialised the ops run as a group of one."""
    from pyfused.ops import matmul_reduce_scatter

    a, b = torch.randn(4, 6), torch.randn(6, 3)
    assert_close(matmul_reduce_scatter(a, b), a @ b)


@settings(max_examples=200, deadline=None)
@given(op=st.text(min_size=1, max_size=12), ints=st.lists(st.integers(-2**40, 2**40), max_size=6),
       shapes=st.lists(st.one_of(st.none(), st.lists(st.integers(0, 2**31), max_size=8)), max_size=4))
def test_signature_round_trip(op, ints, shapes):
    from pyfused.comm import Signature, TensorMeta, op_code

    tensors = tuple(TensorMeta(None, None, None) if s is None else TensorMeta(tuple(s), torch.bfloat16, "cpu")
                    for s in shapes)
    sig = Signature(op_code(op), tuple(ints), tensors)
    assert Signature.decode(sig.encode()) == sig
