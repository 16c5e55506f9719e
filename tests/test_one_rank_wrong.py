"""One rank alone gets an argument wrong: every rank raises the same InputError, and nobody hangs.

For every op and every tensor-parallel layer, at world size 3 (the odd rank count), rank 1 alone
passes: an invalid method / overlap, a non-tensor, a group it is not a member of, a different
``chunks=`` (chunked ops), an input that needs a gradient when the others' do not (it decides
whether backward runs collectives), and the layer options that used to be checked only locally.
"""
import pytest
import torch

from pyfused.ops.registry import CHUNKED_OPS, OPS

WORLD = 3
WRONG_RANK = 1
TIMEOUT = 60  # a hang shows as a timeout; each case takes well under a second

OP_CASES = ["method", "non-tensor", "group", "needs-grad"]
LAYERS = ["column", "column-sp", "row", "row-sp", "row-full-input"]
LAYER_CASES = ["overlap", "group", "non-tensor", "needs-grad"]
LAYER_ONLY_CASES = [("column-sp", "gather-output"), ("row-full-input", "input-width")]

_outside_group = {}


def _group_without_wrong_rank():
    """A group of ranks 0 and 2, made once per process (new_group is called by every rank)."""
    import torch.distributed as dist

    if "pg" not in _outside_group:
        _outside_group["pg"] = dist.new_group([r for r in range(WORLD) if r != WRONG_RANK])
    return _outside_group["pg"]


def _op_args(op: str, rank: int, case: str):
    """(args, kwargs) of ``op`` on this rank: valid everywhere except on WRONG_RANK for ``case``.
    The inputs are the op's own (its ``make_inputs`` hook); the group is passed by keyword."""
    wrong = rank == WRONG_RANK
    tensors = list(OPS[op].make_inputs(WORLD, 2, 5, 4, seed=0)[rank])
    kwargs = {"method": OPS[op].methods[0]}
    kwargs["group"] = _group_without_wrong_rank() if case == "group" and wrong else None
    if wrong and case == "method":
        kwargs["method"] = "fastest"
    if wrong and case == "non-tensor":
        tensors[0] = tensors[0].tolist()
    if wrong and case == "needs-grad":
        tensors[0].requires_grad_()
    if case == "chunks":
        kwargs.update(method="decomposed", chunks=2 if wrong else 0)
    return tuple(tensors), kwargs


def _op_error(rank, world, op, case):
    from pyfused.comm import InputError, forget_seen

    _group_without_wrong_rank()
    forget_seen()  # see tests/op_checks.py error_of
    args, kwargs = _op_args(op, rank, case)
    try:
        OPS[op].function(*args, **kwargs)
    except InputError as e:
        return str(e)
    return None


OP_PARAMS = [(op, case) for op in OPS for case in OP_CASES] + [(op, "chunks") for op in CHUNKED_OPS]


@pytest.mark.parametrize("op,case", OP_PARAMS)
def test_op_argument_wrong_on_one_rank(ranks, op, case):
    errors = ranks.run(WORLD, _op_error, op, case, timeout=TIMEOUT)
    assert errors[0] is not None and len(set(errors)) == 1, errors
    assert errors[0].startswith(f"pyfused.{op}: ") and f"rank {WRONG_RANK}" in errors[0], errors[0]


def _layer(kind: str, rank: int, case: str):
    from pyfused.layers import ColumnParallelLinear, RowParallelLinear

    wrong = rank == WRONG_RANK
    group = _group_without_wrong_rank() if case == "group" and wrong else None
    overlap = "fastest" if case == "overlap" and wrong else "unfused"
    torch.manual_seed(0)
    if kind.startswith("column"):
        sp = kind == "column-sp"
        return ColumnParallelLinear(6, 6, group=group, overlap=overlap, sequence_parallel=sp,
                                    gather_output=case == "gather-output" and wrong)
    return RowParallelLinear(6, 6, group=group, overlap=overlap, sequence_parallel=kind == "row-sp",
                             input_is_parallel=kind != "row-full-input")


def _layer_input(kind: str, rank: int, case: str):
    wrong = rank == WRONG_RANK
    width = 2 if kind in ("row", "row-sp") else 6
    if case == "input-width" and wrong:
        width = 5
    rows = 2 if kind == "column-sp" else 6
    x = torch.randn(rows, width, generator=torch.Generator().manual_seed(1))
    if case == "needs-grad" and wrong:
        x.requires_grad_()
    if case == "non-tensor" and wrong:
        return x.tolist()
    return x


def _layer_error(rank, world, kind, case):
    from pyfused.comm import InputError, forget_seen

    _group_without_wrong_rank()
    forget_seen()
    try:
        layer = _layer(kind, rank, case)
        layer(_layer_input(kind, rank, case))
    except InputError as e:
        return str(e)
    return None


LAYER_PARAMS = [(k, c) for k in LAYERS for c in LAYER_CASES] + LAYER_ONLY_CASES


@pytest.mark.parametrize("kind,case", LAYER_PARAMS)
def test_layer_argument_wrong_on_one_rank(ranks, kind, case):
    errors = ranks.run(WORLD, _layer_error, kind, case, timeout=TIMEOUT)
    assert errors[0] is not None and len(set(errors)) == 1, errors
    assert "ParallelLinear" in errors[0] and f"rank {WRONG_RANK}" in errors[0], errors[0]


def _seen_calls_skip_the_exchange(rank, world):
    """Mode "first": the first call of a signature exchanges, repeats do not; a new signature on
    every rank exchanges again. Counted by wrapping the exchange's all-gather (comm.agree_on's)."""
    from pyfused import comm
    from pyfused.comm import agreement
    from pyfused.ops import matmul_all_reduce

    comm.set_validation("first")
    calls = []
    real = agreement.all_gather_single
    agreement.all_gather_single = lambda *a, **k: (calls.append(1), real(*a, **k))[1]
    try:
        a, b = torch.randn(6, 4), torch.randn(4, 5)
        for _ in range(3):
            matmul_all_reduce(a, b)
        after_repeats = len(calls)
        matmul_all_reduce(torch.randn(3, 4), b)
        comm.set_validation("always")
        matmul_all_reduce(a, b)
        matmul_all_reduce(a, b)
        always = len(calls) - after_repeats - 1
    finally:
        agreement.all_gather_single = real
        comm.set_validation("first")
    return after_repeats, len(calls) - always - after_repeats, always


def test_first_mode_exchanges_once_per_signature(ranks):
    for first, new, always in ranks.run(WORLD, _seen_calls_skip_the_exchange, timeout=TIMEOUT):
        assert (first, new, always) == (1, 1, 2)


def test_modes_from_argument_and_environment():
    import os
    import subprocess
    import sys

    from pyfused.comm import validate

    for value, mode in (("0", "off"), ("1", "first"), ("always", "always"), ("OFF", "off"),
                        ("first", "first"), (False, "off"), (True, "first")):
        assert validate._parse_mode(value) == mode
    with pytest.raises(ValueError, match="validation mode must be one of"):
        validate.set_validation("sometimes")
    env = dict(os.environ, PYFUSED_VALIDATE="always")
    out = subprocess.run([sys.executable, "-c", "import pyfused.comm as c; print(c.validation_mode())"],
                         env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "always"
    validate.set_validation(False)
    try:
        assert validate.validation_mode() == "off" and not validate.validation_enabled()
    finally:
        validate.set_validation("first")
    assert validate.validation_mode() == "first"


def test_auto_repeats_cost_one_lookup(monkeypatch):
    """Mode "first", one process: the first auto call consults the tuning cache, repeats do not
    (they are the remembered choice: the unfused path plus one dictionary lookup)."""
    from pyfused.comm import forget_seen
    from pyfused.ops import matmul_all_reduce, tuned

    calls = []
    real = tuned.lookup
    monkeypatch.setattr(tuned, "lookup", lambda *a, **k: (calls.append(a), real(*a, **k))[1])
    forget_seen()
    a, b = torch.randn(5, 7), torch.randn(7, 3)
    for _ in range(4):
        torch.testing.assert_close(matmul_all_reduce(a, b, method="auto"), a @ b)
    assert len(calls) == 1
