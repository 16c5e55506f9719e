"""Bad input gives the same clear error on every rank, quickly, and never hangs the group."""
import os

import pytest
import torch

from pyfused.ops.registry import GEMM_OPS
from tests.op_checks import error_of

F32, F16 = torch.float32, torch.float16
OPS = list(GEMM_OPS)
TIMEOUT = 30  # a hang would show as a timeout; the checks themselves take milliseconds

CASES = {
    # name: (a shape per rank, b shape per rank, a dtype per rank, b dtype per rank, expected text)
    "shapes differ between ranks": (lambda w: [(6, 8)] * (w - 1) + [(12, 8)], lambda w: [(8, 5)] * w,
                                    [F32] * 4, [F32] * 4, "differs between ranks"),
    "wrong b shape on one rank": (lambda w: [(6, 8)] * w, lambda w: [(8, 5)] * (w - 1) + [(7, 5)],
                                  [F32] * 4, [F32] * 4, "must equal b's first"),
    "dtype of a and b differ": (lambda w: [(6, 8)] * w, lambda w: [(8, 5)] * w,
                                [F32] * 4, [F16] * 4, "same dtype"),
    "dtype differs between ranks": (lambda w: [(6, 8)] * w, lambda w: [(8, 5)] * w,
                                    [F32, F16, F32, F32], [F32, F16, F32, F32], "differs between ranks"),
    "b is not 2-D": (lambda w: [(6, 8)] * w, lambda w: [(8, 5, 1)] * w, [F32] * 4, [F32] * 4,
                     "b must be 2-D"),
    "integer inputs": (lambda w: [(6, 8)] * w, lambda w: [(8, 5)] * w, [torch.int64] * 4,
                       [torch.int64] * 4, "must be float32"),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("world", [2, 3])
def test_bad_input_same_error_everywhere(ranks, world, op, case):
    a_shapes, b_shapes, a_dt, b_dt, text = CASES[case]
    errors = ranks.run(world, error_of, op, "decomposed", a_shapes(world), b_shapes(world), a_dt, b_dt,
                       timeout=TIMEOUT)
    assert all(e is not None for e in errors), errors
    assert len(set(errors)) == 1, f"ranks raised different errors: {errors}"
    kind, msg = errors[0]
    assert kind == "InputError" and text in msg and f"pyfused.{op}" in msg, msg


@pytest.mark.parametrize("world", [2, 3, 4])
def test_dim0_not_divisible_for_reduce_scatter(ranks, world):
    errors = ranks.run(world, error_of, "matmul_reduce_scatter", "auto", [(world * 2 + 1, 8)] * world,
                       [(8, 5)] * world, [F32] * 4, [F32] * 4, timeout=TIMEOUT)
    assert len(set(errors)) == 1 and errors[0][0] == "InputError", errors
    assert "divisible by the world size" in errors[0][1]


def test_unknown_method_and_fused_unavailable(ranks):
    errors = ranks.run(2, error_of, "all_gather_matmul", "fastest", [(4, 8)] * 2, [(8, 5)] * 2,
                       [F32] * 2, [F32] * 2, timeout=TIMEOUT)
    assert len(set(errors)) == 1 and errors[0][0] == "InputError" and "method must be" in errors[0][1]
    errors = ranks.run(2, error_of, "all_gather_matmul", "fused", [(4, 8)] * 2, [(8, 5)] * 2,
                       [F32] * 2, [F32] * 2, timeout=TIMEOUT)
    assert len(set(errors)) == 1 and errors[0][0] == "MethodUnavailable", errors
    assert "not available here because" in errors[0][1]
    if os.environ.get("PYFUSED_TEST_BACKEND", "gloo") == "gloo":
        assert "inputs are on cpu" in errors[0][1]


def test_different_ops_on_different_ranks(ranks):
    assert all(m for m in ranks.run(2, _mismatched_ops, timeout=TIMEOUT))


def _mismatched_ops(rank, world):
    from pyfused.comm import InputError
    from pyfused.ops import all_gather_matmul, matmul_all_reduce

    fn = all_gather_matmul if rank == 0 else matmul_all_reduce
    try:
        fn(torch.randn(4, 8), torch.randn(8, 3))
    except InputError as e:
        return "the op called differs between ranks" in str(e)
    return False


def _ops_known_on_one_rank(rank, world):
    import torch.distributed as dist

    from pyfused import comm

    sig = comm.Signature(comm.op_code(f"test.called_only_on_rank{rank}"), (), ())
    try:
        comm.agree(dist.group.WORLD, sig, lambda sigs: None)
    except comm.InputError as e:
        return str(e)
    return None


def test_an_op_other_ranks_never_called_is_named(ranks):
    """Each rank knows the names of the ops it called only; the error (after the name of the op
    this rank called) still names every rank's op, the same on every rank."""
    messages = ranks.run(3, _ops_known_on_one_rank, timeout=TIMEOUT)
    for rank, message in enumerate(messages):
        assert message.startswith(f"pyfused.test.called_only_on_rank{rank}: "), message
    assert len({m.split(": ", 1)[1] for m in messages}) == 1, messages
    assert messages[0].endswith("the op called differs between ranks: rank 0 has "
                                "test.called_only_on_rank0, rank 1 has test.called_only_on_rank1"), messages


def test_group_stays_usable_after_an_error(ranks):
    """After every rank raised, the same group still runs a correct op (nothing half-launched)."""
    assert all(ranks.run(3, _error_then_success, timeout=TIMEOUT))


def _error_then_success(rank, world):
    from pyfused.comm import InputError
    from pyfused.ops import matmul_reduce_scatter

    try:
        matmul_reduce_scatter(torch.randn(4, 8), torch.randn(8, 3))  # 4 % 3 != 0
    except InputError:
        pass
    else:
        return False
    a = torch.full((6, 8), float(rank + 1))
    y = matmul_reduce_scatter(a, torch.ones(8, 3), method="decomposed")
    return bool(torch.all(y == 8 * sum(range(1, world + 1))))


def test_per_device_backends_validate_on_the_host(monkeypatch, caplog):
    """A group made with ``backend="cpu:gloo,cuda:nccl"`` exchanges signatures on its CPU backend
    (no GPU sync); a NCCL-only group says once, at INFO, why its check waits for the GPU and how to
    avoid that. (Creating a NCCL group needs a GPU; the backend string is what the choice reads.)"""
    import logging
    import types

    from pyfused.comm import comm_device, group as group_mod, validate as validate_mod

    fake = types.SimpleNamespace(group_name="tp0")
    monkeypatch.setattr(group_mod.dist, "get_backend", lambda pg=None: "cpu:gloo,cuda:nccl")
    assert comm_device(fake) == torch.device("cpu")
    monkeypatch.setattr(group_mod.dist, "get_backend", lambda pg=None: "gloo")
    assert comm_device(fake) == torch.device("cpu")

    monkeypatch.setattr(validate_mod.dist, "get_backend", lambda pg=None: "nccl")
    monkeypatch.setattr(validate_mod, "_gpu_sync_noted", False)
    with caplog.at_level(logging.INFO, logger="pyfused"):
        validate_mod._note_gpu_sync(fake)
        validate_mod._note_gpu_sync(fake)
    notes = [r.getMessage() for r in caplog.records if "cpu:gloo,cuda:nccl" in r.getMessage()]
    assert len(notes) == 1 and "group tp0 has no CPU backend (nccl)" in notes[0], notes


def _grad_differs(rank, world):
    from pyfused.comm import InputError
    from pyfused.ops import all_gather_matmul

    a = torch.randn(4, 8, requires_grad=rank == 0)
    try:
        all_gather_matmul(a, torch.randn(8, 3), method="decomposed")
    except InputError as e:
        msg = str(e)
    else:
        return None
    # Agreeing ranks go on: both need it now, forward and backward run.
    y = all_gather_matmul(torch.randn(4, 8, requires_grad=True), torch.randn(8, 3), method="decomposed")
    y.sum().backward()
    return msg


def test_ranks_disagreeing_on_a_gradient_fail_before_backward_hangs(ranks):
    """all_gather_matmul's backward is a reduce-scatter that runs only where a needs a gradient; a
    rank whose a does not would leave the others waiting in backward. Every rank raises instead."""
    msgs = ranks.run(2, _grad_differs, timeout=TIMEOUT)
    assert msgs[0] == msgs[1] and msgs[0] is not None, msgs
    assert "which inputs need a gradient" in msgs[0] and "rank 0 has a, rank 1 has none" in msgs[0]


def test_observe_methods_sees_first_and_remembered_calls():
    # a single process (no process group): the second call is a remembered one in mode "first"; the
    # observer must still see it, and nothing once the block is left
    import pyfused.ops as ops

    seen = []
    a, b = torch.randn(5, 7), torch.randn(7, 3)
    with ops.observe_methods(lambda op, choice: seen.append((op, choice.method))):
        ops.matmul_all_reduce(a, b, method="auto")
        ops.matmul_all_reduce(a, b, method="decomposed")
        ops.matmul_all_reduce(a, b, method="auto")
    ops.matmul_all_reduce(a, b, method="auto")
    assert seen == [("matmul_all_reduce", "unfused"), ("matmul_all_reduce", "decomposed"),
                    ("matmul_all_reduce", "unfused")], seen


def test_calls_that_cannot_be_remembered_are_checked_every_time():
    """An unhashable ``method=`` cannot key the seen set: every such call is refused again, and a
    remembered float eps is told apart from a bool or a NaN one (world size 1, no group)."""
    from pyfused import ops
    from pyfused.comm.validate import InputError

    a, b = torch.randn(4, 8), torch.randn(8, 3)
    for _ in range(2):
        with pytest.raises(InputError, match="method must be one of"):
            ops.matmul_all_reduce(a, b, method=["auto"])
    x, residual, weight = torch.randn(2, 4), torch.randn(2, 4), torch.ones(4)
    ops.all_reduce_add_rmsnorm(x, residual, weight, eps=1.0)
    for bad in (True, float("nan"), float("nan"), -1.0):
        with pytest.raises(InputError, match="eps must be"):
            ops.all_reduce_add_rmsnorm(x, residual, weight, eps=bad)
