"""The plan cache (pyfused/comm/plans.py, csrc/plan_cache.cpp): which calls it tells apart, what it
never stores, that it is cleared with validation's record, and that a call found in it runs exactly
as the call that made it, in both implementations (C++ where pyfused._C is built, and Python)."""
import sys

import pytest
import torch
import torch.distributed as dist

from pyfused import _ext, comm
from pyfused.comm import plans
from pyfused.ops.registry import OPS

TIMEOUT = 60
IMPLEMENTATIONS = ["cpp", "python"]


@pytest.fixture(params=IMPLEMENTATIONS)
def implementation(request):
    """Each test runs against both implementations; the C++ one must exist where _C is built."""
    if request.param == "cpp":
        if _ext.load() is None:
            pytest.skip(f"pyfused._C not built: {_ext.load_error()}")
        plans.use_python_implementation(False)
        assert plans.IMPLEMENTATION.startswith("C++"), plans.IMPLEMENTATION
    else:
        plans.use_python_implementation(True)
    yield request.param
    plans.use_python_implementation(False)


class Sentinel:
    """A plan stand-in whose identity a lookup must return."""


def _variants(a, b):
    """Calls that differ from (7, None, "auto", 0, a, b) in exactly one field of the key."""
    return {
        "op": (8, None, "auto", 0, a, b),
        "method": (7, None, "unfused", 0, a, b),
        "chunks": (7, None, "auto", 2, a, b),
        "chunks as float": (7, None, "auto", 0.0, a, b),
        "chunks as bool": (7, None, "auto", False, a, b),
        "a shape": (7, None, "auto", 0, a[:2], b),
        "a dims": (7, None, "auto", 0, a.unsqueeze(0), b),
        "a dtype": (7, None, "auto", 0, a.double(), b),
        "b requires grad": (7, None, "auto", 0, a, b.detach().requires_grad_()),
        "b on meta": (7, None, "auto", 0, a, b.to("meta")),
        "a tensor for a scalar": (7, None, "auto", a, a, b),
        "None for a tensor": (7, None, "auto", 0, None, b),
    }


def test_key_tells_calls_apart(implementation):
    a, b = torch.randn(3, 4), torch.randn(4, 5)
    plan = Sentinel()
    assert plans.lookup(7, None, "auto", 0, a, b) is None
    assert plans.store(plan, 7, None, "auto", 0, a, b)
    assert plans.lookup(7, None, "auto", 0, a, b) is plan
    # the same metadata in other tensors (values and strides are not part of the key)
    assert plans.lookup(7, None, "auto", 0, torch.zeros(3, 4), b.t().contiguous().t()) is plan
    for name, call in _variants(a, b).items():
        assert plans.lookup(*call) is None, name
    with torch.no_grad():
        assert plans.lookup(7, None, "auto", 0, a, b) is None, "grad mode"
    assert plans.count() == 1


def test_floats_by_bits_and_unusual_arguments_never_stored(implementation):
    a = torch.randn(2, 2)
    zero, negative_zero = Sentinel(), Sentinel()
    assert plans.store(zero, 1, None, "auto", 0.0, a) and plans.store(negative_zero, 1, None, "auto", -0.0, a)
    assert plans.lookup(1, None, "auto", 0.0, a) is zero
    assert plans.lookup(1, None, "auto", -0.0, a) is negative_zero

    class SubTensor(torch.Tensor):
        pass

    for args in [("bogus", 0, a), (["auto"], 0, a), ("auto", [0], a), ("auto", 2 ** 70, a),
                 ("auto", 0, a.as_subclass(SubTensor)), ("auto", 0, "not a tensor")]:
        assert not plans.store(Sentinel(), 1, None, *args), args
        assert plans.lookup(1, None, *args) is None, args
    assert plans.count() == 2


def test_parameters_are_keyed_like_tensors(implementation):
    w = torch.nn.Parameter(torch.randn(4, 5))
    plan = Sentinel()
    assert plans.store(plan, 3, None, "auto", w)
    assert plans.lookup(3, None, "auto", torch.randn(4, 5, requires_grad=True)) is plan


def test_references_are_released_on_clear(implementation):
    group, plan = object(), Sentinel()
    before = sys.getrefcount(group), sys.getrefcount(plan)
    a = torch.randn(2)
    assert plans.store(plan, 5, group, "auto", a)
    assert plans.lookup(5, group, "auto", a) is plan
    assert sys.getrefcount(group) > before[0] and sys.getrefcount(plan) > before[1]
    plans.clear()
    assert (sys.getrefcount(group), sys.getrefcount(plan)) == before
    assert plans.lookup(5, group, "auto", a) is None


def test_validation_record_and_mode_changes_clear_the_plans(implementation):
    from pyfused import ops

    a, b = torch.randn(5, 7), torch.randn(7, 3)
    ops.matmul_all_reduce(a, b)
    assert plans.lookup(OPS["matmul_all_reduce"].code, None, "auto", 0, a, b) is not None
    comm.forget_seen()
    assert plans.count() == 0
    ops.matmul_all_reduce(a, b)
    assert plans.count() == 1
    comm.set_validation("always")
    try:
        assert plans.count() == 0
        ops.matmul_all_reduce(a, b)
        assert plans.count() == 0, "mode 'always' checks every call: nothing may skip it"
    finally:
        comm.set_validation("first")


def test_a_reinitialised_default_group_is_a_new_key(implementation):
    """group=None names the default group of the moment: after destroy_process_group and a new
    init_process_group, a call must not find the old group's plan."""
    from pyfused import ops

    assert not dist.is_initialized()
    a, b = torch.randn(4, 6), torch.randn(6, 2)
    code = OPS["matmul_all_reduce"].code
    groups = []
    try:
        for _ in range(2):
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
            groups.append(dist.group.WORLD)
            assert plans.lookup(code, None, "unfused", 0, a, b) is None
            torch.testing.assert_close(ops.matmul_all_reduce(a, b, method="unfused"), a @ b)
            plan = plans.lookup(code, None, "unfused", 0, a, b)
            assert plan is not None and plan.pg is dist.group.WORLD
            dist.destroy_process_group()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert groups[0] is not groups[1]


def test_observers_see_plan_hits_and_cost_nothing_outside(implementation):
    from pyfused import ops

    bare = plans.lookup
    seen = []
    x, residual, weight = torch.randn(3, 8), torch.randn(3, 8), torch.ones(8)
    with ops.observe_methods(lambda op, choice: seen.append((op, choice.method))):
        assert plans.lookup is not bare
        for _ in range(3):
            ops.all_reduce_add_rmsnorm(x, residual, weight, method="decomposed")
    assert plans.lookup is bare
    assert seen == [("all_reduce_add_rmsnorm", "decomposed")] * 3


def _repeats_match_first_calls(rank, world, implementation):
    """Each op and method, with and without gradients, called three times: the calls found in the
    plan cache return exactly what the first (validated) call returned, gradients included."""
    from pyfused.ops.registry import OPS as ops_table

    plans.use_python_implementation(implementation == "python")
    try:
        mismatches = []
        for name, spec in ops_table.items():
            # leading dims (3, 2): the N-D path too
            inputs = spec.make_inputs(world, (3, 2), 7, 6, seed=11)[rank]
            for method in (*spec.everywhere_methods, "auto"):
                for grad in (False, True):
                    results = []
                    for _ in range(3):
                        leaves = [t.detach().clone().requires_grad_(grad and t.is_floating_point())
                                  for t in inputs]
                        out = spec.function(*leaves, method=method)
                        outs = out if isinstance(out, tuple) else (out,)
                        if grad:
                            sum(o.square().sum() for o in outs).backward()
                        results.append([o.detach() for o in outs]
                                       + [leaf.grad for leaf in leaves if leaf.requires_grad])
                    for repeat in results[1:]:
                        if not all(torch.equal(x, y) for x, y in zip(results[0], repeat)):
                            mismatches.append((name, method, grad))
        return mismatches, plans.count() > 0
    finally:
        plans.use_python_implementation(False)


@pytest.mark.parametrize("world", [1, 3])
def test_repeated_calls_run_like_the_validated_first_call(ranks, world, implementation):
    if implementation == "cpp" and _ext.load() is None:
        pytest.skip("pyfused._C not built")
    for mismatches, cached in ranks.run(world, _repeats_match_first_calls, implementation,
                                        timeout=TIMEOUT * 3):
        assert mismatches == [] and cached


def test_the_cpp_table_starts_over_when_full():
    if _ext.load() is None:
        pytest.skip(f"pyfused._C not built: {_ext.load_error()}")
    plans.use_python_implementation(False)
    try:
        for i in range(4097):
            assert plans.store(Sentinel(), 9, None, "auto", i)
        assert plans.count() == 1  # the 4097th store found the table full and started over
        assert plans.lookup(9, None, "auto", 4096) is not None
        assert plans.lookup(9, None, "auto", 0) is None
    finally:
        plans.clear()


def _layer_repeats_match_linear(rank, world, implementation):
    """Column- and row-parallel layers, with and without autograd, forward (and backward) three
    times: every repeat, found in the plan cache, equals the first call, and the gathered output
    equals the single-device nn.Linear's."""
    from pyfused.layers import ColumnParallelLinear, RowParallelLinear

    plans.use_python_implementation(implementation == "python")
    try:
        torch.manual_seed(5)
        full = torch.nn.Linear(9, 6 * world)
        x = torch.randn(2, 3, 9)
        layers = {"column": ColumnParallelLinear.from_linear(full, gather_output=True),
                  "row": RowParallelLinear.from_linear(torch.nn.Linear(3 * world, 7),
                                                       input_is_parallel=False)}
        problems = []
        for name, layer in layers.items():
            inp = x if name == "column" else torch.randn(2, 3, 3 * world)
            expected = full(x) if name == "column" else layer.to_linear()(inp)
            for grad in (False, True):
                outs = []
                for _ in range(3):
                    layer.zero_grad()
                    leaf = inp.detach().clone().requires_grad_(grad)
                    with torch.set_grad_enabled(grad):
                        y = layer(leaf)
                    if grad:
                        y.square().sum().backward()
                    outs.append([y.detach()] + ([leaf.grad, layer.weight.grad] if grad else []))
                if not all(torch.equal(a, b) for repeat in outs[1:] for a, b in zip(outs[0], repeat)):
                    problems.append((name, grad, "repeat differs"))
                if not torch.allclose(outs[0][0], expected.detach(), atol=1e-5, rtol=1e-5):
                    problems.append((name, grad, "differs from nn.Linear"))
        return problems
    finally:
        plans.use_python_implementation(False)


@pytest.mark.parametrize("world", [1, 3])
def test_layer_repeats_run_like_the_first_forward(ranks, world, implementation):
    for problems in ranks.run(world, _layer_repeats_match_linear, implementation, timeout=TIMEOUT):
        assert problems == []
